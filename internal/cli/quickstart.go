package cli

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"strings"
	"sync"

	"github.com/spf13/cobra"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/client"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/image"
	"github.com/forkd/forkd/internal/image/deb"
	"github.com/forkd/forkd/internal/snapshot"
)

// hostDep is a host command forkd needs and the Debian package that has it.
type hostDep struct {
	path string
	pkg  string
}

// runtimeDeps are what forkd itself runs on the host.
var runtimeDeps = []hostDep{
	{"qemu-system-x86_64", "qemu-system-x86"},
	{"/bin/busybox", "busybox-static"},
	{"mkfs.ext4", "e2fsprogs"},
	{"debootstrap", "debootstrap"},
	{"dpkg-deb", "dpkg"},
	{"apt-get", "apt"},
}

// missingPackages returns the packages whose command is absent.
func missingPackages() []string {
	var pkgs []string
	for _, d := range runtimeDeps {
		if _, err := deb.LookPath(d.path); err != nil {
			pkgs = append(pkgs, d.pkg)
		}
	}
	return pkgs
}

func newQuickstartCmd(g *globals) *cobra.Command {
	var n int
	var yes bool
	var img, tag string
	cmd := &cobra.Command{
		Use:   "quickstart [-n 10] [--yes]",
		Short: "From a fresh machine to N forked children that each ran a command",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return quickstart(cmd.Context(), g, n, yes, img, tag)
		},
	}
	f := cmd.Flags()
	f.IntVarP(&n, "n", "n", 10, "children to fork")
	f.BoolVarP(&yes, "yes", "y", false, "install missing host packages without asking")
	f.StringVar(&img, "image", "python", "image to snapshot (python: the host's distro (Debian/Ubuntu) + numpy; minimal: busybox only)")
	f.StringVar(&tag, "tag", "quickstart", "snapshot tag to create or reuse")
	return cmd
}

