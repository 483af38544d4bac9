package qemu

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/maphash"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/vmm"
)

const (
	defaultMaxDowntime = 50 * time.Millisecond
	defaultLiveTimeout = 2 * time.Minute
	// liveBandwidth lifts QEMU's default cap on migration speed (a few
	// dozen MiB/s): the consumer is local.
	liveBandwidth = 64 << 30
	// maxDowntimeLimit is QEMU's ceiling on downtime-limit (2000 s).
	maxDowntimeLimit = 2000 * time.Second
	// livePoll is how often query-migrate is asked while no event comes.
	livePoll = 50 * time.Millisecond
	// liveSocketBuffer is the send buffer of QEMU's end of the socket.
	liveSocketBuffer = 256 << 10
	// liveFD names the socket passed to QEMU for the migration.
	liveFD = "forkd-live"
)

// SaveLive implements vmm.LiveSaver: QEMU's own precopy migration (its
// dirty tracking) writes into a socketpair whose other end consumeLive
// takes apart while the guest runs. At completion QEMU leaves the machine
// stopped in postmigrate; cont resumes it and re-activates its disks,
// which completion inactivated. spec.Disks are switched to their new
// overlays before that cont (snapshotDisk works on inactive nodes).
//
// QEMU completes once what is left to copy fits in downtime-limit at the
// measured speed. Two things bound a guest that dirties memory faster:
// auto-converge throttles its vCPUs more each round that does not converge
// (QEMU lifts the throttle when the migration ends), and past three
// quarters of the timeout downtime-limit is raised so that the rest is
// copied in one longer pause.
//
// Under TCG, QEMU 7.2 loses dirty pages: its bitmap sync clears dirty bits
// without resetting the TCG TLB entries that let stores skip marking pages
// dirty (fixed upstream in 2024 by "physmem: Fix migration dirty bitmap
// coherency with TCG memory access", not in Debian 12's 7.2.22). Measured
// here: tens of pages per save, and a child of such a save finds stale
// kernel memory and hangs. So under TCG, before cont, every
// page the guest has written since the save started (its private pages
// that are soft-dirty in /proc/PID/pagemap; every private page, written
// since its restore, on a kernel without soft-dirty bits) is read back and
// sent again when it differs from what was sent last (checkPages): the
// pause then also grows with those pages.
//
// The capabilities set here (x-ignore-shared, events, auto-converge) stay
// set in the process; its other migrations are forkd's too.
func (m *Machine) SaveLive(ctx context.Context, spec vmm.LiveSaveSpec) (vmm.LiveStats, error) {
	if spec.StateFile == "" || spec.Page == nil {
		return vmm.LiveStats{}, errdefs.InvalidArgument("live save: a state file and a page sink are needed")
	}
	if spec.MaxDowntime == 0 {
		spec.MaxDowntime = defaultMaxDowntime
	}
	if spec.Timeout == 0 {
		spec.Timeout = defaultLiveTimeout
	}
	if spec.MaxDowntime < time.Millisecond || spec.MaxDowntime > maxDowntimeLimit || spec.Timeout < 0 {
		return vmm.LiveStats{}, errdefs.InvalidArgument("live save: downtime %v, timeout %v", spec.MaxDowntime, spec.Timeout)
	}
	for _, d := range spec.Disks {
		if d.Index < 0 || d.Index >= m.cfg.Disks || d.Overlay == "" {
			return vmm.LiveStats{}, errdefs.InvalidArgument("live save: disk %d of %d, overlay %q", d.Index, m.cfg.Disks, d.Overlay)
		}
	}
	if err := m.check(); err != nil {
		return vmm.LiveStats{}, err
	}
	ram, err := m.ramMapping()
	if err != nil {
		return vmm.LiveStats{}, err
	}
	if ram.Shared() {
		return vmm.LiveStats{}, errdefs.FailedPrecondition("live save: the machine's RAM is its memory file (a booted machine); pause and save its state instead")
	}
	if size := uint64(m.cfg.MemoryMiB) << 20; ram.Size != size {
		return vmm.LiveStats{}, fmt.Errorf("live save: guest RAM mapped over %d bytes, want %d", ram.Size, size)
	}
	q, err := m.monitor(ctx)
	if err != nil {
		return vmm.LiveStats{}, err
	}
	defer q.close()
	st, err := q.runStatus(ctx)
	if err != nil {
		return vmm.LiveStats{}, err
	}
	if st != "running" {
		return vmm.LiveStats{}, errdefs.FailedPrecondition("live save: machine is %s, not running", st)
	}
	caps := map[string]any{"capabilities": []map[string]any{
		{"capability": "x-ignore-shared", "state": true}, // the restore path loads with it on
		{"capability": "events", "state": true},          // MIGRATION events end waits early
		{"capability": "auto-converge", "state": true},
	}}
	if err := q.execute(ctx, "migrate-set-capabilities", caps, nil, -1); err != nil {
		return vmm.LiveStats{}, err
	}
	params := map[string]any{"max-bandwidth": liveBandwidth, "downtime-limit": spec.MaxDowntime.Milliseconds()}
	if err := q.execute(ctx, "migrate-set-parameters", params, nil, -1); err != nil {
		return vmm.LiveStats{}, err
	}
	ls := &liveSave{
		m: m, q: q, ram: ram, page: spec.Page, done: make(chan liveResult, 1),
		check: m.cfg.Accel == "tcg",
	}
	if err := ls.start(ctx); err != nil {
		return vmm.LiveStats{}, err
	}
	defer ls.conn.Close()
	stats, err := ls.run(ctx, spec)
	if err != nil {
		return vmm.LiveStats{}, errors.Join(err, ls.abort(ctx))
	}
	return stats, nil
}

