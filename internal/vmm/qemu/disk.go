package qemu

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strconv"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/vmm"
)

// SnapshotDisk implements vmm.DiskSnapshotter: the overlay goes to QEMU as
// an fd (add-fd; QEMU runs chrooted and cannot open paths), becomes a node
// of its own with no backing (blockdev-add), and blockdev-snapshot puts it
// over the drive's current top, whose node becomes its backing. QEMU does
// not rewrite the overlay's header: the backing file name stays the one
// the caller wrote.
func (m *Machine) SnapshotDisk(ctx context.Context, index int, overlay string) error {
	q, err := m.monitor(ctx)
	if err != nil {
		return err
	}
	defer q.close()
	st, err := q.runStatus(ctx)
	if err != nil {
		return err
	}
	if st != "paused" {
		return errdefs.FailedPrecondition("snapshot disk: machine is %s, not paused", st)
	}
	return m.snapshotDisk(ctx, q, index, overlay)
}

// snapshotDisk is SnapshotDisk on an open monitor, the machine stopped
// (paused, or after a completed migration).
func (m *Machine) snapshotDisk(ctx context.Context, q *qmp, index int, overlay string) error {
	if err := m.writableDisk(ctx, q, index); err != nil {
		return err
	}
	f, err := os.OpenFile(overlay, os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("snapshot disk %d: %w", index, err)
	}
	defer f.Close()
	var added struct {
		FDSet int `json:"fdset-id"`
	}
	if err := q.execute(ctx, "add-fd", map[string]any{"opaque": "forkd-disk"}, &added, int(f.Fd())); err != nil {
		return err
	}
	node := "forkd-d" + strconv.Itoa(index) + "-" + randomHex(6)
	err = q.execute(ctx, "blockdev-add", map[string]any{
		"driver": "qcow2", "node-name": node,
		"file":    map[string]any{"driver": "file", "filename": "/dev/fdset/" + strconv.Itoa(added.FDSet)},
		"backing": nil, // blockdev-snapshot attaches the current top
	}, nil, -1)
	switched := false
	if err == nil {
		err = q.execute(ctx, "blockdev-snapshot", map[string]any{"node": driveID(index), "overlay": node}, nil, -1)
		var re *replyError
		switch {
		case err == nil:
			switched = true
		case errors.As(err, &re):
			// Refused: a transaction, nothing changed.
			cctx, cancel := cleanupContext(ctx)
			err = errors.Join(err, q.execute(cctx, "blockdev-del", map[string]any{"node-name": node}, nil, -1))
			cancel()
		default:
			// No answer: it may have been done.
			err = fmt.Errorf("%w (%w)", err, vmm.ErrDiskSwitch)
		}
	}
	// The node keeps a duplicate of the fd; the set itself goes. Once
	// the disk is switched, a set left behind only keeps an fd open in
	// QEMU: not worth failing a done switch for.
	cctx, cancel := cleanupContext(ctx)
	defer cancel()
	if rerr := q.execute(cctx, "remove-fd", map[string]any{"fdset-id": added.FDSet}, nil, -1); rerr != nil && !switched {
		err = errors.Join(err, rerr)
	}
	if err != nil {
		return fmt.Errorf("snapshot disk %d: %w", index, err)
	}
	return nil
}

// writableDisk checks that disk index exists and is writable.
func (m *Machine) writableDisk(ctx context.Context, q *qmp, index int) error {
	if index < 0 || index >= m.cfg.Disks {
		return errdefs.InvalidArgument("disk %d: the machine has %d", index, m.cfg.Disks)
	}
	var blocks []struct {
		Device   string `json:"device"`
		Inserted *struct {
			RO bool `json:"ro"`
		} `json:"inserted"`
	}
	if err := q.execute(ctx, "query-block", nil, &blocks, -1); err != nil {
		return err
	}
	for _, b := range blocks {
		if b.Device != driveID(index) {
			continue
		}
		if b.Inserted == nil || b.Inserted.RO {
			return errdefs.InvalidArgument("disk %d is read-only", index)
		}
		return nil
	}
	return errdefs.InvalidArgument("disk %d: no drive %s", index, driveID(index))
}

// ResizeDisk implements vmm.DiskSnapshotter with block_resize, which
// raises the virtio-blk configuration change the guest acts on.
func (m *Machine) ResizeDisk(ctx context.Context, index int, bytes int64) error {
	if index < 0 || index >= m.cfg.Disks {
		return errdefs.InvalidArgument("disk %d: the machine has %d", index, m.cfg.Disks)
	}
	if bytes <= 0 || bytes%512 != 0 {
		return errdefs.InvalidArgument("disk size %d: want a positive multiple of 512", bytes)
	}
	q, err := m.monitor(ctx)
	if err != nil {
		return err
	}
	defer q.close()
	if err := q.execute(ctx, "block_resize", map[string]any{"device": driveID(index), "size": bytes}, nil, -1); err != nil {
		return fmt.Errorf("resize disk %d: %w", index, err)
	}
	return nil
}

// driveID is the drive (block backend) name of disk index.
func driveID(index int) string { return "disk" + strconv.Itoa(index) }

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
