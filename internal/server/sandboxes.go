package server

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"strings"
	"time"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/request"
	"github.com/forkd/forkd/internal/sandbox"
	"github.com/forkd/forkd/internal/snapshot"
)

func (s *Server) createSandboxes(r *http.Request, req *apiv1.CreateSandboxesRequest) (any, error) {
	spec, err := request.ForkSpec(req, s.e.Config().MaxChildren)
	if err != nil {
		return nil, err
	}
	if most := s.e.MaxPortsPerSandbox(); spec.Net != nil && len(spec.Net.Publish) > most {
		return nil, errdefs.InvalidArgument("network.publish has %d ports; a sandbox may publish at most %d (forkd serve --max-ports-per-sandbox)",
			len(spec.Net.Publish), most)
	}
	return s.fork(r, spec, func(spec sandbox.ForkSpec) (*sandbox.ForkResult, error) {
		return s.cfg.Admitter.Fork(r.Context(), spec)
	})
}

// fork runs a fork (do, with spec) for a request and answers with its
// sandboxes, counting them; children of a caller that left are killed,
// since nobody would learn their ids.
func (s *Server) fork(r *http.Request, spec sandbox.ForkSpec, do func(sandbox.ForkSpec) (*sandbox.ForkResult, error)) (any, error) {
	res, err := do(spec)
	if res == nil {
		switch {
		case errdefs.IsResourceExhausted(err):
			s.metrics.rejected.Inc()
		default:
			// A batch rolled back after restores failed; refusals before
			// any restore (bad snapshot, not ready) count as nothing.
			if b := (*sandbox.BatchError)(nil); errors.As(err, &b) {
				s.metrics.failed.Add(float64(b.Failed))
			}
		}
		return nil, err
	}
	if cerr := r.Context().Err(); cerr != nil {
		// The caller left: nobody will learn these ids, so nobody would
		// ever kill them. They go now.
		kctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), time.Minute)
		defer cancel()
		for _, c := range res.Children {
			if c.Err == nil {
				if kerr := s.e.Kill(kctx, c.ID); kerr != nil && !errdefs.IsNotFound(kerr) {
					s.log.Warn("kill sandbox of a departed caller", "sandbox", c.ID, "err", kerr)
				}
			}
		}
		return nil, errdefs.Unavailable("the caller went away before the sandboxes were ready: %w", cerr)
	}
	out := apiv1.CreateSandboxesResponse{Sandboxes: []apiv1.Sandbox{}, WallMS: res.WallMS}
	for _, c := range res.Children {
		if c.Err != nil {
			s.metrics.failed.Inc()
			out.Failed = append(out.Failed, apiv1.ChildFailure{ID: c.ID, Error: wireError(c.Err)})
			continue
		}
		s.metrics.created.Inc()
		s.metrics.readyTime.Observe(c.ReadyMS / 1000)
		out.Sandboxes = append(out.Sandboxes, request.View(c.Sandbox))
	}
	if len(out.Sandboxes) == 0 {
		return nil, err
	}
	if spec.Timeout > 0 {
		s.cfg.Expirer.Poke()
	}
	return out, nil
}

func (s *Server) listSandboxes(r *http.Request) (any, error) {
	q := r.URL.Query()
	tag := q.Get("snapshot")
	if tag != "" {
		if err := snapshot.ValidateTag(tag); err != nil {
			return nil, err
		}
	}
	want := map[string]string{}
	for _, kv := range q["metadata"] {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, errdefs.InvalidArgument("metadata filter %s: want KEY=VALUE", errdefs.Quote(kv))
		}
		want[k] = v
	}
	status := q.Get("status")
	if status != "" && !slices.Contains(request.SandboxStatuses, status) {
		return nil, errdefs.InvalidArgument("status %s: want one of %s", errdefs.Quote(status), strings.Join(request.SandboxStatuses, ", "))
	}
	list, err := s.e.List(r.Context())
	if err != nil {
		return nil, err
	}
	out := apiv1.SandboxList{Sandboxes: []apiv1.Sandbox{}}
next:
	for _, sb := range list {
		if tag != "" && sb.Snapshot != tag || status != "" && sb.Status != status {
			continue
		}
		for k, v := range want {
			if got, ok := sb.Metadata[k]; !ok || got != v {
				continue next
			}
		}
		out.Sandboxes = append(out.Sandboxes, request.View(sb))
	}
	return out, nil
}

func (s *Server) getSandbox(r *http.Request) (any, error) {
	sb, err := s.e.Get(r.Context(), r.PathValue("id"))
	if err != nil {
		return nil, err
	}
	return request.View(sb), nil
}

func (s *Server) deleteSandbox(r *http.Request) (any, error) {
	return nil, s.e.Kill(r.Context(), r.PathValue("id"))
}

func (s *Server) setTimeout(r *http.Request, req *apiv1.SetTimeoutRequest) (any, error) {
	maxSecs := int(sandbox.MaxTimeout / time.Second)
	if req.TimeoutSecs < 0 || req.TimeoutSecs > maxSecs {
		return nil, errdefs.InvalidArgument("timeout_secs = %d: want 0 (none) to %d", req.TimeoutSecs, maxSecs)
	}
	sb, err := s.cfg.Expirer.SetTimeout(r.Context(), r.PathValue("id"), time.Duration(req.TimeoutSecs)*time.Second)
	if err != nil {
		return nil, err
	}
	return request.View(sb), nil
}

func (s *Server) setNetwork(r *http.Request, req *apiv1.NetworkSpec) (any, error) {
	if len(req.Publish) > 0 {
		return nil, errdefs.InvalidArgument("publish ports with POST /v1/sandboxes/{id}/ports")
	}
	p, err := request.NetworkPolicy(req)
	if err != nil {
		return nil, err
	}
	sb, err := s.e.SetPolicy(r.Context(), r.PathValue("id"), p)
	if err != nil {
		return nil, err
	}
	return request.View(sb), nil
}

func (s *Server) publishPort(r *http.Request, req *apiv1.PublishRequest) (any, error) {
	p, err := s.e.Publish(r.Context(), r.PathValue("id"), req.GuestPort)
	if err != nil {
		return nil, err
	}
	return apiv1.PublishedPort{Proto: p.Proto, GuestPort: p.GuestPort, HostPort: p.HostPort}, nil
}
