package cli

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/client"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/snapshot"
)

// snapshotView is the stable JSON shape of a snapshot.
type snapshotView struct {
	Tag         string    `json:"tag"`
	Status      string    `json:"status"`
	Image       string    `json:"image"`
	Backend     string    `json:"backend"`
	Accelerator string    `json:"accelerator"`
	MemoryMiB   int       `json:"memory_mib"`
	VCPUs       int       `json:"vcpus"`
	SizeBytes   int64     `json:"size_bytes"`
	Refcount    int       `json:"refcount"`
	Created     time.Time `json:"created"`
	Parent      string    `json:"parent,omitempty"`
	Network     bool      `json:"network,omitempty"`
	Error       string    `json:"error,omitempty"`   // why a snapshot is failed or corrupt
	Problem     string    `json:"problem,omitempty"` // why it cannot be forked here
	Kind        string    `json:"kind,omitempty"`    // boot or branch
	Mode        string    `json:"mode,omitempty"`    // a branch's: full, diff or live
	Depth       int       `json:"depth,omitempty"`
	Ephemeral   bool      `json:"ephemeral,omitempty"` // goes with its last child (fork --from)
	// Origin is where a pulled (or unpacked) snapshot came from.
	Origin   *apiv1.SnapshotOrigin `json:"origin,omitempty"`
	DiskSlot bool                  `json:"disk_slot,omitempty"` // children can have a disk (--disk-mib)
	DiskMiB  int                   `json:"disk_mib,omitempty"`  // a branch's disk, which every child gets
}

func newImagesCmd(g *globals) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "images",
		Short: "List snapshots",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			views, err := g.listSnapshots(cmd.Context())
			if err != nil {
				return err
			}
			return printList(g, asJSON, "snapshots", "TAG\tSTATUS\tIMAGE\tMEMORY\tSIZE\tCHILDREN\tCREATED\tORIGIN", views, func(v snapshotView) string {
				created := "-"
				if !v.Created.IsZero() {
					created = v.Created.Local().Format(time.DateTime)
				}
				return fmt.Sprintf("%s\t%s\t%s\t%d MiB\t%.1f MiB\t%d\t%s\t%s", v.Tag, v.Status, v.Image, v.MemoryMiB,
					float64(v.SizeBytes)/(1<<20), v.Refcount, created, originString(v.Origin))
			})
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func newRmiCmd(g *globals) *cobra.Command {
	var opts client.RemoveOptions
	cmd := &cobra.Command{
		Use:   "rmi TAG... [--cascade | --force]",
		Short: "Remove snapshots (refused while children use them, or while others were made from them)",
		Long: `Remove snapshots. A snapshot sandboxes use is never removed. One that other
snapshots were branched from (its dependents) is refused, naming them, unless
--cascade (remove the dependents first) or --force (remove it alone: each dependent
still forks, since each holds its whole memory, but its chain is broken).`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, tags []string) error {
			if opts.Cascade && opts.Force {
				return errdefs.InvalidArgument("--cascade and --force: give one")
			}
			for _, tag := range tags {
				if err := snapshot.ValidateTag(tag); err != nil {
					return err
				}
			}
			c, done, err := g.api(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			// Each tag is tried; the ones removed are printed, the others'
			// errors joined (exit non-zero), as kill does.
			var errs []error
			for _, tag := range tags {
				if err := c.DeleteSnapshotWith(cmd.Context(), tag, opts); err != nil {
					errs = append(errs, fmt.Errorf("%s: %w", tag, err))
					continue
				}
				fmt.Fprintln(g.stdout, tag)
			}
			return errors.Join(errs...)
		},
	}
	cmd.Flags().BoolVar(&opts.Cascade, "cascade", false, "also remove the snapshots made from it, recursively")
	cmd.Flags().BoolVar(&opts.Force, "force", false, "remove it even though snapshots were made from it (they keep working, unchained)")
	return cmd
}

// listSnapshots lists the snapshots in images' shape.
func (g *globals) listSnapshots(ctx context.Context) ([]snapshotView, error) {
	c, done, err := g.api(ctx)
	if err != nil {
		return nil, err
	}
	defer done()
	list, err := c.ListSnapshots(ctx)
	views := []snapshotView{}
	for _, s := range list {
		views = append(views, apiSnapshotView(s))
	}
	return views, err
}

// apiSnapshotView is a snapshot from the daemon in images' shape.
func apiSnapshotView(s apiv1.Snapshot) snapshotView {
	return snapshotView{
		Tag: s.Tag, Status: s.Status, Image: s.Image, Backend: s.Backend, Accelerator: s.Accelerator,
		MemoryMiB: s.MemoryMiB, VCPUs: s.VCPUs, SizeBytes: s.SizeBytes, Refcount: s.Refcount,
		Created: s.Created, Parent: s.Parent, Network: s.Network, Error: s.Error, Problem: s.Problem,
		Kind: s.Kind, Mode: s.Mode, Depth: s.Depth, Ephemeral: s.Ephemeral, Origin: s.Origin,
		DiskSlot: s.DiskSlot, DiskMiB: s.DiskMiB,
	}
}

// originString is a snapshot's origin in one column: the reference it
// was pulled from and its digest, shortened ("-" for one made here).
func originString(o *apiv1.SnapshotOrigin) string {
	if o == nil {
		return "-"
	}
	d := o.Digest
	if len(d) > len("sha256:")+12 {
		d = d[:len("sha256:")+12]
	}
	return o.Ref + " (" + d + ")"
}
