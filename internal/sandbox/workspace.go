package sandbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/snapshot"
	"github.com/forkd/forkd/internal/state"
)

// WorkspaceMeta is the metadata key that names a sandbox's workspace.
const WorkspaceMeta = "forkd.workspace"

// ValidateWorkspaceName checks a workspace name: the rules of a snapshot
// tag (it names snapshots of its states), at most 40 characters.
func ValidateWorkspaceName(name string) error {
	if len(name) > 40 {
		return errdefs.InvalidArgument("workspace name %s: at most 40 characters", errdefs.Quote(name))
	}
	if err := snapshot.ValidateTag(name); err != nil {
		return fmt.Errorf("workspace name: %w", err)
	}
	return nil
}

// workspaceOptions are what a workspace's sandboxes are forked with,
// kept with the workspace for each resume.
type workspaceOptions struct {
	Metadata       map[string]string `json:"metadata,omitempty"`
	Net            *NetSpec          `json:"net,omitempty"`
	Limits         *state.Limits     `json:"limits,omitempty"`
	OnUnresponsive string            `json:"on_unresponsive,omitempty"`
	GuestPIDsLimit int               `json:"guest_pids_limit,omitempty"`
	DiskMiB        int               `json:"disk_mib,omitempty"`
}

// CreateWorkspace makes workspace name: a sandbox forked from spec.Tag
// (spec.N is 1), recorded under the name, whose state survives restarts
// and suspensions.
func (e *Engine) CreateWorkspace(ctx context.Context, name string, spec ForkSpec) (*state.Workspace, error) {
	if err := ValidateWorkspaceName(name); err != nil {
		return nil, err
	}
	opts := workspaceOptions{Metadata: spec.Metadata, Net: spec.Net, Limits: spec.Limits,
		OnUnresponsive: spec.OnUnresponsive, GuestPIDsLimit: spec.GuestPIDsLimit, DiskMiB: spec.DiskMiB}
	raw, err := json.Marshal(opts)
	if err != nil {
		return nil, err
	}
	now := time.Now().UTC()
	w := &state.Workspace{Name: name, Snapshot: spec.Tag, Status: state.WorkspaceSuspended, Created: now, Updated: now, Options: raw}
	if err := e.state.PutWorkspace(w, true); err != nil {
		return nil, err
	}
	id, err := e.workspaceFork(ctx, w, spec.Tag)
	if err != nil {
		return nil, errors.Join(err, e.state.DeleteWorkspace(name))
	}
	return e.state.UpdateWorkspace(name, func(r *state.Workspace) error {
		r.Sandbox, r.Status, r.Updated = id, state.WorkspaceRunning, time.Now().UTC()
		return nil
	})
}

// workspaceFork forks w's sandbox from tag with w's options.
func (e *Engine) workspaceFork(ctx context.Context, w *state.Workspace, tag string) (string, error) {
	var opts workspaceOptions
	if len(w.Options) > 0 {
		if err := json.Unmarshal(w.Options, &opts); err != nil {
			return "", fmt.Errorf("workspace %s options: %w", w.Name, err)
		}
	}
	md := map[string]string{}
	for k, v := range opts.Metadata {
		md[k] = v
	}
	md[WorkspaceMeta] = w.Name
	// A state of a workspace with a disk carries it: its size is the
	// workspace's.
	res, err := e.Fork(ctx, ForkSpec{Tag: tag, N: 1, Metadata: md, Net: opts.Net, Limits: opts.Limits,
		OnUnresponsive: opts.OnUnresponsive, GuestPIDsLimit: opts.GuestPIDsLimit, DiskMiB: opts.DiskMiB})
	if err != nil {
		return "", err
	}
	return res.Children[0].ID, nil
}

