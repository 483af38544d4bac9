package e2b

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io/fs"
	"net/http"
	"path"
	"sync"
	"time"

	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
)

// Messages of envd's filesystem.Filesystem service (filesystem.proto).

type entryInfo struct {
	Name          string            `json:"name"`
	Type          string            `json:"type"`
	Path          string            `json:"path"`
	Size          int64             `json:"size,string"`
	Mode          uint32            `json:"mode"`
	Permissions   string            `json:"permissions"`
	Owner         string            `json:"owner"`
	Group         string            `json:"group"`
	ModifiedTime  time.Time         `json:"modifiedTime"`
	SymlinkTarget *string           `json:"symlinkTarget,omitempty"`
	Metadata      map[string]string `json:"metadata,omitempty"`
}

type pathRequest struct {
	Path string `json:"path"`
}

type entryResponse struct {
	Entry *entryInfo `json:"entry"`
}

type listDirRequest struct {
	Path  string `json:"path"`
	Depth uint32 `json:"depth"`
}

type listDirResponse struct {
	Entries []entryInfo `json:"entries"`
}

type moveRequest struct {
	Source      string `json:"source"`
	Destination string `json:"destination"`
}

type watchDirRequest struct {
	Path               string `json:"path"`
	Recursive          bool   `json:"recursive"`
	IncludeEntry       bool   `json:"includeEntry"`
	AllowNetworkMounts bool   `json:"allowNetworkMounts"`
}

type filesystemEvent struct {
	Name  string     `json:"name"`
	Type  string     `json:"type"`
	Entry *entryInfo `json:"entry,omitempty"`
}

type watchDirResponse struct {
	Start      *struct{}        `json:"start,omitempty"`
	Filesystem *filesystemEvent `json:"filesystem,omitempty"`
	Keepalive  *struct{}        `json:"keepalive,omitempty"`
}

type createWatcherResponse struct {
	WatcherID string `json:"watcherId"`
}

type watcherRequest struct {
	WatcherID string `json:"watcherId"`
}

type watcherEventsResponse struct {
	Events []filesystemEvent `json:"events"`
}

// fileType is a file type's FileType name.
func fileType(t string) string {
	switch t {
	case proto.FileTypeFile:
		return "FILE_TYPE_FILE"
	case proto.FileTypeDir:
		return "FILE_TYPE_DIRECTORY"
	case proto.FileTypeSymlink:
		return "FILE_TYPE_SYMLINK"
	}
	return "FILE_TYPE_UNSPECIFIED"
}

// permissions is Go's FileMode.String of a file of type t and mode bits.
func permissions(t string, mode uint32) string {
	m := fs.FileMode(mode & 0o777)
	if mode&0o4000 != 0 {
		m |= fs.ModeSetuid
	}
	if mode&0o2000 != 0 {
		m |= fs.ModeSetgid
	}
	if mode&0o1000 != 0 {
		m |= fs.ModeSticky
	}
	switch t {
	case proto.FileTypeDir:
		m |= fs.ModeDir
	case proto.FileTypeSymlink:
		m |= fs.ModeSymlink
	case proto.FileTypeOther:
		m |= fs.ModeIrregular
	}
	return m.String()
}

// entry describes fi as envd does: a symlink by its target's type, mode
// and size, with symlinkTarget its resolved path.
func (ec *envdCall) entry(ctx context.Context, fi *proto.FileInfo) *entryInfo {
	e := &entryInfo{Name: fi.Name, Type: fileType(fi.Type), Path: fi.Path, Size: fi.Size, Mode: fi.Mode & 0o777,
		Permissions: permissions(fi.Type, fi.Mode), Owner: fi.Owner, Group: fi.Group, ModifiedTime: fi.ModTime.UTC()}
	if fi.Type == proto.FileTypeSymlink {
		target := fi.Target
		if t, err := ec.c.StatFollow(ctx, fi.Path); err == nil {
			e.Type, e.Mode, e.Size, target = fileType(t.Type), t.Mode&0o777, t.Size, t.Target
		}
		e.SymlinkTarget = &target
	}
	return e
}

func (ec *envdCall) stat(ctx context.Context, r *http.Request, req *pathRequest) (*entryResponse, error) {
	u, err := ec.user(ctx, r, "")
	if err != nil {
		return nil, err
	}
	fi, err := ec.c.Stat(ctx, u.abs(req.Path))
	if err != nil {
		return nil, err
	}
	return &entryResponse{Entry: ec.entry(ctx, fi)}, nil
}

