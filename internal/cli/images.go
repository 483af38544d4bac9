package cli

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	apiv1 "github.com/forkd/forkd/api/v1"
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
	Error       string    `json:"error,omitempty"` // why a snapshot is failed or corrupt
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
			return printList(g, asJSON, "snapshots", "TAG\tSTATUS\tIMAGE\tMEMORY\tSIZE\tCHILDREN\tCREATED", views, func(v snapshotView) string {
				created := "-"
				if !v.Created.IsZero() {
					created = v.Created.Local().Format(time.DateTime)
				}
				return fmt.Sprintf("%s\t%s\t%s\t%d MiB\t%.1f MiB\t%d\t%s", v.Tag, v.Status, v.Image, v.MemoryMiB,
					float64(v.SizeBytes)/(1<<20), v.Refcount, created)
			})
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func newRmiCmd(g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "rmi TAG...",
		Short: "Remove snapshots (refused while children use them)",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, tags []string) error {
			for _, tag := range tags {
				if err := snapshot.ValidateTag(tag); err != nil {
					return err
				}
			}
			// Each tag is tried; the ones removed are printed, the others'
			// errors joined (exit non-zero), as kill does.
			remove := func(rm func(string) error) error {
				var errs []error
				for _, tag := range tags {
					if err := rm(tag); err != nil {
						errs = append(errs, fmt.Errorf("%s: %w", tag, err))
						continue
					}
					fmt.Fprintln(g.stdout, tag)
				}
				return errors.Join(errs...)
			}
			c, done, err := g.api(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			return remove(func(tag string) error { return c.DeleteSnapshot(cmd.Context(), tag) })
		},
	}
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
		Created: s.Created, Parent: s.Parent, Network: s.Network, Error: s.Error,
	}
}
