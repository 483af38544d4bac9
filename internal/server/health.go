package server

import (
	"net/http"

	apiv1 "github.com/forkd/forkd/api/v1"
)

func (s *Server) health(r *http.Request) (any, error) {
	return apiv1.Health{Status: "ok"}, nil
}

func (s *Server) version(r *http.Request) (any, error) {
	be := s.e.Backend()
	return apiv1.VersionInfo{
		Version: s.cfg.Version, APIVersion: apiv1.Version, Backend: be.Name(),
		Accelerator: be.Capabilities().Accelerator, DataDir: s.e.Config().DataDir,
	}, nil
}
