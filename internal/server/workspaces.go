package server

import (
	"net/http"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/request"
)

func (s *Server) createWorkspace(r *http.Request, req *apiv1.CreateWorkspaceRequest) (any, error) {
	name, spec, err := request.Workspace(req, s.e.Config().MaxChildren)
	if err != nil {
		return nil, err
	}
	w, err := s.e.CreateWorkspace(r.Context(), name, spec)
	if err != nil {
		return nil, err
	}
	return request.ViewWorkspace(w), nil
}

func (s *Server) listWorkspaces(r *http.Request) (any, error) {
	all, err := s.e.Workspaces()
	if err != nil {
		return nil, err
	}
	out := apiv1.WorkspaceList{Workspaces: []apiv1.Workspace{}}
	for _, w := range all {
		out.Workspaces = append(out.Workspaces, request.ViewWorkspace(w))
	}
	return out, nil
}

func (s *Server) getWorkspace(r *http.Request) (any, error) {
	w, err := s.e.Workspace(r.PathValue("name"))
	if err != nil {
		return nil, err
	}
	return request.ViewWorkspace(w), nil
}

func (s *Server) suspendWorkspace(r *http.Request) (any, error) {
	w, err := s.e.SuspendWorkspace(r.Context(), r.PathValue("name"))
	if err != nil {
		return nil, err
	}
	return request.ViewWorkspace(w), nil
}

func (s *Server) resumeWorkspace(r *http.Request) (any, error) {
	w, err := s.e.ResumeWorkspace(r.Context(), r.PathValue("name"))
	if err != nil {
		return nil, err
	}
	return request.ViewWorkspace(w), nil
}

func (s *Server) deleteWorkspace(r *http.Request) (any, error) {
	return nil, s.e.RemoveWorkspace(r.Context(), r.PathValue("name"))
}
