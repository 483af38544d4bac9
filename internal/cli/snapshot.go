package cli

import (
	"context"
	"fmt"

	"github.com/spf13/cobra"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/client"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/request"
	"github.com/forkd/forkd/internal/sandbox"
)

func newSnapshotCmd(g *globals) *cobra.Command {
	var req apiv1.CreateSnapshotRequest
	var asJSON bool
	var netFlag bool
	var from string
	var br branchFlags
	var diff, live bool
	cmd := &cobra.Command{
		Use:   "snapshot --tag TAG [--image minimal] [--warmup CMD]... | --from-sandbox ID [--diff|--live]",
		Short: "Boot a parent VM from an image, warm it, and save it as a snapshot (or branch a sandbox)",
		Long: `Boot a parent VM from an image, warm it, and save it as a snapshot.

With --from-sandbox ID, branch the running sandbox instead, as forkd branch does
(--diff, --live or --mode choose the mode; full without them, as the original forkd).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if from != "" {
				br.tag, br.json = req.Tag, asJSON
				switch {
				case diff && live:
					return errdefs.InvalidArgument("--diff and --live: give one mode")
				case diff:
					br.mode = sandbox.BranchDiff
				case live:
					br.mode = sandbox.BranchLive
				case br.mode == "":
					br.mode = sandbox.BranchFull
				}
				return branch(cmd.Context(), g, from, br)
			}
			if req.Tag == "" {
				return errdefs.InvalidArgument("--tag is required")
			}
			if cmd.Flags().Changed("per-child-netns") {
				req.Network = &netFlag
			}
			if err := checkSnapshot(req); err != nil {
				return err
			}
			c, done, err := g.api(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			snap, err := buildSnapshot(cmd.Context(), g, c, req)
			if err != nil {
				return err
			}
			if asJSON {
				return writeJSON(g.stdout, apiSnapshotView(*snap))
			}
			fmt.Fprintln(g.stdout, snap.Tag)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&req.Tag, "tag", "", "name of the snapshot (required)")
	f.StringVar(&req.Image, "image", "minimal", "image to boot (built-in: minimal, python, code-interpreter)")
	f.IntVar(&req.MemoryMiB, "mem-size-mib", 256, "guest RAM in MiB")
	f.IntVar(&req.VCPUs, "vcpus", 1, "guest vCPUs")
	f.StringArrayVar(&req.Warmup, "warmup", nil, "shell command to run in the parent before the snapshot (repeatable)")
	f.BoolVar(&asJSON, "json", false, "print the snapshot as JSON")
	f.BoolVar(&netFlag, "per-child-netns", false, "give the machine a NIC; every child then gets its own network namespace (default: on as root)")
	f.StringVar(&from, "from-sandbox", "", "branch this running sandbox instead of booting an image")
	f.BoolVar(&diff, "diff", false, "with --from-sandbox: a diff branch")
	f.BoolVar(&live, "live", false, "with --from-sandbox: a live branch")
	f.StringVar(&br.mode, "mode", "", "with --from-sandbox: full (default), diff or live")
	f.BoolVar(&br.noWait, "no-wait", false, "with --from-sandbox: return at once, the snapshot writing")
	return cmd
}

// buildSnapshot starts the snapshot build req asks for, prints its
// progress on stderr as it goes, and returns the snapshot once it is
// ready.
func buildSnapshot(ctx context.Context, g *globals, c *client.Client, req apiv1.CreateSnapshotRequest) (*apiv1.Snapshot, error) {
	if err := checkSnapshot(req); err != nil {
		return nil, err
	}
	op, err := c.CreateSnapshot(ctx, req)
	if err != nil {
		return nil, err
	}
	if _, err := c.WaitOperationProgress(ctx, op.ID, func(line string) { fmt.Fprintln(g.stderr, line) }); err != nil {
		return nil, err
	}
	return c.GetSnapshot(ctx, req.Tag)
}

// checkSnapshot checks req as the daemon will, before anything (the data
// dir included) is touched; a local path may be anywhere here, the daemon
// checks its own import directory.
func checkSnapshot(req apiv1.CreateSnapshotRequest) error {
	_, _, err := request.SnapshotSpec(&req, "")
	return err
}
