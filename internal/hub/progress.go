package hub

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/forkd/forkd/internal/progress"
)

// Progress is a transfer under way: its files, each with the bytes of its
// blobs to move, moved, and found already there.
type Progress struct {
	Phase string
	Files []FileProgress
}

// FileProgress is one file of a snapshot in a transfer ("memory",
// "rootfs", ...; "tag/memory" for a chain's other links). Bytes are blob
// bytes: compressed, as they travel.
type FileProgress struct {
	Name string
	// Total is the bytes of the file's blobs; Done those moved so far;
	// Skipped those not moved because the other side had them (pushed
	// before, already pulled, or verified in the cache by a pull that was
	// cut short).
	Total, Done, Skipped         int64
	Blobs, BlobsDone, BlobsMoved int
	// Work is the bytes to process (read and encode for a push, fetch
	// for a pull) and WorkDone those processed: what an ETA is made of
	// while Total still grows (a push learns its blobs' sizes as it
	// encodes them).
	Work, WorkDone int64
}

// tracker accumulates a transfer's progress and reports it, at most every
// interval, to fn. Safe for concurrent use.
type tracker struct {
	mu    sync.Mutex // guards the rest
	phase string
	files []*FileProgress
	dirty bool
	fn    func(Progress)
	stop  chan struct{}
	done  chan struct{}
}

func newTracker(fn func(Progress)) *tracker {
	t := &tracker{fn: fn, stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(t.done)
		tick := time.NewTicker(250 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-t.stop:
				return
			case <-tick.C:
				t.report(false)
			}
		}
	}()
	return t
}

// close stops the reports after a last one.
func (t *tracker) close() {
	close(t.stop)
	<-t.done
	t.report(true)
}

func (t *tracker) report(force bool) {
	t.mu.Lock()
	if !t.dirty && !force {
		t.mu.Unlock()
		return
	}
	t.dirty = false
	p := t.snapshotLocked()
	t.mu.Unlock()
	if t.fn != nil {
		t.fn(p)
	}
}

func (t *tracker) snapshotLocked() Progress {
	p := Progress{Phase: t.phase, Files: make([]FileProgress, len(t.files))}
	for i, f := range t.files {
		p.Files[i] = *f
	}
	return p
}

// snapshot returns the progress now.
func (t *tracker) snapshot() Progress {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.snapshotLocked()
}

func (t *tracker) setPhase(phase string) {
	t.mu.Lock()
	t.phase, t.dirty = phase, true
	t.mu.Unlock()
}

// file returns the named file's entry, made on first use.
func (t *tracker) fileLocked(name string) *FileProgress {
	i := slices.IndexFunc(t.files, func(f *FileProgress) bool { return f.Name == name })
	if i >= 0 {
		return t.files[i]
	}
	f := &FileProgress{Name: name}
	t.files = append(t.files, f)
	return f
}

// expect adds a blob of size bytes to the named file's total.
func (t *tracker) expect(name string, size int64) {
	t.mu.Lock()
	f := t.fileLocked(name)
	f.Total += size
	f.Blobs++
	t.dirty = true
	t.mu.Unlock()
}

// work adds n bytes to the named file's work; workDone n to what is done.
func (t *tracker) work(name string, n int64) {
	t.mu.Lock()
	t.fileLocked(name).Work += n
	t.dirty = true
	t.mu.Unlock()
}

func (t *tracker) workDone(name string, n int64) {
	t.mu.Lock()
	t.fileLocked(name).WorkDone += n
	t.dirty = true
	t.mu.Unlock()
}

// moved counts a blob moved; skipped one found there.
func (t *tracker) moved(name string, size int64)   { t.count(name, size, false) }
func (t *tracker) skipped(name string, size int64) { t.count(name, size, true) }

func (t *tracker) count(name string, size int64, skip bool) {
	t.mu.Lock()
	f := t.fileLocked(name)
	if skip {
		f.Skipped += size
	} else {
		f.Done += size
		f.BlobsMoved++
	}
	f.BlobsDone++
	t.dirty = true
	t.mu.Unlock()
}

// Result sums up a finished transfer.
type Result struct {
	// Op is push, pull, pack or unpack.
	Op string
	// Tag is the snapshot pushed or packed, or made by a pull or unpack
	// (or found here already); Ref what it went to or came from; Digest
	// its artifact's manifest digest.
	Tag, Ref, Digest string
	// Links are the snapshots of the chain, base first, with their
	// digests; New those a pull or unpack made (false: it was here).
	Links []Link
	// Files are the per-file totals (see FileProgress).
	Files []FileProgress
	// BlobBytes is the size of every blob of the artifacts; Moved the
	// bytes of those sent or fetched; Skipped those the other side had;
	// Cached those a pull found verified in its cache.
	BlobBytes, Moved, Skipped, Cached int64
	Blobs, BlobsMoved                 int
	// NetSent and NetReceived are the bytes on the wire, HTTP bodies
	// (a registry only).
	NetSent, NetReceived int64
	// MemoryBytes is the top snapshot's guest RAM; MemoryData the bytes of
	// pages its memory blobs restore; MemoryBlobs their size.
	MemoryBytes, MemoryData, MemoryBlobs int64
	Seconds                              float64
}

// Link is one snapshot of a transferred chain.
type Link struct {
	Tag, Digest string
	New         bool
}

// finish fills r's totals from t.
func (r *Result) finish(t *tracker, start time.Time) {
	p := t.snapshot()
	r.Files = p.Files
	for _, f := range p.Files {
		r.BlobBytes += f.Total
		r.Moved += f.Done
		r.Skipped += f.Skipped
		r.Blobs += f.Blobs
		r.BlobsMoved += f.BlobsMoved
	}
	r.Seconds = time.Since(start).Seconds()
}

// say writes a human progress line to ctx's progress writer.
func say(ctx context.Context, format string, args ...any) {
	fmt.Fprintf(progress.Writer(ctx, nil), format+"\n", args...)
}

// mib formats bytes in MiB.
func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }
