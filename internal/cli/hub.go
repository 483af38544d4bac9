package cli

import (
	"context"
	"fmt"
	"os"
	"strings"

	"github.com/spf13/cobra"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/client"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/request"
)

// registryFlags are the flags of push and pull.
type registryFlags struct {
	username      string
	passwordStdin bool
	caFile        string
	insecure      bool
}

func (r *registryFlags) register(cmd *cobra.Command) {
	f := cmd.Flags()
	f.StringVar(&r.username, "username", "", "registry user (default: the Docker config's credentials for the registry, or its credential helper)")
	f.BoolVar(&r.passwordStdin, "password-stdin", false, "read the registry password (or token) from stdin")
	f.StringVar(&r.caFile, "ca-file", "", "PEM file of CA certificates to trust for the registry, besides the system's")
	f.BoolVar(&r.insecure, "insecure", false, "allow plain HTTP, to a loopback registry (localhost, 127.0.0.0/8, ::1) only")
}

// options reads the password and CA file the flags name.
func (r *registryFlags) options(ctx context.Context, g *globals) (*apiv1.RegistryAuth, string, error) {
	if r.passwordStdin && r.username == "" {
		return nil, "", errdefs.InvalidArgument("--password-stdin needs --username")
	}
	var auth *apiv1.RegistryAuth
	if r.username != "" {
		auth = &apiv1.RegistryAuth{Username: r.username}
		if r.passwordStdin {
			b, err := readInput(ctx, g.stdin, "the password", 4096)
			if err != nil {
				return nil, "", err
			}
			auth.Password = strings.TrimRight(string(b), "\r\n")
		}
	}
	var ca string
	if r.caFile != "" {
		b, err := os.ReadFile(r.caFile)
		if err != nil {
			return nil, "", errdefs.InvalidArgument("--ca-file: %v", err)
		}
		ca = string(b)
	}
	return auth, ca, nil
}

func newPushCmd(g *globals) *cobra.Command {
	var rf registryFlags
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "push TAG REF [--username U --password-stdin] [--ca-file F] [--insecure] [--json]",
		Short: "Push a snapshot (and its chain) to an OCI registry",
		Long: `Push a snapshot to an OCI registry as an artifact: its memory compressed in
chunks (holes and pages of zeros left out), its state, its kernel, initramfs and
root filesystem. Blobs the repository has already — a root filesystem another
snapshot of the image pushed, chunks of memory that did not change — are not sent
again. A branch is pushed with its chain: each link is an artifact naming its parent
by digest. Prints REF@DIGEST, which pulls exactly this snapshot. See docs/hub.md.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			auth, ca, err := rf.options(ctx, g)
			if err != nil {
				return err
			}
			req := apiv1.PushRequest{Ref: args[1], Auth: auth, CAPEM: ca, Insecure: rf.insecure}
			if _, err := request.Push(args[0], &req); err != nil {
				return err
			}
			return g.transfer(ctx, asJSON, func(c *client.Client) (*apiv1.Operation, error) {
				return c.PushSnapshot(ctx, args[0], req)
			}, func(t *apiv1.Transfer) string { return repoOf(t.Ref) + "@" + t.Digest })
		},
	}
	rf.register(cmd)
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the transfer's summary as JSON")
	return cmd
}

func newPullCmd(g *globals) *cobra.Command {
	var rf registryFlags
	var asJSON bool
	var tag string
	cmd := &cobra.Command{
		Use:   "pull REF [--tag T] [--username U --password-stdin] [--ca-file F] [--insecure] [--json]",
		Short: "Pull a snapshot (and the links of its chain not here) from an OCI registry",
		Long: `Pull a snapshot from an OCI registry, by tag or by digest (REPO@sha256:...).
Nothing but its config is fetched until this host is known to restore it (same
backend, VMM version line, accelerator and CPU); every blob is verified; the tag
appears only once the snapshot is complete. Links of its chain, root filesystems
and kernels this host has are not fetched again; a pull cut short resumes from the
blobs it verified. Prints the snapshot's tag. See docs/hub.md.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			auth, ca, err := rf.options(ctx, g)
			if err != nil {
				return err
			}
			req := apiv1.PullRequest{Ref: args[0], Tag: tag, Auth: auth, CAPEM: ca, Insecure: rf.insecure}
			if _, err := request.Pull(&req); err != nil {
				return err
			}
			return g.transfer(ctx, asJSON, func(c *client.Client) (*apiv1.Operation, error) {
				return c.PullSnapshot(ctx, req)
			}, func(t *apiv1.Transfer) string { return t.Tag })
		},
	}
	rf.register(cmd)
	cmd.Flags().StringVar(&tag, "tag", "", "name of the snapshot here (default: the tag it was pushed from)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the transfer's summary as JSON")
	return cmd
}

