package cli

import (
	"context"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/client"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/image"
	"github.com/forkd/forkd/internal/sandbox"
)

func newRunCmd(g *globals) *cobra.Command {
	var img, tag string
	var timeout time.Duration
	var keep bool
	cmd := &cobra.Command{
		Use:   "run --image IMAGE -- CMD [ARGS...]",
		Short: "Run one command in a fresh sandbox of an image (snapshotting it first if needed)",
		Long: `Run one command in a fresh sandbox: the image's snapshot (tag run-<image> unless
--tag) is made if missing, one child is forked, the command runs with its output
and exit code as ours, and the child is killed (unless --keep).`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if cmd.ArgsLenAtDash() != 0 {
				return errdefs.InvalidArgument("usage: forkd run --image IMAGE -- CMD [ARGS...]")
			}
			if err := image.ValidateName(img); err != nil {
				return err
			}
			if tag == "" {
				tag = "run-" + img
			}
			ctx := cmd.Context()
			c, done, err := g.api(ctx)
			if err != nil {
				return err
			}
			defer done()
			if err := ensureSnapshot(ctx, g, c, tag, img); err != nil {
				return err
			}
			res, err := c.CreateSandboxes(ctx, apiv1.CreateSandboxesRequest{SnapshotTag: tag, Metadata: map[string]string{"origin": "run"}})
			if err != nil {
				return err
			}
			id := res.Sandboxes[0].ID
			if keep {
				fmt.Fprintf(g.stderr, "sandbox %s (kept)\n", id)
			} else {
				defer func() {
					kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
					defer cancel()
					if err := c.DeleteSandbox(kctx, id); err != nil {
						fmt.Fprintf(g.stderr, "forkd: kill %s: %v\n", id, err)
					}
				}()
			}
			r, err := c.ExecStream(ctx, id, apiv1.ExecRequest{Args: args, TimeoutSecs: timeout.Seconds()}, nil, g.stdout, g.stderr)
			if err != nil {
				return err
			}
			return exitFor(r.ExitCode, r.Signal, r.TimedOut)
		},
	}
	f := cmd.Flags()
	f.StringVar(&img, "image", "minimal", "image to run in (built-in: minimal, python)")
	f.StringVar(&tag, "tag", "", "snapshot to use or make (default run-<image>)")
	timeoutFlag(f, &timeout, "timeout", "kill the command after this long (0: no limit)")
	f.BoolVar(&keep, "keep", false, "keep the sandbox after the command")
	return cmd
}

// ensureSnapshot makes snapshot tag of image img unless it exists, ready,
// of that image.
func ensureSnapshot(ctx context.Context, g *globals, c *client.Client, tag, img string) error {
	s, err := c.GetSnapshot(ctx, tag)
	switch {
	case err == nil && s.Image != img:
		return errdefs.AlreadyExists("snapshot %s was made from image %s, not %s: pass another --tag", tag, s.Image, img)
	case err == nil && s.Status == apiv1.SnapshotReady && s.Problem == "":
		return nil
	case err == nil:
		return errdefs.FailedPrecondition("snapshot %s is not usable here (%s%s): forkd rmi %s, then run again", tag, s.Status, problemSuffix(s.Problem), tag)
	case !errdefs.IsNotFound(err):
		return err
	}
	fmt.Fprintf(g.stderr, "making snapshot %s of image %s\n", tag, img)
	_, err = buildSnapshot(ctx, g, c, apiv1.CreateSnapshotRequest{Tag: tag, Image: img})
	return err
}

func problemSuffix(p string) string {
	if p == "" {
		return ""
	}
	return ": " + p
}

func newPingCmd(g *globals) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "ping ID",
		Short: "Round trip to a sandbox's guest agent",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := sandbox.ValidateID(args[0]); err != nil {
				return err
			}
			c, done, err := g.api(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			p, err := c.Ping(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if asJSON {
				return writeJSON(g.stdout, p)
			}
			fmt.Fprintf(g.stdout, "%s: agent %s, up %.1fs, %.1f ms\n", args[0], p.AgentVersion, float64(p.UptimeMS)/1000, p.LatencyMS)
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}
