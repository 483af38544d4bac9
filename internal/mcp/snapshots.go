package mcp

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/image"
	"github.com/forkd/forkd/internal/request"
)

type noArgs struct{}

type snapshotList struct {
	Snapshots []snapshotView `json:"snapshots"`
}

type createSnapshotArgs struct {
	Tag       string   `json:"tag" jsonschema:"the new snapshot's name"`
	Image     string   `json:"image,omitempty" jsonschema:"a built-in image: minimal (busybox, boots fastest) or python (Debian with Python and numpy, for run_code); default minimal"`
	OCIRef    string   `json:"oci_ref,omitempty" jsonschema:"an OCI image to import instead of image: a registry reference such as docker.io/library/python:3.12-slim"`
	Preload   []string `json:"preload,omitempty" jsonschema:"with oci_ref: Python modules the warm interpreter imports before the snapshot is taken"`
	Extra     []string `json:"extra,omitempty" jsonschema:"with oci_ref: Debian/Ubuntu packages to install into the image (the daemon must allow image scripts)"`
	MemoryMiB int      `json:"memory_mib,omitempty" jsonschema:"guest memory in MiB (default the daemon's)"`
	VCPUs     int      `json:"vcpus,omitempty" jsonschema:"guest CPUs (default 1)"`
	Warmup    []string `json:"warmup,omitempty" jsonschema:"shell commands run in the machine before it is saved, so that every sandbox starts with their effect"`
	WaitSecs  *int     `json:"wait_secs,omitempty" jsonschema:"wait this long for the build (default 900); 0 returns at once. A build still running is reported, and list_snapshots shows when it is ready"`
}

type createSnapshotResult struct {
	Tag       string        `json:"tag"`
	Status    string        `json:"status" jsonschema:"ready, failed, or writing when the build still runs"`
	Operation string        `json:"operation" jsonschema:"the build's operation id"`
	Snapshot  *snapshotView `json:"snapshot,omitempty"`
	Progress  []string      `json:"progress,omitempty" jsonschema:"the build's last progress lines"`
}

func (t *tools) snapshotTools(s *sdk.Server) {
	add(s, tool[noArgs, snapshotList]{
		name: "list_snapshots", title: "List snapshots", readOnly: true,
		desc: "List the snapshots sandboxes can be forked from: tag, status (only ready ones fork), image, memory, whether it has Python " +
			"(run_code) and a network, how many sandboxes use it, and why it cannot be forked if it cannot.",
		run: func(ctx context.Context, _ *call, _ *noArgs) (*snapshotList, error) {
			list, err := t.c.ListSnapshots(ctx)
			if err != nil {
				return nil, err
			}
			out := &snapshotList{Snapshots: make([]snapshotView, 0, len(list))}
			for i := range list {
				out.Snapshots = append(out.Snapshots, viewSnapshot(&list[i]))
			}
			return out, nil
		},
	})
	add(s, tool[createSnapshotArgs, createSnapshotResult]{
		name: "create_snapshot", title: "Build a snapshot",
		desc: "Build a warm snapshot to fork sandboxes from: boot a built-in image (minimal or python) or an OCI image (oci_ref), " +
			"run the warmup commands, and save the running machine as tag. Takes seconds for minimal, minutes for an image built the first time; " +
			"progress is reported while it runs.",
		props: map[string][]prop{"tag": tagProp, "image": {oneOf(image.BuiltinNames()...)}, "oci_ref": {maxLen(1024)},
			"memory_mib": {between(0, 64<<10)}, "vcpus": {between(0, 64)}, "warmup": {maxItems(32), items(maxLen(4096))},
			"preload": {maxItems(64)}, "extra": {maxItems(64)}, "wait_secs": {between(0, maxBuildWaitSecs), byDefault(defaultBuildWait)}},
		run: t.createSnapshot,
	})
}

func (t *tools) createSnapshot(ctx context.Context, c *call, in *createSnapshotArgs) (*createSnapshotResult, error) {
	if err := checkTag("tag", in.Tag); err != nil {
		return nil, err
	}
	if in.Image != "" && in.OCIRef != "" {
		return nil, errdefs.InvalidArgument("give image (a built-in image) or oci_ref (an OCI image), not both")
	}
	if in.Image != "" {
		if err := checkOneOf("image", in.Image, image.BuiltinNames()...); err != nil {
			return nil, err
		}
	}
	if in.OCIRef == "" && (len(in.Preload) > 0 || len(in.Extra) > 0) {
		return nil, errdefs.InvalidArgument("preload and extra go with oci_ref")
	}
	wait := defaultBuildWait
	if in.WaitSecs != nil {
		wait = *in.WaitSecs
	}
	if err := checkInt("wait_secs", wait, 0, maxBuildWaitSecs); err != nil {
		return nil, err
	}
	req := apiv1.CreateSnapshotRequest{Tag: in.Tag, Image: in.Image, MemoryMiB: in.MemoryMiB, VCPUs: in.VCPUs, Warmup: in.Warmup}
	if in.OCIRef != "" {
		req.OCI = &apiv1.OCISource{Ref: in.OCIRef, Preload: in.Preload, Extra: in.Extra}
	}
	// The API's own checks (the daemon confines local image paths).
	if _, _, err := request.SnapshotSpec(&req, ""); err != nil {
		return nil, err
	}
	op, err := t.c.CreateSnapshot(ctx, req)
	if err != nil {
		return nil, withHint(err, errdefs.IsAlreadyExists, fmt.Sprintf("A snapshot %s exists: use it, or pick another tag.", in.Tag))
	}
	out := &createSnapshotResult{Tag: in.Tag, Status: apiv1.SnapshotWriting, Operation: op.ID}
	if wait == 0 {
		return out, nil
	}
	p := c.progress()
	var lines []string
	n := 0
	wctx, cancel := context.WithTimeout(ctx, time.Duration(wait)*time.Second)
	defer cancel()
	stop := p.heartbeat(wctx, "building "+in.Tag)
	op, err = t.c.WaitOperationProgress(wctx, op.ID, func(line string) {
		n++
		lines = append(lines, line)
		if len(lines) > 20 {
			lines = lines[1:]
		}
		p.report(ctx, float64(n), 0, line)
	})
	stop()
	out.Progress = lines
	switch {
	case err == nil:
	case errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil:
		// Still building: the build belongs to the daemon and goes on.
		return out, nil
	case op != nil && op.Status == apiv1.OperationFailed:
		return nil, &hinted{err: fmt.Errorf("build of %s failed: %w", in.Tag, err),
			hint: "Its last progress lines:\n" + strings.Join(lines, "\n")}
	default:
		return nil, err
	}
	sn, err := t.c.GetSnapshot(ctx, in.Tag)
	if err != nil {
		return nil, err
	}
	v := viewSnapshot(sn)
	out.Status, out.Snapshot = sn.Status, &v
	return out, nil
}