func newPackCmd(g *globals) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "pack TAG FILE [--json]",
		Short: "Write a snapshot (and its chain) into a tar file, for a machine no registry reaches",
		Long: `Write a snapshot, with its chain, as an OCI image layout in a tar file: the
artifacts push sends, for air-gapped transfer (forkd unpack reads it). FILE must
not exist. Through a daemon, FILE is on its host, inside its export directory
(forkd serve --export-dir, default <data-dir>/exports).`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			req := apiv1.PackRequest{Path: args[1]}
			if _, err := request.Pack(args[0], &req); err != nil {
				return err
			}
			return g.transfer(ctx, asJSON, func(c *client.Client) (*apiv1.Operation, error) {
				return c.PackSnapshot(ctx, args[0], req)
			}, func(t *apiv1.Transfer) string { return t.Ref })
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the transfer's summary as JSON")
	return cmd
}

func newUnpackCmd(g *globals) *cobra.Command {
	var asJSON bool
	var tag string
	cmd := &cobra.Command{
		Use:   "unpack FILE [--tag T] [--json]",
		Short: "Read a snapshot from a tar file forkd pack wrote",
		Long: `Read a snapshot (and the links of its chain not here) from a tar file forkd
pack wrote, with the checks of a pull. Through a daemon, FILE is on its host,
inside its import directory (forkd serve --import-dir, default <data-dir>/imports).
Prints the snapshot's tag.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			req := apiv1.UnpackRequest{Path: args[0], Tag: tag}
			if _, err := request.Unpack(&req); err != nil {
				return err
			}
			return g.transfer(ctx, asJSON, func(c *client.Client) (*apiv1.Operation, error) {
				return c.UnpackSnapshot(ctx, req)
			}, func(t *apiv1.Transfer) string { return t.Tag })
		},
	}
	cmd.Flags().StringVar(&tag, "tag", "", "name of the snapshot here (default: the tag it was packed from)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the transfer's summary as JSON")
	return cmd
}

// transfer starts a hub operation, shows its progress on stderr until it
// ends, and prints its summary: as JSON with asJSON, else what out says.
func (g *globals) transfer(ctx context.Context, asJSON bool, start func(*client.Client) (*apiv1.Operation, error), out func(*apiv1.Transfer) string) error {
	c, done, err := g.api(ctx)
	if err != nil {
		return err
	}
	defer done()
	op, err := start(c)
	if err != nil {
		return err
	}
	v := newTransferView(g.stderr)
	op, err = c.WatchOperation(ctx, op.ID, v.interval(), v.update)
	v.finish(op)
	if err != nil {
		return err
	}
	if op.Transfer == nil {
		return fmt.Errorf("operation %s ended without a transfer summary", op.ID)
	}
	if asJSON {
		return writeJSON(g.stdout, op.Transfer)
	}
	fmt.Fprintln(g.stdout, out(op.Transfer))
	return nil
}

// repoOf is ref without its tag.
func repoOf(ref string) string {
	if i := strings.LastIndexByte(ref, ':'); i > strings.LastIndexByte(ref, '/') {
		return ref[:i]
	}
	return ref
}