func quickstart(ctx context.Context, g *globals, n int, yes bool, img, tag string) error {
	say := func(format string, args ...any) { fmt.Fprintf(g.stderr, "==> "+format+"\n", args...) }
	if err := snapshot.ValidateTag(tag); err != nil {
		return err
	}
	if n < 1 || n > 1000 {
		return errdefs.InvalidArgument("-n %d: want 1 to 1000", n)
	}
	if err := image.ValidateName(img); err != nil {
		return err
	}
	say("checking host packages")
	if pkgs := missingPackages(); len(pkgs) > 0 || needVMMUser() {
		if err := installPackages(ctx, g, pkgs, yes); err != nil {
			return err
		}
	}
	if _, err := os.Stat(agentPath()); err != nil {
		return errdefs.FailedPrecondition("forkd-agent not found at %s: build it with `make build` or set FORKD_AGENT", agentPath())
	}
	c, done, err := g.api(ctx)
	if err != nil {
		return err
	}
	defer done()
	ops := qsOps{c: c, g: g}
	st, err := ops.snapshot(ctx, tag)
	switch {
	case err == nil && st.usable && st.image == img:
		say("reusing snapshot %q (image %s)", tag, img)
	case err == nil && st.image != img:
		// Never replace a snapshot made from another image: it may be
		// someone's work, and the new image may not even exist.
		return errdefs.AlreadyExists("snapshot %q was made from image %q, not %q: pass another --tag, or forkd rmi %s first",
			tag, st.image, img, tag)
	case err == nil || !errdefs.IsNotFound(err):
		say("snapshot %q is stale or unusable here; rebuilding it", tag)
		if rerr := ops.removeSnapshot(ctx, tag); rerr != nil && !errdefs.IsNotFound(rerr) {
			return rerr
		}
		fallthrough
	default:
		say("building image %q and snapshotting it as %q", img, tag)
		if err := ops.createSnapshot(ctx, tag, img); err != nil {
			return err
		}
		if st, err = ops.snapshot(ctx, tag); err != nil {
			return err
		}
	}
	// Idempotence: children of an earlier quickstart are replaced.
	if killed, err := ops.killOrigin(ctx, "quickstart"); err != nil {
		return err
	} else if killed > 0 {
		say("killed %d children of an earlier quickstart", killed)
	}
	say("forking %d children of %q", n, tag)
	ids, wall, err := ops.fork(ctx, tag, n, map[string]string{"origin": "quickstart"})
	if err != nil {
		return err
	}
	say("%d children ready in %.0f ms; running a command in each", n, wall)
	outs := make([]string, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, id := range ids {
		wg.Add(1)
		go func(i int, id string) {
			defer wg.Done()
			if st.python {
				outs[i], errs[i] = ops.eval(ctx, id, quickstartEval)
				outs[i] = fmt.Sprintf("eval %s -> %s", quickstartEval, outs[i])
			} else {
				outs[i], errs[i] = ops.shell(ctx, id, quickstartShell)
			}
		}(i, id)
	}
	wg.Wait()
	for i, id := range ids {
		if errs[i] != nil {
			fmt.Fprintf(g.stdout, "%s\tERROR %v\n", id, errs[i])
			continue
		}
		fmt.Fprintf(g.stdout, "%s\t%s\n", id, outs[i])
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	say("done. Try: forkd ls; forkd exec %s -- uname -a; forkd kill --all", ids[0])
	return nil
}

// What quickstart runs in each child: an eval in the warm interpreter when
// the image has Python (numpy is already imported there), else a shell
// command.
const (
	quickstartEval  = "numpy.zeros(5).sum()"
	quickstartShell = `echo "hello from $(hostname), kernel $(uname -r), up $(cut -d' ' -f1 /proc/uptime)s"`
)

// qsSnapshot is what quickstart needs to know of a snapshot.
type qsSnapshot struct {
	usable bool // forkable here: ready, intact, made by this host's backend and accelerator
	image  string
	python bool
}

// qsOps are quickstart's steps, as API calls.
type qsOps struct {
	c *client.Client
	g *globals
}

func (o qsOps) snapshot(ctx context.Context, tag string) (qsSnapshot, error) {
	s, err := o.c.GetSnapshot(ctx, tag)
	if err != nil {
		return qsSnapshot{}, err
	}
	return qsSnapshot{usable: s.Status == apiv1.SnapshotReady && s.Problem == "", image: s.Image, python: s.Python != ""}, nil
}

// removeSnapshot kills the snapshot's children, then removes it.
func (o qsOps) removeSnapshot(ctx context.Context, tag string) error {
	list, err := o.c.ListSandboxes(ctx, client.ListOptions{Snapshot: tag})
	if err != nil {
		return err
	}
	for _, sb := range list {
		if err := o.c.DeleteSandbox(ctx, sb.ID); err != nil && !errdefs.IsNotFound(err) {
			return err
		}
	}
	return o.c.DeleteSnapshot(ctx, tag)
}

func (o qsOps) createSnapshot(ctx context.Context, tag, img string) error {
	_, err := buildSnapshot(ctx, o.g, o.c, apiv1.CreateSnapshotRequest{Tag: tag, Image: img})
	return err
}

func (o qsOps) killOrigin(ctx context.Context, origin string) (int, error) {
	list, err := o.c.ListSandboxes(ctx, client.ListOptions{Metadata: map[string]string{"origin": origin}})
	if err != nil {
		return 0, err
	}
	for i, sb := range list {
		if err := o.c.DeleteSandbox(ctx, sb.ID); err != nil && !errdefs.IsNotFound(err) {
			return i, err
		}
	}
	return len(list), nil
}

func (o qsOps) fork(ctx context.Context, tag string, n int, md map[string]string) ([]string, float64, error) {
	res, err := o.c.CreateSandboxes(ctx, apiv1.CreateSandboxesRequest{SnapshotTag: tag, N: n, Metadata: md})
	if err != nil {
		return nil, 0, err
	}
	ids := make([]string, len(res.Sandboxes))
	for i, sb := range res.Sandboxes {
		ids[i] = sb.ID
	}
	return ids, res.WallMS, nil
}

func (o qsOps) eval(ctx context.Context, id, code string) (string, error) {
	res, err := o.c.Eval(ctx, id, apiv1.EvalRequest{Code: code, TimeoutSecs: 60})
	if err != nil {
		return "", err
	}
	if res.Error != nil {
		return "", fmt.Errorf("eval: %s: %s", res.Error.Name, res.Error.Message)
	}
	return res.Value, nil
}

func (o qsOps) shell(ctx context.Context, id, cmd string) (string, error) {
	res, err := o.c.Exec(ctx, id, apiv1.ExecRequest{Shell: cmd, TimeoutSecs: 60})
	if err != nil {
		return "", err
	}
	if res.ExitCode != 0 {
		return "", fmt.Errorf("exit %d: %s", res.ExitCode, res.Stdout+res.Stderr)
	}
	return strings.TrimSpace(res.Stdout), nil
}

// needVMMUser reports whether, as root, the system user QEMU drops to is
// missing.
func needVMMUser() bool {
	if os.Geteuid() != 0 {
		return false
	}
	_, err := user.Lookup(DefaultVMMUser)
	return err != nil
}

// installPackages installs Debian packages with apt-get, and creates the
// VMM user when missing, after asking unless yes.
func installPackages(ctx context.Context, g *globals, pkgs []string, yes bool) error {
	if os.Geteuid() != 0 {
		return errdefs.FailedPrecondition("missing host packages %s; run as root (sudo) or install them: apt-get install %s",
			strings.Join(pkgs, " "), strings.Join(pkgs, " "))
	}
	var plan []string
	if len(pkgs) > 0 {
		plan = append(plan, "install with apt-get: "+strings.Join(pkgs, " "))
	}
	mkUser := needVMMUser()
	if mkUser {
		plan = append(plan, "create the system user "+DefaultVMMUser+" (QEMU drops to it)")
	}
	if !yes {
		fmt.Fprintf(g.stderr, "forkd would change this host:\n  %s\nProceed? [y/N] ", strings.Join(plan, "\n  "))
		line, _ := bufio.NewReader(g.stdin).ReadString('\n')
		if a := strings.ToLower(strings.TrimSpace(line)); a != "y" && a != "yes" {
			return errdefs.FailedPrecondition("host left unchanged; rerun with --yes or do it yourself: %s", strings.Join(plan, "; "))
		}
	}
	if mkUser {
		cmd := exec.CommandContext(ctx, "useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", DefaultVMMUser)
		cmd.Stdout, cmd.Stderr = g.stderr, g.stderr
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("useradd %s: %w", DefaultVMMUser, err)
		}
	}
	if len(pkgs) == 0 {
		return nil
	}
	run := func(args ...string) error {
		cmd := exec.CommandContext(ctx, "apt-get", args...)
		cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
		cmd.Stdout, cmd.Stderr = g.stderr, g.stderr
		return cmd.Run()
	}
	if err := run("update", "-q"); err != nil {
		return fmt.Errorf("apt-get update: %w", err)
	}
	if err := run(append([]string{"install", "-y", "-q", "--no-install-recommends"}, pkgs...)...); err != nil {
		return fmt.Errorf("apt-get install: %w", err)
	}
	return nil
}
