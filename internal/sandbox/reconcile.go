package sandbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/hub"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/snapshot"
	"github.com/forkd/forkd/internal/state"
)

// ReconcileReport says what Reconcile found and did.
type ReconcileReport struct {
	// Adopted: running records whose VMM is alive (same pid and start
	// time); they keep running.
	Adopted []string `json:"adopted"`
	// Dead: records whose VMM is gone, marked dead, run dir removed.
	Dead []string `json:"dead"`
	// Aborted: records of children whose restore never finished (status
	// starting), or whose fork batch was never answered (its starter died
	// before it closed); their VMM was killed and the record removed.
	Aborted []string `json:"aborted"`
	// OrphanProcesses: VMM processes of this data dir that no record owns,
	// killed.
	OrphanProcesses []int `json:"orphan_processes"`
	// OrphanDirs: run dirs no record owns, removed.
	OrphanDirs []string `json:"orphan_dirs"`
}

// Reconcile makes the host agree with the state store, for a daemon
// starting up: it re-adopts every running sandbox whose VMM is still the
// recorded process (pid and start time, never the pid alone), marks dead
// the ones whose VMM is gone and reclaims their run dirs, aborts children
// whose restore was cut short, kills VMM processes and removes run dirs of
// this data dir that no record owns, and reclaims abandoned snapshot and
// image-cache staging and unused disk layers. It needs the state store to
// itself (Config.Daemon), so that no other forkd process is mid-fork.
func (e *Engine) Reconcile(ctx context.Context) (*ReconcileReport, error) {
	if !e.cfg.Daemon {
		return nil, errdefs.FailedPrecondition("reconcile needs the daemon's exclusive hold on the state store")
	}
	rep := &ReconcileReport{}
	list, err := e.state.List()
	if err != nil {
		return nil, err
	}
	var errs []error
	// A fork batch still open whose starter died was never answered:
	// none of its children, running ones included, was made known.
	batches, err := e.state.Batches()
	if err != nil {
		return nil, err
	}
	abandoned := map[string]bool{}
	for id, b := range batches {
		if b.Starter == nil || !proc.Alive(*b.Starter) {
			abandoned[id] = true
		}
	}
	owned := map[string]bool{}         // run dirs records keep
	owners := map[proc.Identity]bool{} // VMM processes records own
	for _, sb := range list {
		switch {
		case abandoned[sb.Batch] && sb.Status != state.StatusParked:
			if err := e.stop(ctx, sb); err != nil {
				errs = append(errs, fmt.Errorf("abort %s of abandoned batch %s: %w", sb.ID, sb.Batch, err))
				delete(abandoned, sb.Batch) // kept open: the next reconcile retries
				continue
			}
			if err := e.state.Delete(sb.ID); err != nil {
				errs = append(errs, err)
				delete(abandoned, sb.Batch)
				continue
			}
			rep.Aborted = append(rep.Aborted, sb.ID)
		case (sb.Status == state.StatusStarting || sb.Status == state.StatusBuilding) && ownedElsewhere(sb):
			// Another forkd process (a CLI command) is making it: it is
			// that process's to finish or undo.
			owned[sb.Handle.RunDir] = true
			if sb.Handle.Process.PID != 0 {
				owners[sb.Handle.Process] = true
			}
		case sb.Status == state.StatusStarting || sb.Status == state.StatusBuilding:
			// Its starter crashed: a child whose restore never finished,
			// or a parent whose build died. Nothing of it is kept.
			if err := e.stop(ctx, sb); err != nil {
				errs = append(errs, fmt.Errorf("abort %s %s: %w", sb.Status, sb.ID, err))
				continue
			}
			if err := e.state.Delete(sb.ID); err != nil {
				errs = append(errs, err)
				continue
			}
			if sb.Status == state.StatusStarting {
				rep.Aborted = append(rep.Aborted, sb.ID)
			}
		case state.Live(sb.Status) && proc.Alive(sb.Handle.Process):
			owned[sb.Handle.RunDir] = true
			owners[sb.Handle.Process] = true
			rep.Adopted = append(rep.Adopted, sb.ID)
			// A daemon that died holding it frozen leaves it frozen, and
			// a frozen VMM answers no QMP: thaw it first.
			if e.cfg.Cgroups != nil {
				if err := e.cfg.Cgroups.Thaw(sb.ID); err != nil {
					e.log.Warn("thaw adopted sandbox", "sandbox", sb.ID, "err", err)
				}
			}
			// A crash in the middle of a branch leaves its source paused:
			// every adopted VM runs again (resuming one that runs is a
			// no-op).
			if m, err := e.cfg.Backend.Attach(ctx, sb.Handle); err == nil {
				if err := m.Resume(ctx); err != nil {
					e.log.Warn("resume adopted sandbox", "sandbox", sb.ID, "err", err)
				}
				// It also leaves the image of its disk unknown: settled
				// now if its VMM tells, else at its next branch.
				if sb.Disk != nil && sb.Disk.Next != "" && sb.Disk.Image != "" {
					if err := e.resolveDisk(ctx, m, sb); err != nil {
						e.log.Warn("settle the disk of adopted sandbox", "sandbox", sb.ID, "err", err)
					}
				}
			}
		case sb.Status == state.StatusParked:
			// Parked VMMs belong to the process that parked them.
			if err := e.stop(ctx, sb); err != nil {
				errs = append(errs, fmt.Errorf("discard parked %s: %w", sb.ID, err))
				continue
			}
			if err := e.state.Delete(sb.ID); err != nil {
				errs = append(errs, err)
			}
		default:
			wasRunning := state.Live(sb.Status)
			e.refresh(sb) // dead, or oom: read before the cgroup goes
			if err := e.release(ctx, sb); err != nil {
				errs = append(errs, err)
			}
			if wasRunning {
				rep.Dead = append(rep.Dead, sb.ID)
			}
		}
	}
	for id := range abandoned {
		if err := e.state.DeleteBatch(id); err != nil {
			errs = append(errs, err)
		}
	}
	if err := e.reclaimIsolation(ctx); err != nil {
		errs = append(errs, err)
	}

	procs, err := e.vmmProcesses()
	if err != nil {
		errs = append(errs, err)
	}
	busy := map[string]bool{} // run dirs of live processes left alone
	for _, p := range procs {
		if owners[p.id] {
			continue
		}
		if p.building {
			// A snapshot build whose starter (a CLI command) still runs.
			busy[p.runDir] = true
			continue
		}
		kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		err := proc.Kill(kctx, p.id)
		cancel()
		if err != nil {
			errs = append(errs, fmt.Errorf("kill orphan VMM %d: %w", p.id.PID, err))
			busy[p.runDir] = true
			continue
		}
		e.log.Warn("killed orphan VMM", "pid", p.id.PID, "run_dir", p.runDir)
		rep.OrphanProcesses = append(rep.OrphanProcesses, p.id.PID)
	}

	entries, err := os.ReadDir(e.runDir)
	if err != nil {
		errs = append(errs, err)
	}
	for _, ent := range entries {
		dir := filepath.Join(e.runDir, ent.Name())
		if owned[dir] || busy[dir] {
			continue
		}
		if err := os.RemoveAll(dir); err != nil {
			errs = append(errs, err)
			continue
		}
		rep.OrphanDirs = append(rep.OrphanDirs, ent.Name())
	}
	if err := e.snaps.Reclaim(); err != nil {
		errs = append(errs, fmt.Errorf("reclaim snapshot staging: %w", err))
	}
	// Snapshots of fork --from whose children all went while no forkd
	// ran (or in a crash) go too.
	if snaps, err := e.snaps.List(); err == nil {
		for _, sn := range snaps {
			if sn.Ephemeral && sn.Status == snapshot.StatusReady {
				e.dropEphemeral(sn.Tag)
			}
		}
	}
	if err := e.images.Reclaim(); err != nil {
		errs = append(errs, fmt.Errorf("reclaim image cache staging: %w", err))
	}
	e.sweepContent()
	if err := e.hub.Prune(hub.StaleBlobAge); err != nil {
		errs = append(errs, fmt.Errorf("prune the pull cache: %w", err))
	}
	// Disk layers a crash left unused (a branch that never committed, a
	// sandbox released while no forkd ran).
	e.gcDisks()
	return rep, errors.Join(errs...)
}

