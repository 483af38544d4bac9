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
	"time"

	"github.com/spf13/cobra"

	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/sandbox"
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
		if strings.HasPrefix(d.path, "/") {
			if _, err := os.Stat(d.path); err == nil {
				continue
			}
		} else if _, err := lookPathSbin(d.path); err == nil {
			continue
		}
		pkgs = append(pkgs, d.pkg)
	}
	return pkgs
}

func lookPathSbin(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	for _, dir := range []string{"/usr/sbin", "/sbin"} {
		if st, err := os.Stat(dir + "/" + name); err == nil && st.Mode()&0o111 != 0 {
			return dir + "/" + name, nil
		}
	}
	return "", exec.ErrNotFound
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
	f.StringVar(&img, "image", "python", "image to snapshot (python: Debian + numpy; minimal: busybox only)")
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
	say("checking host packages")
	if pkgs := missingPackages(); len(pkgs) > 0 || needVMMUser() {
		if err := installPackages(ctx, g, pkgs, yes); err != nil {
			return err
		}
	}
	if _, err := os.Stat(agentPath()); err != nil {
		return errdefs.FailedPrecondition("forkd-agent not found at %s: build it with `make build` or set FORKD_AGENT", agentPath())
	}
	e, err := g.engine()
	if err != nil {
		return err
	}
	defer e.Close()
	snap, err := e.Snapshots().Get(tag)
	switch {
	case err == nil && snap.Status == snapshot.StatusReady && snap.Image == img &&
		snap.Backend == e.Backend().Name() && snap.Accelerator == e.Backend().Capabilities().Accelerator:
		say("reusing snapshot %q (image %s, made %s)", tag, img, snap.Created.Local().Format(time.DateTime))
	case err == nil || !errdefs.IsNotFound(err):
		say("snapshot %q is stale or unusable here; rebuilding it", tag)
		if _, kerr := e.KillAll(ctx, tag); kerr != nil {
			return kerr
		}
		if rerr := e.RemoveSnapshot(tag); rerr != nil && !errdefs.IsNotFound(rerr) {
			return rerr
		}
		fallthrough
	default:
		say("building image %q and snapshotting it as %q", img, tag)
		if _, err := e.CreateSnapshot(ctx, sandbox.SnapshotSpec{Tag: tag, Image: img}); err != nil {
			return err
		}
	}
	// Idempotence: children of an earlier quickstart are replaced.
	if killed, err := killOrigin(ctx, e, "quickstart"); err != nil {
		return err
	} else if killed > 0 {
		say("killed %d children of an earlier quickstart", killed)
	}
	say("forking %d children of %q", n, tag)
	res, err := e.Fork(ctx, sandbox.ForkSpec{Tag: tag, N: n, Metadata: map[string]string{"origin": "quickstart"}})
	if err != nil {
		return err
	}
	say("%d children ready in %.0f ms; running a command in each", n, res.WallMS)
	snap, err = e.Snapshots().Get(tag)
	if err != nil {
		return err
	}
	outs := make([]string, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, c := range res.Children {
		wg.Add(1)
		go func(i int, id string) {
			defer wg.Done()
			outs[i], errs[i] = runIn(ctx, e, id, snap.Python != "")
		}(i, c.ID)
	}
	wg.Wait()
	for i, c := range res.Children {
		if errs[i] != nil {
			fmt.Fprintf(g.stdout, "%s\tERROR %v\n", c.ID, errs[i])
			continue
		}
		fmt.Fprintf(g.stdout, "%s\t%s\n", c.ID, outs[i])
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	say("done. Try: forkd ls; forkd exec %s -- uname -a; forkd kill --all", res.Children[0].ID)
	return nil
}

// quickstartEval is what quickstart evaluates in each child of a Python
// image: numpy is already imported in the warm interpreter.
const quickstartEval = "numpy.zeros(5).sum()"

// runIn runs quickstart's command in one child and returns its output: an
// eval in the warm interpreter when the image has Python, else a shell
// command.
func runIn(ctx context.Context, e *sandbox.Engine, id string, python bool) (string, error) {
	c, release, err := e.Agent(ctx, id)
	if err != nil {
		return "", err
	}
	defer release()
	if python {
		res, err := c.Eval(ctx, proto.EvalRequest{Code: quickstartEval, Timeout: time.Minute})
		if err != nil {
			return "", err
		}
		if res.Error != nil {
			return "", fmt.Errorf("eval: %s: %s", res.Error.Name, res.Error.Message)
		}
		return fmt.Sprintf("eval %s -> %s (%d ms)", quickstartEval, res.Value, res.DurationMS), nil
	}
	var out strings.Builder
	res, err := c.Exec(ctx, agent.ExecRequest{
		Shell:   `echo "hello from $(hostname), kernel $(uname -r), up $(cut -d' ' -f1 /proc/uptime)s"`,
		Stdout:  &out,
		Stderr:  &out,
		Timeout: time.Minute,
	})
	if err != nil {
		return "", err
	}
	if res.ExitCode != 0 {
		return "", fmt.Errorf("exit %d: %s", res.ExitCode, out.String())
	}
	return strings.TrimSpace(out.String()), nil
}

func killOrigin(ctx context.Context, e *sandbox.Engine, origin string) (int, error) {
	list, err := e.List(ctx)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, sb := range list {
		if sb.Metadata["origin"] != origin {
			continue
		}
		if err := e.Kill(ctx, sb.ID); err != nil {
			return n, err
		}
		n++
	}
	return n, nil
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
