package mcp

import (
	"context"
	"encoding/json"
	"strings"

	sdk "github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/forkd/forkd/client"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/snapshot"
)

// Resource URIs.
const (
	snapshotsURI = "forkd://snapshots"
	sandboxesURI = "forkd://sandboxes"
)

// addResources lists snapshots and sandboxes as resources: the lists
// (forkd://snapshots, forkd://sandboxes) and each one by its name
// (forkd://snapshots/{tag}, forkd://sandboxes/{id}), as JSON.
func addResources(s *sdk.Server, c *client.Client) {
	s.AddResource(&sdk.Resource{URI: snapshotsURI, Name: "snapshots", Title: "Snapshots", MIMEType: "application/json",
		Description: "The snapshots sandboxes can be forked from, with their status."},
		func(ctx context.Context, req *sdk.ReadResourceRequest) (*sdk.ReadResourceResult, error) {
			list, err := c.ListSnapshots(ctx)
			if err != nil {
				return nil, err
			}
			views := make([]snapshotView, 0, len(list))
			for i := range list {
				views = append(views, viewSnapshot(&list[i]))
			}
			return jsonResource(req.Params.URI, snapshotList{Snapshots: views})
		})
	s.AddResource(&sdk.Resource{URI: sandboxesURI, Name: "sandboxes", Title: "Sandboxes", MIMEType: "application/json",
		Description: "The sandboxes, with their status, snapshot and network."},
		func(ctx context.Context, req *sdk.ReadResourceRequest) (*sdk.ReadResourceResult, error) {
			list, err := c.ListSandboxes(ctx, client.ListOptions{})
			if err != nil {
				return nil, err
			}
			return jsonResource(req.Params.URI, sandboxList{Sandboxes: viewSandboxes(list)})
		})
	s.AddResourceTemplate(&sdk.ResourceTemplate{URITemplate: snapshotsURI + "/{tag}", Name: "snapshot", Title: "A snapshot",
		MIMEType: "application/json", Description: "One snapshot by its tag."},
		func(ctx context.Context, req *sdk.ReadResourceRequest) (*sdk.ReadResourceResult, error) {
			uri := req.Params.URI
			tag := strings.TrimPrefix(uri, snapshotsURI+"/")
			if snapshot.ValidateTag(tag) != nil {
				return nil, sdk.ResourceNotFoundError(uri)
			}
			sn, err := c.GetSnapshot(ctx, tag)
			if errdefs.IsNotFound(err) {
				return nil, sdk.ResourceNotFoundError(uri)
			}
			if err != nil {
				return nil, err
			}
			return jsonResource(uri, viewSnapshot(sn))
		})
	s.AddResourceTemplate(&sdk.ResourceTemplate{URITemplate: sandboxesURI + "/{id}", Name: "sandbox", Title: "A sandbox",
		MIMEType: "application/json", Description: "One sandbox by its id."},
		func(ctx context.Context, req *sdk.ReadResourceRequest) (*sdk.ReadResourceResult, error) {
			uri := req.Params.URI
			id := strings.TrimPrefix(uri, sandboxesURI+"/")
			if sandbox.ValidateID(id) != nil {
				return nil, sdk.ResourceNotFoundError(uri)
			}
			sb, err := c.GetSandbox(ctx, id)
			if errdefs.IsNotFound(err) {
				return nil, sdk.ResourceNotFoundError(uri)
			}
			if err != nil {
				return nil, err
			}
			return jsonResource(uri, viewSandbox(sb))
		})
}

func jsonResource(uri string, v any) (*sdk.ReadResourceResult, error) {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return nil, err
	}
	return &sdk.ReadResourceResult{Contents: []*sdk.ResourceContents{{URI: uri, MIMEType: "application/json", Text: string(b)}}}, nil
}
