package qemu

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
	"github.com/forkd/forkd/internal/vmm"
)

// SaveDevices implements vmm.DeviceSaver: xen-save-devices-state writes the
// device sections (and no RAM) into a memfd passed to QEMU with add-fd, as
// QEMU runs chrooted and cannot open host paths; the state file is the
// head of spec.BaseState followed by those sections (spliceState).
func (m *Machine) SaveDevices(ctx context.Context, spec vmm.DeviceSaveSpec) error {
	if spec.StateFile == "" || spec.BaseState == "" {
		return errdefs.InvalidArgument("save devices: a state file and a base state are needed")
	}
	base, err := readState(spec.BaseState)
	if err != nil {
		return err
	}
	head, err := stateHead(base)
	if err != nil {
		return errdefs.InvalidArgument("base state %s: %w", spec.BaseState, err)
	}
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
		return errdefs.FailedPrecondition("save devices: machine is %s, not paused", st)
	}
	xen, err := saveDeviceSections(ctx, q)
	if err != nil {
		return err
	}
	state, err := spliceState(head, xen)
	if err != nil {
		return fmt.Errorf("device state of qemu %d: %w", m.handle.Process.PID, err)
	}
	return fsutil.WriteFile(spec.StateFile, state, 0o600)
}

// readState reads a state file of at most maxStateBytes.
func readState(path string) ([]byte, error) {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, errdefs.NotFound("state file: %w", err)
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxStateBytes+1))
	if err != nil {
		return nil, err
	}
	if len(b) > maxStateBytes {
		return nil, errdefs.InvalidArgument("state file %s: over %d bytes", path, maxStateBytes)
	}
	return b, nil
}

// saveDeviceSections runs xen-save-devices-state into a memfd and returns
// what it wrote. The machine must be paused: with live:false the command
// neither starts it nor inactivates its disks.
func saveDeviceSections(ctx context.Context, q *qmp) ([]byte, error) {
	fd, err := unix.MemfdCreate("forkd-devices", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("memfd: %w", err)
	}
	mem := os.NewFile(uintptr(fd), "forkd-devices")
	defer mem.Close()
	// QEMU opens /dev/fdset/N write-only and takes only an fd of the
	// fdset with that access mode: give it a write-only one.
	wr, err := os.OpenFile("/proc/self/fd/"+strconv.Itoa(fd), os.O_WRONLY, 0)
	if err != nil {
		return nil, fmt.Errorf("reopen memfd: %w", err)
	}
	defer wr.Close()
	var added struct {
		FDSet int `json:"fdset-id"`
	}
	if err := q.execute(ctx, "add-fd", map[string]any{"opaque": "forkd-devices"}, &added, int(wr.Fd())); err != nil {
		return nil, err
	}
	saveErr := q.execute(ctx, "xen-save-devices-state",
		map[string]any{"filename": "/dev/fdset/" + strconv.Itoa(added.FDSet), "live": false}, nil, -1)
	// The fdset goes whatever happened, or QEMU keeps the memfd open.
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if err := q.execute(rctx, "remove-fd", map[string]any{"fdset-id": added.FDSet}, nil, -1); err != nil {
		return nil, errors.Join(saveErr, err)
	}
	if saveErr != nil {
		return nil, saveErr
	}
	b, err := io.ReadAll(io.NewSectionReader(mem, 0, maxStateBytes+1))
	if err != nil {
		return nil, fmt.Errorf("read device state: %w", err)
	}
	if len(b) > maxStateBytes {
		return nil, fmt.Errorf("device state over %d bytes", maxStateBytes)
	}
	return b, nil
}
