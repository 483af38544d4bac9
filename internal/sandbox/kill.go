package sandbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/proc"
	"github.com/forkd/forkd/internal/snapshot"
	"github.com/forkd/forkd/internal/state"
)

// Kill stops sandbox id, removes its runtime files and its record.
// Killing a sandbox whose VMM already died cleans up after it. A sandbox
// still being started (or a parent being built) by a live forkd process
// belongs to that process until it is ready: killing it then is refused,
// since the starter would otherwise go on with what Kill released.
func (e *Engine) Kill(ctx context.Context, id string) error {
	if err := ValidateID(id); err != nil {
		return err
	}
	defer e.ends.lock(id)()
	sb, err := e.state.Get(id)
	if err != nil {
		return err
	}
	if (sb.Status == state.StatusStarting || sb.Status == state.StatusBuilding) && inFlight(sb) {
		return errdefs.FailedPrecondition("sandbox %s is still %s (by forkd pid %d); kill it once it is ready", id, sb.Status, sb.Starter.PID)
	}
	e.dropClient(id)
	if err := e.stop(ctx, sb); err != nil {
		return fmt.Errorf("kill %s: %w", id, err)
	}
	if err := e.state.Delete(id); err != nil {
		return err
	}
	e.dropEphemeral(sb.Snapshot)
	return nil
}

// stop ends a sandbox's VMM (if it still runs) and releases everything
// else it holds (cgroup, network slot, run dir).
func (e *Engine) stop(ctx context.Context, sb *state.Sandbox) error {
	if err := e.forgetIdle(sb.ID); err != nil {
		return err
	}
	if h := sb.Handle; h.Process.PID != 0 {
		if err := proc.Kill(ctx, h.Process); err != nil {
			return err
		}
	} else if err := e.killUnrecorded(ctx, sb.ID); err != nil {
		// A starter that crashed after starting the VMM but before
		// recording its process: find it by its run dir.
		return err
	}
	return e.release(ctx, sb)
}

// KillAll kills every sandbox, or those of one snapshot when tag is set,
// but not the parents of snapshots being built. It returns the ids killed.
func (e *Engine) KillAll(ctx context.Context, tag string) ([]string, error) {
	list, err := e.state.List()
	if err != nil {
		return nil, err
	}
	var killed []string
	var errs []error
	for _, sb := range list {
		// A snapshot's parent being built belongs to that build; parked
		// VMMs to the pool; a child still starting to its starter.
		if (tag != "" && sb.Snapshot != tag) || sb.Status == state.StatusBuilding || sb.Status == state.StatusParked ||
			(sb.Status == state.StatusStarting && inFlight(sb)) {
			continue
		}
		if err := e.Kill(ctx, sb.ID); err != nil && !errdefs.IsNotFound(err) {
			errs = append(errs, err)
			continue
		}
		killed = append(killed, sb.ID)
	}
	return killed, errors.Join(errs...)
}

// List returns every sandbox (parked VMMs are not sandboxes yet), with
// the status of each checked against the host: a running record whose VMM
// is gone is marked dead (and persisted).
func (e *Engine) List(ctx context.Context) ([]*state.Sandbox, error) {
	all, err := e.state.List()
	if err != nil {
		return nil, err
	}
	list := all[:0]
	for _, sb := range all {
		if sb.Status == state.StatusParked {
			continue
		}
		e.refresh(sb)
		e.showFrozen(sb)
		list = append(list, sb)
	}
	return list, nil
}

// Get returns one sandbox, its status checked against the host.
func (e *Engine) Get(ctx context.Context, id string) (*state.Sandbox, error) {
	if err := ValidateID(id); err != nil {
		return nil, err
	}
	sb, err := e.state.Get(id)
	if err != nil {
		return nil, err
	}
	e.refresh(sb)
	e.showFrozen(sb)
	return sb, nil
}

// refresh marks sb dead (or oom, when its cgroup's memory limit killed
// it) once its VMM process no longer runs, and persists that.
func (e *Engine) refresh(sb *state.Sandbox) {
	if !state.Live(sb.Status) {
		return
	}
	if proc.Alive(sb.Handle.Process) {
		return
	}
	status := state.StatusDead
	if sb.Limits != nil && e.cfg.Cgroups != nil {
		if g, err := e.cfg.Cgroups.Open(sb.ID); err == nil {
			if oom, err := g.OOMKilled(); err == nil && oom {
				status = state.StatusOOM
			}
			g.Close()
		}
	}
	sb.Status = status
	e.dropClient(sb.ID)
	if _, err := e.state.Update(sb.ID, func(r *state.Sandbox) error {
		if state.Live(r.Status) {
			r.Status = status
		}
		return nil
	}); err != nil {
		e.log.Warn("mark sandbox dead", "sandbox", sb.ID, "err", err)
	}
}

