package e2b

import (
	"compress/gzip"
	"errors"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"path"
	"strconv"
	"strings"

	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
)

// writtenFile is an entry of POST /files' answer.
type writtenFile struct {
	Name string `json:"name"`
	Type string `json:"type"`
	Path string `json:"path"`
}

// filesError writes err as envd's REST does: {"code": <status>,
// "message"}, with the statuses the SDK maps (404 FileNotFoundError, 400
// InvalidArgumentError, 507 NotEnoughSpaceError, ...).
func filesError(w http.ResponseWriter, err error) {
	status := statusOf(err)
	switch {
	case errdefs.IsResourceExhausted(err) && strings.Contains(err.Error(), "no space"):
		status = http.StatusInsufficientStorage
	case errdefs.IsFailedPrecondition(err), errdefs.IsAlreadyExists(err):
		status = http.StatusBadRequest
	}
	writeJSON(w, status, apiError{Code: status, Message: err.Error()})
}

func (ec *envdCall) readFile(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	q := r.URL.Query()
	u, err := ec.user(ctx, r, q.Get("username"))
	if err != nil {
		filesError(w, err)
		return
	}
	p := u.abs(q.Get("path"))
	fi, err := ec.c.StatFollow(ctx, p)
	if err != nil {
		filesError(w, err)
		return
	}
	if fi.Type == proto.FileTypeDir {
		filesError(w, errdefs.InvalidArgument("path %s is a directory", errdefs.Quote(p)))
		return
	}
	h := w.Header()
	h.Set("Content-Type", "application/octet-stream")
	h.Set("Content-Disposition", mime.FormatMediaType("attachment", map[string]string{"filename": path.Base(p)}))
	if fi.Type == proto.FileTypeFile {
		h.Set("Content-Length", strconv.FormatInt(fi.Size, 10))
	}
	cw := &countWriter{w: w}
	if _, err := ec.c.ReadFile(ctx, p, cw); err != nil {
		if cw.n == 0 {
			h.Del("Content-Length")
			h.Del("Content-Disposition")
			filesError(w, err)
			return
		}
		// Too late for a status: cut the response.
		ec.s.log.Warn("envd read file failed mid-way", "e2b", ec.rec.ID, "path", p, "err", err)
		panic(http.ErrAbortHandler)
	}
}

// countWriter counts what passes.
type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

func (ec *envdCall) writeFiles(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	q := r.URL.Query()
	u, err := ec.user(ctx, r, q.Get("username"))
	if err != nil {
		filesError(w, err)
		return
	}
	for k := range r.Header {
		if strings.HasPrefix(strings.ToLower(k), "x-metadata-") {
			filesError(w, errdefs.InvalidArgument("file metadata (%s) is not supported by forkd", k))
			return
		}
	}
	mt, params, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil {
		filesError(w, errdefs.InvalidArgument("content type %s: %v", errdefs.Quote(r.Header.Get("Content-Type")), err))
		return
	}
	write := func(target string, body io.Reader) (writtenFile, error) {
		p := u.abs(target)
		if p == "/" || strings.HasSuffix(target, "/") {
			return writtenFile{}, errdefs.InvalidArgument("path %s names a directory", errdefs.Quote(target))
		}
		if _, err := ec.c.WriteFileAs(ctx, p, body, 0, u.Name); err != nil {
			return writtenFile{}, err
		}
		return writtenFile{Name: path.Base(p), Type: "file", Path: p}, nil
	}
	var out []writtenFile
	switch mt {
	case "application/octet-stream":
		target := q.Get("path")
		if target == "" {
			filesError(w, errdefs.InvalidArgument("an octet-stream upload needs ?path="))
			return
		}
		var body io.Reader = r.Body
		switch enc := strings.ToLower(r.Header.Get("Content-Encoding")); enc {
		case "", "identity":
		case "gzip":
			zr, err := gzip.NewReader(r.Body)
			if err != nil {
				filesError(w, errdefs.InvalidArgument("gzip body: %v", err))
				return
			}
			defer zr.Close()
			body = zr
		default:
			filesError(w, errdefs.InvalidArgument("content encoding %s: want gzip", errdefs.Quote(enc)))
			return
		}
		f, err := write(target, body)
		if err != nil {
			filesError(w, err)
			return
		}
		out = append(out, f)
	case "multipart/form-data":
		mr := multipart.NewReader(r.Body, params["boundary"])
		seen := map[string]bool{}
		for {
			part, err := mr.NextPart()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				filesError(w, errdefs.InvalidArgument("multipart body: %v", err))
				return
			}
			if part.FormName() != "file" {
				part.Close()
				continue
			}
			target := q.Get("path")
			if target == "" {
				target = rawFilename(part.Header.Get("Content-Disposition"))
			}
			if target == "" {
				filesError(w, errdefs.InvalidArgument("a file part without a filename and no ?path="))
				return
			}
			if seen[u.abs(target)] {
				filesError(w, errdefs.InvalidArgument("path %s is uploaded twice", errdefs.Quote(target)))
				return
			}
			seen[u.abs(target)] = true
			f, err := write(target, part)
			part.Close()
			if err != nil {
				filesError(w, err)
				return
			}
			out = append(out, f)
		}
	default:
		filesError(w, errdefs.InvalidArgument("content type %s: want multipart/form-data or application/octet-stream", errdefs.Quote(mt)))
		return
	}
	if len(out) == 0 {
		filesError(w, errdefs.InvalidArgument("no file in the request"))
		return
	}
	writeJSON(w, http.StatusOK, out)
}

// rawFilename is the filename of a Content-Disposition, directories
// included (multipart.Part.FileName strips them), with the escapes undici
// makes of ", CR and LF undone.
func rawFilename(cd string) string {
	_, params, err := mime.ParseMediaType(cd)
	if err != nil {
		return ""
	}
	name := params["filename"]
	return strings.NewReplacer("%22", `"`, "%0D", "\r", "%0A", "\n").Replace(name)
}