// liveSave is one live save in flight.
type liveSave struct {
	m    *Machine
	q    *qmp
	ram  mapping
	page func(uint64, []byte) error

	conn *os.File // our end of the socketpair
	done chan liveResult
	res  *liveResult // set once done was received
	// events counts MIGRATION events read, by whichever command read
	// them; only the goroutine running the save touches it.
	events int

	// check says whether checkPages runs, and softDirty whether it reads
	// only the pages written since the save started. sums holds, per
	// guest page, the hash of what page last got; the consumer writes it
	// until it ends, checkPages after.
	check     bool
	softDirty bool
	seed      maphash.Seed
	sums      []uint64
	zero      uint64
	// What checkPages reads into, made by prepareCheck: pagemap
	// entries, candidate pages, a page buffer per worker.
	entries   []byte
	idx       []int
	checkBufs [][]byte
}

type liveResult struct {
	state []byte
	pages int64
	err   error
}

// start passes QEMU one end of a socketpair, starts the consumer on the
// other and starts the migration.
func (ls *liveSave) start(ctx context.Context) error {
	if ls.check {
		if err := ls.prepareCheck(); err != nil {
			return fmt.Errorf("live save: %w", err)
		}
	}
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("socketpair: %w", err)
	}
	// What QEMU has written but the consumer not yet taken is what the
	// final check waits for, and it inflates QEMU's estimate of the
	// bandwidth: keep it small, whatever the host's default.
	_ = unix.SetsockoptInt(fds[1], unix.SOL_SOCKET, unix.SO_SNDBUF, liveSocketBuffer)
	if err := unix.SetNonblock(fds[0], true); err != nil {
		unix.Close(fds[0])
		unix.Close(fds[1])
		return fmt.Errorf("socketpair: %w", err)
	}
	// Non-blocking, so the runtime poller serves it and Close ends a
	// Read in progress.
	ls.conn = os.NewFile(uintptr(fds[0]), "migration")
	err = ls.q.execute(ctx, "getfd", map[string]any{"fdname": liveFD}, nil, fds[1])
	unix.Close(fds[1])
	if err != nil {
		ls.conn.Close()
		return err
	}
	ls.q.onEvent = func(name string, _ json.RawMessage) {
		if name == "MIGRATION" {
			ls.events++
		}
	}
	go func() {
		state, pages, err := consumeLive(ls.conn, ls.ram.Size, ls.deliver)
		ls.done <- liveResult{state: state, pages: pages, err: err}
	}()
	if ls.check && softDirtyWorks() {
		// Before the first page is sent: checkPages then reads only
		// what changed after. A failure leaves the full check.
		ls.softDirty = clearSoftDirty(filepath.Join(proc.Root, strconv.Itoa(ls.m.handle.Process.PID))) == nil
	}
	if err := ls.q.execute(ctx, "migrate", map[string]any{"uri": "fd:" + liveFD}, nil, -1); err != nil {
		// migrate takes the fd from the monitor only once it starts.
		cctx, cancel := cleanupContext(ctx)
		defer cancel()
		_ = ls.q.execute(cctx, "closefd", map[string]any{"fdname": liveFD}, nil, -1)
		ls.conn.Close()
		<-ls.done
		return err
	}
	return nil
}