// Users returns the ids of live sandboxes of snapshot tag.
func (e *Engine) Users(tag string) ([]string, error) {
	users, err := e.users()
	return users[tag], err
}

// Refcounts returns the number of live sandboxes of every snapshot that has
// any, from one read of the state store.
func (e *Engine) Refcounts() (map[string]int, error) {
	users, err := e.users()
	counts := make(map[string]int, len(users))
	for tag, ids := range users {
		counts[tag] = len(ids)
	}
	return counts, err
}

// users maps snapshot tags to the ids of their live sandboxes: records
// whose VMM runs, not counting parked VMMs and snapshot parents.
func (e *Engine) users() (map[string][]string, error) {
	list, err := e.state.List()
	if err != nil {
		return nil, err
	}
	out := map[string][]string{}
	for _, sb := range list {
		if sb.Status == state.StatusParked || sb.Status == state.StatusBuilding {
			continue
		}
		if proc.Alive(sb.Handle.Process) {
			out[sb.Snapshot] = append(out[sb.Snapshot], sb.ID)
		}
	}
	return out, nil
}

// RemoveSnapshot deletes snapshot tag; refused while any sandbox uses it,
// while it is being written, and while other snapshots were made from it.
// Its parked VMMs are discarded first.
func (e *Engine) RemoveSnapshot(tag string) error {
	_, err := e.RemoveSnapshotWith(tag, snapshot.RemoveOptions{})
	return err
}

// RemoveSnapshotWith is RemoveSnapshot that, with opts, removes the
// snapshots made from tag first (Cascade) or leaves them (Force); it
// returns the tags removed.
func (e *Engine) RemoveSnapshotWith(tag string, opts snapshot.RemoveOptions) ([]string, error) {
	if err := snapshot.ValidateTag(tag); err != nil {
		return nil, err
	}
	if _, err := e.snaps.Get(tag); errdefs.IsNotFound(err) {
		if list, lerr := e.snaps.List(); lerr == nil {
			for _, sn := range list {
				if sn.Tag == tag && sn.Status == snapshot.StatusWriting {
					return nil, errdefs.FailedPrecondition("snapshot %q is still being written", tag)
				}
			}
		}
	}
	tags := []string{tag}
	if opts.Cascade {
		deps, err := e.descendants(tag)
		if err != nil {
			return nil, err
		}
		tags = append(tags, deps...)
	}
	for _, t := range tags {
		if err := e.pool.drop(t); err != nil {
			e.log.Warn("discard parked VMMs", "snapshot", t, "err", err)
		}
	}
	removed, err := e.snaps.RemoveTree(tag, opts)
	if len(removed) > 0 {
		e.sweepContent() // what a pulled snapshot alone used
		e.gcDisks()      // their disk layers may be used by nothing else
	}
	if errors.Is(err, snapshot.ErrInUse) {
		for _, t := range tags {
			if ids, lerr := e.Users(t); lerr == nil && len(ids) > 0 {
				return removed, errdefs.FailedPrecondition("snapshot %q is in use by %d sandbox(es) (%s); kill them first (forkd kill --tag %s)", t, len(ids), shortList(ids), t)
			}
		}
	}
	return removed, err
}

// descendants returns every snapshot made from tag, at any depth.
func (e *Engine) descendants(tag string) ([]string, error) {
	deps, err := e.snaps.Dependents(tag)
	if err != nil {
		return nil, err
	}
	out := append([]string(nil), deps...)
	for _, d := range deps {
		more, err := e.descendants(d)
		if err != nil {
			return nil, err
		}
		out = append(out, more...)
	}
	return out, nil
}

func shortList(ids []string) string {
	if len(ids) > 5 {
		return fmt.Sprintf("%s, … %d more", joinComma(ids[:5]), len(ids)-5)
	}
	return joinComma(ids)
}

func joinComma(s []string) string {
	out := ""
	for i, x := range s {
		if i > 0 {
			out += ", "
		}
		out += x
	}
	return out
}