func (ec *envdCall) listDir(ctx context.Context, r *http.Request, req *listDirRequest) (*listDirResponse, error) {
	u, err := ec.user(ctx, r, "")
	if err != nil {
		return nil, err
	}
	depth := max(int(req.Depth), 1)
	list, err := ec.c.ListDir(ctx, u.abs(req.Path), depth)
	if err != nil {
		return nil, err
	}
	out := &listDirResponse{Entries: make([]entryInfo, 0, len(list))}
	for i := range list {
		out.Entries = append(out.Entries, *ec.entry(ctx, &list[i]))
	}
	return out, nil
}

func (ec *envdCall) makeDir(ctx context.Context, r *http.Request, req *pathRequest) (*entryResponse, error) {
	u, err := ec.user(ctx, r, "")
	if err != nil {
		return nil, err
	}
	p := u.abs(req.Path)
	created, err := ec.c.MakeDirAs(ctx, p, u.Name)
	if errdefs.IsAlreadyExists(err) {
		return nil, withCode(codeInvalidArgument, err) // a file in the way
	}
	if err != nil {
		return nil, err
	}
	if !created {
		return nil, errdefs.AlreadyExists("directory %s already exists", p)
	}
	fi, err := ec.c.Stat(ctx, p)
	if err != nil {
		return nil, err
	}
	return &entryResponse{Entry: ec.entry(ctx, fi)}, nil
}

func (ec *envdCall) move(ctx context.Context, r *http.Request, req *moveRequest) (*entryResponse, error) {
	u, err := ec.user(ctx, r, "")
	if err != nil {
		return nil, err
	}
	from, to := u.abs(req.Source), u.abs(req.Destination)
	if _, err := ec.c.Stat(ctx, from); err != nil {
		return nil, err
	}
	if _, err := ec.c.MakeDirAs(ctx, path.Dir(to), u.Name); err != nil {
		return nil, err
	}
	if err := ec.c.Rename(ctx, from, to); err != nil {
		return nil, err
	}
	fi, err := ec.c.Stat(ctx, to)
	if err != nil {
		return nil, err
	}
	return &entryResponse{Entry: ec.entry(ctx, fi)}, nil
}

func (ec *envdCall) remove(ctx context.Context, r *http.Request, req *pathRequest) (*empty, error) {
	u, err := ec.user(ctx, r, "")
	if err != nil {
		return nil, err
	}
	if err := ec.c.Remove(ctx, u.abs(req.Path), true); err != nil && !errdefs.IsNotFound(err) {
		return nil, err
	}
	return &empty{}, nil
}

// eventType is a watch operation's EventType name.
func eventType(op string) string {
	switch op {
	case proto.WatchCreate:
		return "EVENT_TYPE_CREATE"
	case proto.WatchWrite:
		return "EVENT_TYPE_WRITE"
	case proto.WatchRemove:
		return "EVENT_TYPE_REMOVE"
	case proto.WatchRename:
		return "EVENT_TYPE_RENAME"
	case proto.WatchChmod:
		return "EVENT_TYPE_CHMOD"
	}
	return ""
}

// event converts a watch event, with its entry when asked.
func (ec *envdCall) event(ctx context.Context, dir string, ev proto.WatchEvent, withEntry bool) (filesystemEvent, bool) {
	t := eventType(ev.Op)
	if t == "" {
		return filesystemEvent{}, false
	}
	fe := filesystemEvent{Name: ev.Name, Type: t}
	if withEntry && ev.Op != proto.WatchRemove && ev.Op != proto.WatchRename {
		if fi, err := ec.c.Stat(ctx, path.Join(dir, ev.Name)); err == nil {
			fe.Entry = ec.entry(ctx, fi)
		}
	}
	return fe, true
}

func (ec *envdCall) watchDir(ctx context.Context, r *http.Request, req *watchDirRequest, sw *streamWriter) error {
	u, err := ec.user(ctx, r, "")
	if err != nil {
		return err
	}
	dir := u.abs(req.Path)
	err = ec.c.Watch(ctx, dir, req.Recursive, func() {
		_ = sw.send(watchDirResponse{Start: &struct{}{}}) // a caller that left ends the watch at the next event
	}, func(ev proto.WatchEvent) error {
		fe, ok := ec.event(ctx, dir, ev, req.IncludeEntry)
		if !ok {
			return nil
		}
		return sw.send(watchDirResponse{Filesystem: &fe})
	})
	if err == nil && errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return nil // the watch's time is up: a clean end
	}
	return err
}

