package client

import (
	"context"
	"errors"
	"net/url"
	"time"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
)

// ListSnapshots lists the snapshots.
func (c *Client) ListSnapshots(ctx context.Context) ([]apiv1.Snapshot, error) {
	var l apiv1.SnapshotList
	return l.Snapshots, c.do(ctx, "GET", "/v1/snapshots", nil, nil, &l)
}

// GetSnapshot returns one snapshot.
func (c *Client) GetSnapshot(ctx context.Context, tag string) (*apiv1.Snapshot, error) {
	var s apiv1.Snapshot
	return &s, c.do(ctx, "GET", "/v1/snapshots/"+url.PathEscape(tag), nil, nil, &s)
}

// CreateSnapshot starts building a snapshot; see WaitOperation.
func (c *Client) CreateSnapshot(ctx context.Context, req apiv1.CreateSnapshotRequest) (*apiv1.Operation, error) {
	var op apiv1.Operation
	return &op, c.do(ctx, "POST", "/v1/snapshots", nil, req, &op)
}

// DeleteSnapshot removes a snapshot (FailedPrecondition while in use).
func (c *Client) DeleteSnapshot(ctx context.Context, tag string) error {
	return c.do(ctx, "DELETE", "/v1/snapshots/"+url.PathEscape(tag), nil, nil, nil)
}

// GetOperation returns one operation.
func (c *Client) GetOperation(ctx context.Context, id string) (*apiv1.Operation, error) {
	var op apiv1.Operation
	return &op, c.do(ctx, "GET", "/v1/operations/"+url.PathEscape(id), nil, nil, &op)
}

// WaitOperation polls an operation until it ends or ctx does. A failed
// operation is returned with its error as a classed error.
func (c *Client) WaitOperation(ctx context.Context, id string) (*apiv1.Operation, error) {
	return c.WaitOperationProgress(ctx, id, nil)
}

// WaitOperationProgress is WaitOperation that also calls progress (when
// set) with each progress line the operation reports, in order, once.
func (c *Client) WaitOperationProgress(ctx context.Context, id string, progress func(line string)) (*apiv1.Operation, error) {
	delay := 100 * time.Millisecond
	seen := 0 // progress lines already passed on
	for {
		op, err := c.GetOperation(ctx, id)
		if err != nil {
			return nil, err
		}
		if progress != nil && op.ProgressLines > seen {
			fresh := min(op.ProgressLines-seen, len(op.Progress))
			for _, line := range op.Progress[len(op.Progress)-fresh:] {
				progress(line)
			}
			seen = op.ProgressLines
			delay = 100 * time.Millisecond
		}
		if done, err := ended(op); done {
			return op, err
		}
		select {
		case <-ctx.Done():
			return op, ctx.Err()
		case <-time.After(delay):
		}
		delay = min(delay*2, time.Second)
	}
}

// ended reports whether op has ended, and a failed one's error as a
// classed error.
func ended(op *apiv1.Operation) (bool, error) {
	switch op.Status {
	case apiv1.OperationSucceeded:
		return true, nil
	case apiv1.OperationFailed:
		if op.Error != nil {
			return true, errdefs.FromCode(op.Error.Code, op.Error.Message)
		}
		return true, errors.New("operation failed")
	}
	return false, nil
}

// WatchOperation polls an operation every interval (at least 50 ms)
// until it ends or ctx does, calling fn with each state it sees, the
// last included. A failed operation is returned with its error as a
// classed error.
func (c *Client) WatchOperation(ctx context.Context, id string, interval time.Duration, fn func(*apiv1.Operation)) (*apiv1.Operation, error) {
	interval = max(interval, 50*time.Millisecond)
	for {
		op, err := c.GetOperation(ctx, id)
		if err != nil {
			return nil, err
		}
		if fn != nil {
			fn(op)
		}
		if done, err := ended(op); done {
			return op, err
		}
		select {
		case <-ctx.Done():
			return op, ctx.Err()
		case <-time.After(interval):
		}
	}
}

// PushSnapshot starts pushing a snapshot (and its chain) to a registry;
// see WatchOperation. The operation's Transfer says how it goes.
func (c *Client) PushSnapshot(ctx context.Context, tag string, req apiv1.PushRequest) (*apiv1.Operation, error) {
	var op apiv1.Operation
	return &op, c.do(ctx, "POST", "/v1/snapshots/"+url.PathEscape(tag)+"/push", nil, req, &op)
}

// PullSnapshot starts pulling a snapshot from a registry; the operation's
// Snapshot names its tag here once known.
func (c *Client) PullSnapshot(ctx context.Context, req apiv1.PullRequest) (*apiv1.Operation, error) {
	var op apiv1.Operation
	return &op, c.do(ctx, "POST", "/v1/snapshots/pull", nil, req, &op)
}

// PackSnapshot starts writing a snapshot (and its chain) into a layout
// tar file on the daemon's host.
func (c *Client) PackSnapshot(ctx context.Context, tag string, req apiv1.PackRequest) (*apiv1.Operation, error) {
	var op apiv1.Operation
	return &op, c.do(ctx, "POST", "/v1/snapshots/"+url.PathEscape(tag)+"/pack", nil, req, &op)
}

// UnpackSnapshot starts reading a snapshot from a layout tar file on the
// daemon's host.
func (c *Client) UnpackSnapshot(ctx context.Context, req apiv1.UnpackRequest) (*apiv1.Operation, error) {
	var op apiv1.Operation
	return &op, c.do(ctx, "POST", "/v1/snapshots/unpack", nil, req, &op)
}

// SnapshotInfo returns a snapshot's chain and sizes.
func (c *Client) SnapshotInfo(ctx context.Context, tag string) (*apiv1.SnapshotInfo, error) {
	var in apiv1.SnapshotInfo
	return &in, c.do(ctx, "GET", "/v1/snapshots/"+url.PathEscape(tag)+"/info", nil, nil, &in)
}

// CompactSnapshot makes snapshot to, standing alone, from tag.
func (c *Client) CompactSnapshot(ctx context.Context, tag, to string) (*apiv1.Snapshot, error) {
	var s apiv1.Snapshot
	return &s, c.do(ctx, "POST", "/v1/snapshots/"+url.PathEscape(tag)+"/compact", nil, apiv1.CompactRequest{To: to}, &s)
}

// RemoveOptions say what DeleteSnapshotWith does with the snapshots made
// from the one removed: Cascade removes them too, Force leaves them.
type RemoveOptions struct{ Cascade, Force bool }

// DeleteSnapshotWith removes a snapshot that may have dependents.
func (c *Client) DeleteSnapshotWith(ctx context.Context, tag string, opts RemoveOptions) error {
	q := url.Values{}
	if opts.Cascade {
		q.Set("cascade", "true")
	}
	if opts.Force {
		q.Set("force", "true")
	}
	return c.do(ctx, "DELETE", "/v1/snapshots/"+url.PathEscape(tag), q, nil, nil)
}
