package server

import (
	"net/http"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/apikey"
	"github.com/forkd/forkd/internal/errdefs"
)

// KeysFile is where, in the data dir, the E2B API keys are kept.
const KeysFile = "e2b-keys.json"

func viewKey(k apikey.Key) apiv1.E2BKey {
	return apiv1.E2BKey{ID: k.ID, Name: k.Name, Hint: k.Hint, Created: k.Created}
}

func (s *Server) createKey(r *http.Request, req *apiv1.CreateE2BKeyRequest) (any, error) {
	key, k, err := s.cfg.Keys.Create(req.Name)
	if err != nil {
		return nil, err
	}
	v := viewKey(k)
	v.Key = key
	s.log.Info("e2b api key created", "key", k.ID)
	return v, nil
}

func (s *Server) listKeys(r *http.Request) (any, error) {
	keys, err := s.cfg.Keys.List()
	if err != nil {
		return nil, err
	}
	out := apiv1.E2BKeyList{Keys: []apiv1.E2BKey{}}
	for _, k := range keys {
		out.Keys = append(out.Keys, viewKey(k))
	}
	return out, nil
}

func (s *Server) revokeKey(r *http.Request) (any, error) {
	id := r.PathValue("id")
	if len(id) > 64 {
		return nil, errdefs.InvalidArgument("key id %s: too long", errdefs.Quote(id))
	}
	if err := s.cfg.Keys.Revoke(id); err != nil {
		return nil, err
	}
	s.log.Info("e2b api key revoked", "key", id)
	return nil, nil
}