// deliver hands a guest page to the caller, remembering its hash when the
// save ends with checkPages. consumeLive checked off against the RAM size.
func (ls *liveSave) deliver(off uint64, data []byte) error {
	if ls.check {
		h := ls.zero
		if data != nil {
			h = maphash.Bytes(ls.seed, data)
		}
		ls.sums[off/pageSize] = h
	}
	return ls.page(off, data)
}

// cleanupContext bounds work that must happen even after ctx ended.
func cleanupContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
}

// liveStatus is the part of query-migrate a live save reads.
type liveStatus struct {
	Status      string `json:"status"`
	ErrorDesc   string `json:"error-desc"`
	TotalTimeMS int64  `json:"total-time"`
	DowntimeMS  int64  `json:"downtime"`
	RAM         struct {
		Transferred int64 `json:"transferred"`
	} `json:"ram"`
}

// run waits for the migration to complete, resumes the machine and writes
// the state file.
func (ls *liveSave) run(ctx context.Context, spec vmm.LiveSaveSpec) (vmm.LiveStats, error) {
	if err := ls.wait(ctx, spec); err != nil {
		return vmm.LiveStats{}, err
	}
	completed := time.Now()
	var resent int64
	if ls.check {
		// Every page must be in before the check, and the machine
		// stays stopped until the check is done.
		if _, err := ls.result(ctx, 30*time.Second); err != nil {
			return vmm.LiveStats{}, err
		}
		n, err := ls.checkPages()
		if err != nil {
			return vmm.LiveStats{}, fmt.Errorf("check guest pages: %w", err)
		}
		resent = n
	}
	// The disks as they are now go with the state: from here on the
	// guest writes to new overlays. Completion left their nodes inactive
	// (flushed); cont activates them and the new ones. Past the first
	// switch, a failure leaves the disks unknown to the caller.
	switched := false
	fail := func(err error) (vmm.LiveStats, error) {
		if switched && !errors.Is(err, vmm.ErrDiskSwitch) {
			err = fmt.Errorf("%w (%w)", err, vmm.ErrDiskSwitch)
		}
		return vmm.LiveStats{}, err
	}
	for _, d := range spec.Disks {
		if err := ls.m.snapshotDisk(ctx, ls.q, d.Index, d.Overlay); err != nil {
			return fail(err)
		}
		switched = true
	}
	if err := resume(ctx, ls.q); err != nil {
		return fail(err)
	}
	paused := time.Since(completed)
	// QEMU reports completion before it works out the times; they are
	// there once the run state is postmigrate, which resume waited for.
	var st liveStatus
	if err := ls.q.execute(ctx, "query-migrate", nil, &st, -1); err != nil {
		return fail(err)
	}
	r, err := ls.result(ctx, 30*time.Second)
	if err != nil {
		return fail(err)
	}
	if err := fsutil.WriteFile(spec.StateFile, r.state, 0o600); err != nil {
		return fail(err)
	}
	return vmm.LiveStats{
		Downtime:    time.Duration(st.DowntimeMS)*time.Millisecond + paused,
		Total:       time.Duration(st.TotalTimeMS) * time.Millisecond,
		Transferred: st.RAM.Transferred,
		Pages:       r.pages + resent,
		Resent:      resent,
	}, nil
}