// vmmProcess is a VMM process found on the host that runs in one of this
// engine's run dirs.
type vmmProcess struct {
	id       proc.Identity
	runDir   string
	building bool // a snapshot parent whose starter is still alive
}

// vmmProcesses finds the VMM processes of this data dir: their argv names
// them "forkd-<name>" (QEMU's -name ...,process=forkd-<name>) and their
// working directory is <run>/<name> or below it.
func (e *Engine) vmmProcesses() ([]vmmProcess, error) {
	entries, err := os.ReadDir(proc.Root)
	if err != nil {
		return nil, err
	}
	var out []vmmProcess
	for _, ent := range entries {
		pid, err := strconv.Atoi(ent.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		// Identity first, checked again after reading argv and cwd: a pid
		// reused in between must not be taken for the VMM.
		id, err := proc.Self(pid)
		if err != nil {
			continue // exited meanwhile
		}
		base := filepath.Join(proc.Root, ent.Name())
		name := vmmName(base)
		if name == "" {
			continue
		}
		cwd, err := os.Readlink(filepath.Join(base, "cwd"))
		if err != nil {
			continue
		}
		// The VMM works in <run>/<name> or below it (a chroot jail).
		rel, err := filepath.Rel(e.runDir, strings.TrimSuffix(cwd, " (deleted)"))
		if err != nil {
			continue
		}
		if first, _, _ := strings.Cut(rel, string(filepath.Separator)); first != name {
			continue
		}
		if now, err := proc.Self(pid); err != nil || now != id {
			continue
		}
		p := vmmProcess{id: id, runDir: filepath.Join(e.runDir, name)}
		if strings.HasPrefix(name, "build-") {
			p.building = parentAlive(base)
		}
		out = append(out, p)
	}
	return out, nil
}

// vmmName returns <name> when the process's argv carries
// "process=forkd-<name>", else "".
func vmmName(procDir string) string {
	b, err := os.ReadFile(filepath.Join(procDir, "cmdline"))
	if err != nil {
		return ""
	}
	for _, arg := range bytes.Split(b, []byte{0}) {
		_, rest, ok := bytes.Cut(arg, []byte("process=forkd-"))
		if !ok {
			continue
		}
		name, _, _ := bytes.Cut(rest, []byte(","))
		if len(name) > 0 && !bytes.ContainsAny(name, "/\x00") {
			return string(name)
		}
	}
	return ""
}

// killUnrecorded kills the VMM processes working in sandbox name's run
// dir: those of a starter that crashed before recording its VMM.
func (e *Engine) killUnrecorded(ctx context.Context, name string) error {
	procs, err := e.vmmProcesses()
	if err != nil {
		return err
	}
	dir := filepath.Join(e.runDir, name)
	var errs []error
	for _, p := range procs {
		if p.runDir != dir {
			continue
		}
		kctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		if err := proc.Kill(kctx, p.id); err != nil {
			errs = append(errs, fmt.Errorf("kill unrecorded VMM %d: %w", p.id.PID, err))
		}
		cancel()
	}
	return errors.Join(errs...)
}

// parentAlive reports whether a process's parent is a live forkd process
// (running our executable, or one of the same name): the starter of a
// snapshot build. An orphan is
// reparented to pid 1 or to a subreaper, which runs something else.
func parentAlive(procDir string) bool {
	b, err := os.ReadFile(filepath.Join(procDir, "stat"))
	if err != nil {
		return false
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return false
	}
	f := bytes.Fields(b[i+1:])
	if len(f) < 2 {
		return false
	}
	ppid, err := strconv.Atoi(string(f[1]))
	if err != nil || ppid <= 1 {
		return false
	}
	exe, err := os.Readlink(filepath.Join(proc.Root, strconv.Itoa(ppid), "exe"))
	if err != nil {
		return false
	}
	ours, err := os.Executable()
	if err != nil {
		return false
	}
	// The same program, perhaps another copy of it (a CLI built in a
	// checkout while an installed daemon reconciles).
	exe, ours = strings.TrimSuffix(exe, " (deleted)"), strings.TrimSuffix(ours, " (deleted)")
	return exe == ours || filepath.Base(exe) == filepath.Base(ours)
}

// reclaimIsolation removes network slots and cgroups of this engine that
// no live record holds (a crash between making and recording them, or
// between killing a VMM and releasing them).
func (e *Engine) reclaimIsolation(ctx context.Context) error {
	list, err := e.state.List()
	if err != nil {
		return err
	}
	slots, groups := map[int]bool{}, map[string]bool{}
	for _, sb := range list {
		alive := sb.Status == state.StatusStarting || sb.Status == state.StatusBuilding ||
			(state.Live(sb.Status) && proc.Alive(sb.Handle.Process))
		if !alive {
			continue
		}
		if sb.Net != nil {
			slots[sb.Net.Slot] = true
		}
		// Every live sandbox may have a cgroup: its limits', or the
		// freezer's.
		groups[sb.ID] = true
	}
	var errs []error
	if e.cfg.Net != nil {
		errs = append(errs, e.cfg.Net.Reclaim(ctx, func(slot int) bool { return slots[slot] }))
	}
	if e.cfg.Cgroups != nil {
		errs = append(errs, e.cfg.Cgroups.Reclaim(func(name string) bool { return groups[name] }))
	}
	return errors.Join(errs...)
}
