package cli

import (
	"context"
	"fmt"

	"github.com/spf13/cobra"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/request"
	"github.com/forkd/forkd/internal/sandbox"
)

// branchFlags are the flags of branch, and of snapshot --from-sandbox.
type branchFlags struct {
	tag, mode    string
	noWait, json bool
}

func newBranchCmd(g *globals) *cobra.Command {
	var b branchFlags
	cmd := &cobra.Command{
		Use:   "branch ID [--tag T] [--mode full|diff|live] [--no-wait] [--json]",
		Short: "Snapshot a running sandbox into a new snapshot more sandboxes fork from",
		Long: `Snapshot a running sandbox's state — guest RAM (processes, the warm interpreter's
variables, files in its in-RAM root), vCPU and device state, and its disk layer —
into a new snapshot. The sandbox keeps running; what it does afterwards never
reaches the snapshot. Modes: diff (default) keeps only the pages that differ from
the sandbox's own snapshot, chained to it; full stands alone; live pauses the
sandbox only to switch over. See docs/branch.md.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error { return branch(cmd.Context(), g, args[0], b) },
	}
	b.register(cmd)
	return cmd
}

func (b *branchFlags) register(cmd *cobra.Command) {
	f := cmd.Flags()
	f.StringVar(&b.tag, "tag", "", "name of the new snapshot (default: branch-<id>-<time>)")
	f.StringVar(&b.mode, "mode", "", "full, diff (default) or live")
	f.BoolVar(&b.noWait, "no-wait", false, "return at once; the snapshot is writing until done (forkd images)")
	f.BoolVar(&b.json, "json", false, "print the snapshot as JSON")
}

// branch branches sandbox id as b says and prints the snapshot.
func branch(ctx context.Context, g *globals, id string, b branchFlags) error {
	if err := sandbox.ValidateID(id); err != nil {
		return err
	}
	wait := !b.noWait
	req := apiv1.BranchRequest{Tag: b.tag, Mode: b.mode, Wait: &wait}
	if _, _, err := request.Branch(id, &req); err != nil {
		return err
	}
	c, done, err := g.api(ctx)
	if err != nil {
		return err
	}
	defer done()
	snap, err := c.Branch(ctx, id, req)
	if err != nil {
		return err
	}
	if b.json {
		return writeJSON(g.stdout, apiSnapshotView(*snap))
	}
	fmt.Fprintln(g.stdout, snap.Tag)
	if snap.Status == apiv1.SnapshotWriting {
		fmt.Fprintf(g.stderr, "writing %s in the background (forkd images shows when it is ready)\n", snap.Tag)
	}
	return nil
}