// wait polls the migration (woken early by its events) until it
// completes, fails, or runs out of time, and raises downtime-limit once
// three quarters of the time are gone.
func (ls *liveSave) wait(ctx context.Context, spec vmm.LiveSaveSpec) error {
	start := time.Now()
	forceAt, deadline := start.Add(spec.Timeout*3/4), start.Add(spec.Timeout)
	forced := false
	for {
		var st liveStatus
		if err := ls.q.execute(ctx, "query-migrate", nil, &st, -1); err != nil {
			return err
		}
		switch st.Status {
		case "completed":
			return nil
		case "failed", "cancelled":
			// The consumer usually knows why (a page it could not
			// store, a stream it could not read).
			if r, _ := ls.result(ctx, time.Second); r != nil && r.err != nil {
				return r.err
			}
			return fmt.Errorf("migration %s: %s", st.Status, st.ErrorDesc)
		}
		select {
		case r := <-ls.done:
			ls.res = &r
			if r.err != nil {
				return r.err
			}
		default:
		}
		now := time.Now()
		if now.After(deadline) {
			return errdefs.DeadlineExceeded("live save not done after %v", spec.Timeout)
		}
		if !forced && now.After(forceAt) {
			// Copy the rest in one pause, however long: what the time
			// left allows at least.
			limit := min(max(deadline.Sub(now), spec.MaxDowntime), maxDowntimeLimit)
			if err := ls.q.execute(ctx, "migrate-set-parameters", map[string]any{"downtime-limit": limit.Milliseconds()}, nil, -1); err != nil {
				return err
			}
			forced = true
		}
		if ls.events == 0 {
			if _, err := ls.q.awaitEvent(ctx, livePoll); err != nil {
				return err
			}
		}
		ls.events = 0
	}
}

// result waits up to d for the consumer to end and returns what it
// returned.
func (ls *liveSave) result(ctx context.Context, d time.Duration) (*liveResult, error) {
	if ls.res == nil {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case r := <-ls.done:
			ls.res = &r
		case <-t.C:
			return nil, errors.New("live save: the migration stream did not end")
		case <-ctx.Done():
			return nil, fmt.Errorf("live save: %w", ctx.Err())
		}
	}
	return ls.res, ls.res.err
}

// resume continues a machine a migration stopped. A completed migration
// moves the run state from finish-migrate to postmigrate just after it
// reports completion; cont in between would run the vCPUs under a run
// state then set to postmigrate, so it waits for that.
func resume(ctx context.Context, q *qmp) error {
	for i := 0; ; i++ {
		st, err := q.runStatus(ctx)
		if err != nil {
			return err
		}
		switch st {
		case "running":
			return nil
		case "finish-migrate":
			if i == 5000 {
				return fmt.Errorf("machine stays in %s", st)
			}
			time.Sleep(time.Millisecond)
			continue
		}
		return q.execute(ctx, "cont", nil, nil, -1)
	}
}

// abort ends a live save that failed: the consumer stops (closing our end
// of the socket also fails QEMU's writes), the migration is cancelled, and
// the machine is resumed if it is left stopped. It runs after ctx ended
// too, and returns once the consumer has ended.
func (ls *liveSave) abort(ctx context.Context) error {
	ctx, cancel := cleanupContext(ctx)
	defer cancel()
	ls.conn.Close()
	var errs []error
	if err := ls.q.execute(ctx, "migrate_cancel", nil, nil, -1); err != nil {
		errs = append(errs, err)
	}
	for {
		var st liveStatus
		if err := ls.q.execute(ctx, "query-migrate", nil, &st, -1); err != nil {
			errs = append(errs, err)
			break
		}
		if st.Status == "completed" || st.Status == "failed" || st.Status == "cancelled" || st.Status == "none" || st.Status == "" {
			break
		}
		if _, err := ls.q.awaitEvent(ctx, 10*time.Millisecond); err != nil {
			errs = append(errs, err)
			break
		}
	}
	if err := resume(ctx, ls.q); err != nil {
		errs = append(errs, fmt.Errorf("resume after a failed live save: %w", err))
	}
	if ls.res == nil {
		r := <-ls.done
		ls.res = &r
	}
	return errors.Join(errs...)
}
