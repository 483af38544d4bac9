package qemu

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/vmm"
)

// SnapshotDisk implements vmm.DiskSnapshotter: the overlay goes to QEMU as
// an fd (add-fd; QEMU runs chrooted and cannot open paths), becomes a node
// of its own with no backing (blockdev-add), named after the overlay's
// file (overlayNode, which DiskSwitched looks for), and blockdev-snapshot
// puts it over the drive's current top, whose node becomes its backing.
// QEMU does not rewrite the overlay's header: the backing file name stays
// the one the caller wrote.
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
	node := overlayNode(index, overlay)
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
	b, err := m.queryDisk(ctx, q, index)
	if err != nil {
		return err
	}
	if b.Inserted == nil || b.Inserted.RO {
		return errdefs.InvalidArgument("disk %d is read-only", index)
	}
	return nil
}

// blockInfo is what forkd reads of an entry of query-block's reply (QAPI
// BlockInfo): the drive's name and, when it has a medium, its top node
// (BlockDeviceInfo).
type blockInfo struct {
	Device   string `json:"device"`
	Inserted *struct {
		NodeName string `json:"node-name"`
		RO       bool   `json:"ro"`
	} `json:"inserted"`
}

// queryDisk returns the query-block entry of disk index: InvalidArgument
// when the machine has no such disk.
func (m *Machine) queryDisk(ctx context.Context, q *qmp, index int) (blockInfo, error) {
	if index < 0 || index >= m.cfg.Disks {
		return blockInfo{}, errdefs.InvalidArgument("disk %d: the machine has %d", index, m.cfg.Disks)
	}
	var blocks []blockInfo
	if err := q.execute(ctx, "query-block", nil, &blocks, -1); err != nil {
		return blockInfo{}, err
	}
	for _, b := range blocks {
		if b.Device == driveID(index) {
			return b, nil
		}
	}
	return blockInfo{}, errdefs.InvalidArgument("disk %d: no drive %s", index, driveID(index))
}

// DiskSwitched implements vmm.DiskSwitchChecker: disk index's top node
// (query-block) is overlay's when SnapshotDisk made it the top, since
// the node is named after the overlay's file.
func (m *Machine) DiskSwitched(ctx context.Context, index int, overlay string) (bool, error) {
	q, err := m.monitor(ctx)
	if err != nil {
		return false, err
	}
	defer q.close()
	b, err := m.queryDisk(ctx, q, index)
	if err != nil {
		return false, fmt.Errorf("disk %d switched: %w", index, err)
	}
	return topIs(b, index, overlay)
}

// topIs reports whether b's top node is the overlay's node of disk index.
// A top named by an older forkd (a random suffix of 12 hex digits) may be
// the overlay's as well as an earlier one's: it cannot tell.
func topIs(b blockInfo, index int, overlay string) (bool, error) {
	if b.Inserted == nil || b.Inserted.NodeName == "" {
		return false, fmt.Errorf("disk %d switched: drive %s has no top node", index, b.Device)
	}
	top := b.Inserted.NodeName
	if top == overlayNode(index, overlay) {
		return true, nil
	}
	if rest, ok := strings.CutPrefix(top, nodePrefix(index)); ok && len(rest) == 12 && strings.Trim(rest, "0123456789abcdef") == "" {
		return false, fmt.Errorf("disk %d switched: its top node %s was named by an older forkd, which may have been switching to %s", index, top, filepath.Base(overlay))
	}
	return false, nil
}

// overlayNode is the node name of the overlay at path over disk index:
// the same for the same file name, so that another process can tell that
// node from any other. QMP node names (at most 31 characters, a letter
// first, then letters, digits, '-', '.' and '_'): "forkd-d", the index,
// '-' and 16 hex digits of the SHA-256 of the overlay's base name.
func overlayNode(index int, overlay string) string {
	sum := sha256.Sum256([]byte(filepath.Base(overlay)))
	return nodePrefix(index) + hex.EncodeToString(sum[:8])
}

// nodePrefix starts the names of the overlay nodes of disk index.
func nodePrefix(index int) string { return "forkd-d" + strconv.Itoa(index) + "-" }

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
