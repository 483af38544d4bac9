package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"

	"github.com/forkd/forkd/internal/agent/proto"
	"github.com/forkd/forkd/internal/errdefs"
)

// ReadFile streams the guest file at path (absolute) into w and returns the
// number of bytes written.
func (c *Client) ReadFile(ctx context.Context, path string, w io.Writer) (int64, error) {
	cl, err := c.start(ctx, proto.OpFileRead, proto.PathRequest{Path: path})
	if err != nil {
		return 0, err
	}
	var n int64
	err = c.wait(ctx, cl, func(f proto.Frame) error {
		k, err := w.Write(f.Payload)
		n += int64(k)
		return err
	}, nil)
	return n, err
}

// WriteFile streams r into the guest file at path (absolute), creating
// parent directories. The file is replaced atomically once r is at EOF;
// a read error from r, or ctx ending, leaves the old file in place. mode's
// permission bits (with setuid, setgid, sticky) apply; 0 keeps an existing
// file's mode or gives 0644. It returns the number of bytes sent.
func (c *Client) WriteFile(ctx context.Context, path string, r io.Reader, mode fs.FileMode) (int64, error) {
	return c.WriteFileAs(ctx, path, r, mode, "")
}

// WriteFileAs is WriteFile whose new file, and the directories it makes,
// belong to user (a name or uid in the guest; "" leaves them root's).
func (c *Client) WriteFileAs(ctx context.Context, path string, r io.Reader, mode fs.FileMode, user string) (int64, error) {
	cl, err := c.start(ctx, proto.OpFileWrite, proto.WriteRequest{Path: path, Mode: modeBits(mode), User: user})
	if err != nil {
		return 0, err
	}
	cr := &countingReader{r: r}
	sctx, stop := context.WithCancel(ctx)
	defer stop()
	sent := make(chan struct{})
	readFailed := make(chan struct{})
	var readErr error
	go func() {
		defer close(sent)
		var re *readError
		if err := c.sendStream(sctx, cl, proto.StreamFile, cr); errors.As(err, &re) {
			// Abandon the write in the guest: nothing half-sent is committed.
			readErr = re.err
			close(readFailed)
			// A failed write stops the client, which fails the call.
			_ = c.w.WriteFrame(proto.Frame{Type: proto.TypeCancel, ID: cl.id})
		}
	}()
	var fi proto.FileInfo
	err = c.wait(ctx, cl, nil, &fi)
	if err == nil {
		// The guest answers only after the EOF frame: the sender is done.
		<-sent
		// The guest answers with the file it committed. The host's
		// frames carry no sequence check in the guest, so a frame lost
		// on the way would go unnoticed but for its size: say so rather
		// than report a whole file.
		if fi.Type == "file" && fi.Size != cr.n {
			return cr.n, errdefs.Unavailable("write %s: the guest received %d bytes of the %d sent (agent channel lost data)", path, fi.Size, cr.n)
		}
		return cr.n, nil
	}
	select {
	case <-readFailed:
		return cr.n, readErr
	default: // the sender may be blocked reading r; let it finish alone
	}
	return 0, err
}

// countingReader counts the bytes read.
type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

func modeBits(m fs.FileMode) uint32 {
	b := uint32(m.Perm())
	if m&fs.ModeSetuid != 0 {
		b |= 0o4000
	}
	if m&fs.ModeSetgid != 0 {
		b |= 0o2000
	}
	if m&fs.ModeSticky != 0 {
		b |= 0o1000
	}
	return b
}

// ListDir lists the directory at path to depth levels (1: its entries
// only), sorted by path, not following symlinks.
func (c *Client) ListDir(ctx context.Context, path string, depth int) ([]proto.FileInfo, error) {
	var res proto.ListResult
	if err := c.do(ctx, proto.OpFileList, proto.ListRequest{Path: path, Depth: depth}, &res); err != nil {
		return nil, err
	}
	return res.Entries, nil
}

// Stat describes path without following a final symlink.
func (c *Client) Stat(ctx context.Context, path string) (*proto.FileInfo, error) {
	return c.stat(ctx, proto.PathRequest{Path: path})
}

// StatFollow describes path, following a final symlink: the result
// describes the target, with Target its resolved path.
func (c *Client) StatFollow(ctx context.Context, path string) (*proto.FileInfo, error) {
	return c.stat(ctx, proto.PathRequest{Path: path, Follow: true})
}

func (c *Client) stat(ctx context.Context, req proto.PathRequest) (*proto.FileInfo, error) {
	var res proto.FileInfo
	if err := c.do(ctx, proto.OpFileStat, req, &res); err != nil {
		return nil, err
	}
	return &res, nil
}

// MakeDir creates a directory and its parents. It reports false when the
// directory already existed; a non-directory in the way is
// errdefs.ErrAlreadyExists.
func (c *Client) MakeDir(ctx context.Context, path string) (bool, error) {
	return c.MakeDirAs(ctx, path, "")
}

// MakeDirAs is MakeDir whose new directories belong to user (a name or
// uid in the guest; "" leaves them root's).
func (c *Client) MakeDirAs(ctx context.Context, path, user string) (bool, error) {
	var res proto.MkdirResult
	if err := c.do(ctx, proto.OpFileMkdir, proto.PathRequest{Path: path, User: user}, &res); err != nil {
		return false, err
	}
	return res.Created, nil
}

// Watch watches the directory at path (and with recursive, those below
// it) and hands each change to onEvent, in order, until ctx ends (nil is
// returned then) or onEvent fails. onStarted, if set, is called once the
// watch is in place, before any event. Needs proto.FeatureWatch.
func (c *Client) Watch(ctx context.Context, path string, recursive bool, onStarted func(), onEvent func(proto.WatchEvent) error) error {
	cl, err := c.start(ctx, proto.OpFileWatch, proto.WatchRequest{Path: path, Recursive: recursive})
	if err != nil {
		return err
	}
	var partial []byte
	err = c.waitEvents(ctx, cl, func(ev proto.Event) error {
		if ev.Kind == "started" && onStarted != nil {
			onStarted()
		}
		return nil
	}, func(f proto.Frame) error {
		if f.Stream() != proto.StreamWatch {
			return nil
		}
		partial = append(partial, f.Payload...)
		for {
			i := bytes.IndexByte(partial, '\n')
			if i < 0 {
				return nil
			}
			var ev proto.WatchEvent
			if err := json.Unmarshal(partial[:i], &ev); err != nil {
				return fmt.Errorf("agent %s: bad watch event: %w", proto.OpFileWatch, err)
			}
			partial = partial[i+1:]
			if err := onEvent(ev); err != nil {
				return err
			}
		}
	}, nil)
	if ctx.Err() == nil {
		return err
	}
	return nil // the watch ends with ctx, as documented
}

// Remove removes path; a non-empty directory needs recursive
// (errdefs.ErrFailedPrecondition otherwise).
func (c *Client) Remove(ctx context.Context, path string, recursive bool) error {
	return c.do(ctx, proto.OpFileRemove, proto.RemoveRequest{Path: path, Recursive: recursive}, nil)
}

// Rename renames from to to, replacing a file at to.
func (c *Client) Rename(ctx context.Context, from, to string) error {
	return c.do(ctx, proto.OpFileRename, proto.RenameRequest{From: from, To: to}, nil)
}