// SuspendWorkspace branches workspace name's sandbox into a new state
// snapshot, then stops it: no CPU, no RAM held. Its state is what resume
// starts from.
func (e *Engine) SuspendWorkspace(ctx context.Context, name string) (*state.Workspace, error) {
	w, err := e.workspace(name)
	if err != nil {
		return nil, err
	}
	if w.Status != state.WorkspaceRunning || w.Sandbox == "" {
		return nil, errdefs.FailedPrecondition("workspace %s is %s", name, w.Status)
	}
	sb, err := e.Get(ctx, w.Sandbox)
	if err != nil {
		return nil, fmt.Errorf("workspace %s: %w", name, err)
	}
	// A diff branch, unless the chain of its states grew long: then one
	// that stands alone.
	mode := BranchDiff
	if src, err := e.snaps.Get(sb.Snapshot); err == nil && src.Branch != nil && src.Branch.Depth >= snapshot.MaxDepth/2 {
		mode = BranchFull
	}
	tag := fmt.Sprintf("%s-state-%d", name, time.Now().UnixMilli())
	// Recorded first: a crash meanwhile leaves the tag known, to be removed
	// with the workspace (a failed one never resumes).
	if _, err := e.state.UpdateWorkspace(name, func(r *state.Workspace) error {
		r.States = append(r.States, tag)
		return nil
	}); err != nil {
		return nil, err
	}
	if _, err := e.Branch(ctx, BranchSpec{ID: w.Sandbox, Tag: tag, Mode: mode}); err != nil {
		return nil, fmt.Errorf("suspend workspace %s: %w", name, err)
	}
	if err := e.Kill(ctx, w.Sandbox); err != nil && !errdefs.IsNotFound(err) {
		return nil, fmt.Errorf("suspend workspace %s: %w", name, err)
	}
	return e.state.UpdateWorkspace(name, func(r *state.Workspace) error {
		r.Sandbox, r.Status, r.Updated = "", state.WorkspaceSuspended, time.Now().UTC()
		return nil
	})
}

// ResumeWorkspace forks workspace name's sandbox again from its latest
// state (a new sandbox id, the same name), or from its snapshot when it
// never was suspended.
func (e *Engine) ResumeWorkspace(ctx context.Context, name string) (*state.Workspace, error) {
	w, err := e.workspace(name)
	if err != nil {
		return nil, err
	}
	if w.Status == state.WorkspaceRunning {
		return nil, errdefs.FailedPrecondition("workspace %s is running (sandbox %s)", name, w.Sandbox)
	}
	from := w.Snapshot
	for i := len(w.States) - 1; i >= 0; i-- {
		if sn, err := e.snaps.Get(w.States[i]); err == nil && sn.Status == snapshot.StatusReady {
			from = sn.Tag
			break
		}
	}
	id, err := e.workspaceFork(ctx, w, from)
	if err != nil {
		return nil, fmt.Errorf("resume workspace %s from %s: %w", name, from, err)
	}
	return e.state.UpdateWorkspace(name, func(r *state.Workspace) error {
		r.Sandbox, r.Status, r.Updated = id, state.WorkspaceRunning, time.Now().UTC()
		return nil
	})
}

// workspace returns workspace name, its status checked against its
// sandbox: one whose sandbox is gone (killed, dead) counts as suspended.
func (e *Engine) workspace(name string) (*state.Workspace, error) {
	if err := ValidateWorkspaceName(name); err != nil {
		return nil, err
	}
	w, err := e.state.GetWorkspace(name)
	if err != nil {
		return nil, err
	}
	if w.Status == state.WorkspaceRunning {
		if sb, err := e.state.Get(w.Sandbox); err != nil || !state.Live(sb.Status) {
			w.Status, w.Sandbox = state.WorkspaceSuspended, ""
		}
	}
	return w, nil
}

// Workspace returns workspace name.
func (e *Engine) Workspace(name string) (*state.Workspace, error) { return e.workspace(name) }

// Workspaces lists the workspaces.
func (e *Engine) Workspaces() ([]*state.Workspace, error) {
	all, err := e.state.Workspaces()
	if err != nil {
		return nil, err
	}
	for i, w := range all {
		if cur, err := e.workspace(w.Name); err == nil {
			all[i] = cur
		}
	}
	return all, nil
}

// RemoveWorkspace kills workspace name's sandbox, removes the state
// snapshots it made (never the snapshot it was created from) and its
// record.
func (e *Engine) RemoveWorkspace(ctx context.Context, name string) error {
	w, err := e.workspace(name)
	if err != nil {
		return err
	}
	if w.Sandbox != "" {
		if err := e.Kill(ctx, w.Sandbox); err != nil && !errdefs.IsNotFound(err) {
			return fmt.Errorf("remove workspace %s: %w", name, err)
		}
	}
	var errs []error
	for i := len(w.States) - 1; i >= 0; i-- {
		if _, err := e.RemoveSnapshotWith(w.States[i], snapshot.RemoveOptions{Force: true}); err != nil && !errdefs.IsNotFound(err) {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("remove workspace %s: %w", name, err)
	}
	return e.state.DeleteWorkspace(name)
}
