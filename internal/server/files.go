package server

import (
	"errors"
	"io"
	"io/fs"
	"net/http"
	"strconv"
	"strings"

	apiv1 "github.com/forkd/forkd/api/v1"
	"github.com/forkd/forkd/internal/agent"
	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
)

// maxPathBytes bounds a guest path.
const maxPathBytes = 4096

// guestPath returns query parameter name as an absolute guest path.
func guestPath(r *http.Request, name string) (string, error) {
	p := r.URL.Query().Get(name)
	return checkGuestPath(name, p)
}

func checkGuestPath(name, p string) (string, error) {
	if p == "" {
		return "", errdefs.InvalidArgument("%s is required", name)
	}
	if !strings.HasPrefix(p, "/") || len(p) > maxPathBytes || strings.ContainsRune(p, 0) {
		return "", errdefs.InvalidArgument("%s %s: want an absolute guest path of at most %d bytes", name, errdefs.Quote(p), maxPathBytes)
	}
	return p, nil
}

func fileInfo(fi proto.FileInfo) apiv1.FileInfo {
	return apiv1.FileInfo{Name: fi.Name, Path: fi.Path, Type: fi.Type, Size: fi.Size, Mode: fi.Mode, ModTime: fi.ModTime, Target: fi.Target}
}

// lazyWriter sends the response headers on the first write, so an error
// before any data is still an ordinary error response.
type lazyWriter struct {
	w       http.ResponseWriter
	started bool
}

func (l *lazyWriter) Write(p []byte) (int, error) {
	l.start()
	return l.w.Write(p)
}

func (l *lazyWriter) start() {
	if !l.started {
		l.started = true
		l.w.Header().Set("Content-Type", octets)
		l.w.WriteHeader(http.StatusOK)
	}
}

// readFile streams a guest file. A failure after the first byte cuts the
// response short (the adapter aborts it), so the caller never mistakes a
// partial file for a whole one.
func (s *Server) readFile(w http.ResponseWriter, r *http.Request) error {
	p, err := guestPath(r, "path")
	if err != nil {
		return err
	}
	return s.withAgent(r, func(c *agent.Client) error {
		lw := &lazyWriter{w: w}
		if _, err := c.ReadFile(r.Context(), p, lw); err != nil {
			return err
		}
		lw.start()
		return nil
	})
}

func (s *Server) writeFile(w http.ResponseWriter, r *http.Request) (any, error) {
	p, err := guestPath(r, "path")
	if err != nil {
		return nil, err
	}
	var mode fs.FileMode
	if m := r.URL.Query().Get("mode"); m != "" {
		v, err := strconv.ParseUint(m, 8, 32)
		if err != nil || v > 0o7777 {
			return nil, errdefs.InvalidArgument("mode %s: want octal permission bits such as 0644", errdefs.Quote(m))
		}
		mode = fs.FileMode(v&0o777) | modeExtra(v)
	}
	var out apiv1.WriteFileResult
	err = s.withAgent(r, func(c *agent.Client) error {
		// An upload may take long, but must keep moving.
		dl := s.bodyDeadline(w, r, 0)
		defer dl.done()
		body := http.MaxBytesReader(nil, io.NopCloser(dl), s.cfg.MaxFileBytes)
		n, err := c.WriteFile(r.Context(), p, body, mode)
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return &tooLarge{mbe}
		}
		if err != nil {
			return err
		}
		out = apiv1.WriteFileResult{Path: p, Bytes: n}
		return nil
	})
	return out, err
}

// modeExtra maps the setuid, setgid and sticky bits of an octal mode.
func modeExtra(v uint64) fs.FileMode {
	var m fs.FileMode
	if v&0o4000 != 0 {
		m |= fs.ModeSetuid
	}
	if v&0o2000 != 0 {
		m |= fs.ModeSetgid
	}
	if v&0o1000 != 0 {
		m |= fs.ModeSticky
	}
	return m
}

func (s *Server) removeFile(r *http.Request) (any, error) {
	p, err := guestPath(r, "path")
	if err != nil {
		return nil, err
	}
	rec, err := boolParam(r, "recursive")
	if err != nil {
		return nil, err
	}
	return nil, s.withAgent(r, func(c *agent.Client) error { return c.Remove(r.Context(), p, rec) })
}

func boolParam(r *http.Request, name string) (bool, error) {
	v := r.URL.Query().Get(name)
	if v == "" {
		return false, nil
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		return false, errdefs.InvalidArgument("%s %s: want true or false", name, errdefs.Quote(v))
	}
	return b, nil
}

func (s *Server) listFiles(r *http.Request) (any, error) {
	p, err := guestPath(r, "path")
	if err != nil {
		return nil, err
	}
	depth := 1
	if d := r.URL.Query().Get("depth"); d != "" {
		if depth, err = strconv.Atoi(d); err != nil || depth < 1 || depth > 64 {
			return nil, errdefs.InvalidArgument("depth %s: want 1 to 64", errdefs.Quote(d))
		}
	}
	var out apiv1.FileList
	err = s.withAgent(r, func(c *agent.Client) error {
		entries, err := c.ListDir(r.Context(), p, depth)
		if err != nil {
			return err
		}
		out.Entries = make([]apiv1.FileInfo, 0, len(entries))
		for _, e := range entries {
			out.Entries = append(out.Entries, fileInfo(e))
		}
		return nil
	})
	return out, err
}

func (s *Server) statFile(r *http.Request) (any, error) {
	p, err := guestPath(r, "path")
	if err != nil {
		return nil, err
	}
	var out apiv1.FileInfo
	err = s.withAgent(r, func(c *agent.Client) error {
		fi, err := c.Stat(r.Context(), p)
		if err != nil {
			return err
		}
		out = fileInfo(*fi)
		return nil
	})
	return out, err
}

func (s *Server) makeDir(r *http.Request, req *apiv1.MakeDirRequest) (any, error) {
	p, err := checkGuestPath("path", req.Path)
	if err != nil {
		return nil, err
	}
	var out apiv1.MakeDirResult
	err = s.withAgent(r, func(c *agent.Client) error {
		created, err := c.MakeDir(r.Context(), p)
		out.Created = created
		return err
	})
	return out, err
}

func (s *Server) renameFile(r *http.Request, req *apiv1.RenameRequest) (any, error) {
	from, err := checkGuestPath("from", req.From)
	if err != nil {
		return nil, err
	}
	to, err := checkGuestPath("to", req.To)
	if err != nil {
		return nil, err
	}
	return nil, s.withAgent(r, func(c *agent.Client) error { return c.Rename(r.Context(), from, to) })
}

var _ io.Writer = (*lazyWriter)(nil)
