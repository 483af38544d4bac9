package server

import (
	"bytes"
	"io"
	"net/http"
	"strings"
)

// Mount serves h at path, every method, beside the REST routes: a face of
// the engine with a protocol of its own (the MCP endpoint, /mcp), which
// is not a REST route and so not in the route table or the OpenAPI
// document. It gets what every route gets: the same authentication (the
// unix socket trusted by the kernel, the bearer token on TCP, the
// tokenless daemon's Origin and Host checks), a line in the audit log
// and metrics under the route "MOUNT path", and a request body read
// within the daemon's bounds (Config.MaxBodyBytes, the in-flight budget,
// BodyTimeout and BodyStallTimeout) before h sees it. h must not need a
// body larger than MaxBodyBytes or one that streams.
//
// path is an exact path ("/mcp"); Mount panics if it is taken or a REST
// route lies under it. It may be called while the server serves.
func (s *Server) Mount(path string, h http.Handler) {
	if !strings.HasPrefix(path, "/") || strings.ContainsAny(path, "{} ") {
		panic("server: mount " + path + ": want an exact path")
	}
	for _, rt := range routes {
		if rt.Path == path || strings.HasPrefix(rt.Path, path+"/") {
			panic("server: mount " + path + ": the REST route " + rt.Path + " is there")
		}
	}
	name := "MOUNT " + path
	s.mux.Handle(path, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ri := info(r)
		ri.route = name
		caller, err := s.authenticate(r)
		ri.caller = caller
		if err != nil {
			w.Header().Set("WWW-Authenticate", `Bearer realm="forkd"`)
			s.boundDiscard(w, err)
			writeError(w, err)
			return
		}
		if r.Body != nil && r.Body != http.NoBody {
			b, release, err := s.readBody(w, r, s.cfg.MaxBodyBytes)
			if err != nil {
				s.boundDiscard(w, err)
				writeError(w, err)
				return
			}
			defer release()
			r.Body = io.NopCloser(bytes.NewReader(b))
			r.ContentLength = int64(len(b))
		}
		h.ServeHTTP(w, r)
	}))
}