// watchers are the watches of CreateWatcher, polled by GetWatcherEvents.
type watchers struct {
	mu sync.Mutex
	m  map[string]*watcher // guarded by mu
}

// watcher collects one watch's events.
type watcher struct {
	sandbox string // the E2B sandbox
	cancel  context.CancelFunc
	mu      sync.Mutex
	events  []filesystemEvent // guarded by mu
	err     error             // guarded by mu; why the watch ended
}

// maxWatcherEvents bounds the events a watcher keeps unread.
const maxWatcherEvents = 10000

func (w *watchers) init() { w.m = map[string]*watcher{} }

func (w *watchers) get(id string) *watcher {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.m[id]
}

func (w *watchers) remove(id string) *watcher {
	w.mu.Lock()
	defer w.mu.Unlock()
	wt := w.m[id]
	delete(w.m, id)
	return wt
}

// dropSandbox ends the watchers of E2B sandbox id.
func (w *watchers) dropSandbox(id string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for k, wt := range w.m {
		if wt.sandbox == id {
			wt.cancel()
			delete(w.m, k)
		}
	}
}

func (w *watchers) closeAll() {
	w.mu.Lock()
	defer w.mu.Unlock()
	for k, wt := range w.m {
		wt.cancel()
		delete(w.m, k)
	}
}

func (ec *envdCall) createWatcher(ctx context.Context, r *http.Request, req *watchDirRequest) (*createWatcherResponse, error) {
	u, err := ec.user(ctx, r, "")
	if err != nil {
		return nil, err
	}
	dir := u.abs(req.Path)
	var b [8]byte
	rand.Read(b[:])
	id := hex.EncodeToString(b[:])
	wctx, cancel := context.WithCancel(ec.s.base)
	wt := &watcher{sandbox: ec.rec.ID, cancel: cancel}
	started := make(chan struct{})
	failed := make(chan error, 1)
	c := ec.c
	wec := &envdCall{s: ec.s, rec: ec.rec, sb: ec.sb, c: c}
	go func() {
		err := c.Watch(wctx, dir, req.Recursive, func() { close(started) }, func(ev proto.WatchEvent) error {
			fe, ok := wec.event(wctx, dir, ev, req.IncludeEntry)
			if !ok {
				return nil
			}
			wt.mu.Lock()
			if len(wt.events) < maxWatcherEvents {
				wt.events = append(wt.events, fe)
			}
			wt.mu.Unlock()
			return nil
		})
		wt.mu.Lock()
		wt.err = err
		wt.mu.Unlock()
		failed <- err
	}()
	select {
	case <-started:
	case err := <-failed:
		cancel()
		if err == nil {
			err = errdefs.Unavailable("watch %s ended", dir)
		}
		return nil, err
	case <-ctx.Done():
		cancel()
		return nil, ctx.Err()
	}
	ec.s.watch.mu.Lock()
	ec.s.watch.m[id] = wt
	ec.s.watch.mu.Unlock()
	return &createWatcherResponse{WatcherID: id}, nil
}

func (ec *envdCall) watcher(id string) (*watcher, error) {
	wt := ec.s.watch.get(id)
	if wt == nil || wt.sandbox != ec.rec.ID {
		return nil, errdefs.NotFound("watcher %s not found", errdefs.Quote(id))
	}
	return wt, nil
}

func (ec *envdCall) getWatcherEvents(ctx context.Context, r *http.Request, req *watcherRequest) (*watcherEventsResponse, error) {
	wt, err := ec.watcher(req.WatcherID)
	if err != nil {
		return nil, err
	}
	wt.mu.Lock()
	defer wt.mu.Unlock()
	evs := wt.events
	wt.events = nil
	if evs == nil {
		evs = []filesystemEvent{}
	}
	if len(evs) == 0 && wt.err != nil {
		return nil, wt.err
	}
	return &watcherEventsResponse{Events: evs}, nil
}

func (ec *envdCall) removeWatcher(ctx context.Context, r *http.Request, req *watcherRequest) (*empty, error) {
	if _, err := ec.watcher(req.WatcherID); err != nil {
		return nil, err
	}
	if wt := ec.s.watch.remove(req.WatcherID); wt != nil {
		wt.cancel()
	}
	return &empty{}, nil
}
