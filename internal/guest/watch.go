package guest

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
)

// watchMask is what a watch asks inotify for, as fsnotify does: a file
// created, written, removed, renamed or with changed attributes.
const watchMask = unix.IN_CREATE | unix.IN_MODIFY | unix.IN_DELETE | unix.IN_DELETE_SELF |
	unix.IN_MOVED_FROM | unix.IN_MOVED_TO | unix.IN_MOVE_SELF | unix.IN_ATTRIB | unix.IN_ONLYDIR

// maxWatches bounds the directories one recursive watch follows.
const maxWatches = 8192

// fileWatch streams the changes under a directory as WatchEvent lines
// until the call is cancelled.
func (a *Agent) fileWatch(ctx context.Context, r *request, args json.RawMessage) (any, error) {
	var req proto.WatchRequest
	if err := decode(args, &req); err != nil {
		return nil, err
	}
	p, err := guestPath("watch", req.Path)
	if err != nil {
		return nil, err
	}
	st, err := os.Stat(p)
	if err != nil {
		return nil, pathError("watch", p, err)
	}
	if !st.IsDir() {
		return nil, errdefs.InvalidArgument("watch %s: not a directory", p)
	}
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		return nil, errdefs.ResourceExhausted("watch %s: inotify: %v", p, err)
	}
	f := os.NewFile(uintptr(fd), "inotify") // non-blocking: reads honour deadlines
	defer f.Close()
	w := &watcher{fd: fd, root: p, recursive: req.Recursive, dirs: map[int]string{}}
	if err := w.add(p); err != nil {
		return nil, pathError("watch", p, err)
	}
	if req.Recursive {
		w.addBelow(p)
	}
	r.sendEvent(proto.Event{Kind: "started"})
	stop := context.AfterFunc(ctx, func() { _ = f.SetReadDeadline(time.Now()) })
	defer stop()
	buf := make([]byte, 64<<10)
	for {
		n, err := f.Read(buf)
		if err != nil {
			if ctx.Err() != nil {
				return nil, nil
			}
			return nil, errdefs.Unavailable("watch %s: %v", p, err)
		}
		var lines []byte
		for _, ev := range w.parse(buf[:n]) {
			b, _ := json.Marshal(ev)
			lines = append(append(lines, b...), '\n')
		}
		if len(lines) > 0 {
			if err := r.sendData(ctx, proto.StreamWatch, lines, false); err != nil {
				return nil, nil // the host went away
			}
		}
	}
}

// watcher follows one watch's inotify descriptors. Used by one goroutine.
type watcher struct {
	fd        int
	root      string
	recursive bool
	dirs      map[int]string // watch descriptor → directory
}

// add watches directory dir.
func (w *watcher) add(dir string) error {
	if len(w.dirs) >= maxWatches {
		return errdefs.ResourceExhausted("more than %d directories", maxWatches)
	}
	wd, err := unix.InotifyAddWatch(w.fd, dir, watchMask)
	if err != nil {
		return err
	}
	w.dirs[wd] = dir
	return nil
}

// addBelow watches the directories under dir, best effort: one that
// vanishes or cannot be read is left out.
func (w *watcher) addBelow(dir string) {
	_ = filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			if p == dir {
				return err
			}
			return filepath.SkipDir
		}
		if p == dir || !d.IsDir() {
			return nil
		}
		if w.add(p) != nil {
			return filepath.SkipAll
		}
		return nil
	})
}

// parse decodes inotify events into WatchEvents, following new
// directories of a recursive watch.
func (w *watcher) parse(b []byte) []proto.WatchEvent {
	var out []proto.WatchEvent
	for len(b) >= unix.SizeofInotifyEvent {
		// struct inotify_event: wd, mask, cookie, len, then name.
		wd := int(int32(binary.NativeEndian.Uint32(b[0:4])))
		mask := binary.NativeEndian.Uint32(b[4:8])
		size := unix.SizeofInotifyEvent + int(binary.NativeEndian.Uint32(b[12:16]))
		if size > len(b) {
			break
		}
		name := strings.TrimRight(string(b[unix.SizeofInotifyEvent:size]), "\x00")
		b = b[size:]
		if mask&unix.IN_Q_OVERFLOW != 0 {
			out = append(out, proto.WatchEvent{Op: proto.WatchOverflow})
			continue
		}
		dir, ok := w.dirs[wd]
		if mask&unix.IN_IGNORED != 0 {
			delete(w.dirs, wd)
			continue
		}
		if !ok {
			continue
		}
		full := dir
		if name != "" {
			full = filepath.Join(dir, name)
		}
		rel, err := filepath.Rel(w.root, full)
		if err != nil {
			continue
		}
		if mask&(unix.IN_DELETE_SELF|unix.IN_MOVE_SELF) != 0 && full != w.root {
			continue // reported by its parent's watch
		}
		if w.recursive && mask&unix.IN_ISDIR != 0 && mask&(unix.IN_CREATE|unix.IN_MOVED_TO) != 0 {
			if w.add(full) == nil {
				w.addBelow(full)
			}
		}
		for _, m := range []struct {
			bits uint32
			op   string
		}{
			{unix.IN_CREATE | unix.IN_MOVED_TO, proto.WatchCreate},
			{unix.IN_MODIFY, proto.WatchWrite},
			{unix.IN_DELETE | unix.IN_DELETE_SELF, proto.WatchRemove},
			{unix.IN_MOVED_FROM | unix.IN_MOVE_SELF, proto.WatchRename},
			{unix.IN_ATTRIB, proto.WatchChmod},
		} {
			if mask&m.bits != 0 {
				out = append(out, proto.WatchEvent{Name: rel, Op: m.op})
			}
		}
	}
	return out
}
