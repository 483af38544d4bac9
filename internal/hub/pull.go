package hub

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/klauspost/compress/zstd"
	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/memimage"
	"github.com/forkd/forkd/internal/snapshot"
)

// PullSpec says what Pull fetches.
type PullSpec struct {
	// Ref is the registry reference (by tag or by digest).
	Ref string
	// Tag names the snapshot here ("": the tag it had where it was
	// pushed).
	Tag    string
	Remote Remote
	// OnProgress, if set, receives the progress as it goes.
	OnProgress func(Progress)
}

// fetchers is how many blobs a pull fetches at once.
const fetchers = 4

// Pull fetches the snapshot spec.Ref names, and the links of its chain
// this host lacks, into the store. Nothing of a snapshot is fetched but
// its manifest and config until this host is known to restore it; every
// blob is verified before use; the tag appears only once the snapshot is
// complete. A pull cut short keeps the blobs it verified and a new pull
// of the same snapshot fetches only the others.
func (h *Hub) Pull(ctx context.Context, spec PullSpec) (*Result, error) {
	start := time.Now()
	if spec.Tag != "" {
		if err := snapshot.ValidateTag(spec.Tag); err != nil {
			return nil, err
		}
	}
	r, err := parseRef(spec.Ref)
	if err != nil {
		return nil, err
	}
	g, err := dial(ctx, spec.Ref, spec.Remote, false)
	if err != nil {
		return nil, err
	}
	res, err := h.pull(ctx, g, r.Identifier(), spec.Ref, spec.Tag, spec.OnProgress, start)
	if res != nil {
		res.Op = "pull"
		res.NetSent, res.NetReceived = g.stats.sent.Load(), g.stats.received.Load()
	}
	return res, err
}

// link is one artifact of a chain being pulled.
type link struct {
	digest string
	m      *v1.Manifest
	cfg    *ArtifactConfig
	local  *snapshot.Snapshot // the snapshot here that has its content
	tag    string             // the tag it gets, when it is made
}

// pull reads the artifact ref names (and its chain) from src into the
// store; origin is what the snapshots record they came from.
func (h *Hub) pull(ctx context.Context, src source, ref, origin, tag string, onProgress func(Progress), start time.Time) (res *Result, err error) {
	host, err := h.cfg.Host(ctx)
	if err != nil {
		return nil, err
	}
	t := newTracker(onProgress)
	res = &Result{Ref: origin}
	var cached atomic.Int64
	defer func() {
		t.close()
		res.finish(t, start)
		res.Cached = cached.Load()
	}()
	t.setPhase("resolve")
	links, err := h.resolve(ctx, src, ref, host)
	if err != nil {
		return res, err
	}
	res.Digest = links[0].digest
	for i := len(links) - 1; i >= 0; i-- {
		l := links[i]
		lk := Link{Digest: l.digest, New: l.local == nil}
		if l.local != nil {
			lk.Tag = l.local.Tag
		}
		res.Links = append(res.Links, lk)
	}
	top := links[0]
	res.MemoryBytes, res.MemoryData, res.MemoryBlobs = top.cfg.Memory.Bytes, top.cfg.Memory.DataBytes(), top.cfg.Memory.BlobBytes()
	if top.local != nil {
		res.Tag = top.local.Tag
		say(ctx, "%s is here already: snapshot %s", origin, top.local.Tag)
		return res, nil
	}
	if err := h.assignTags(links, tag); err != nil {
		return res, err
	}
	res.Tag = top.tag
	for i := range res.Links {
		if res.Links[i].Tag == "" {
			res.Links[i].Tag = links[len(links)-1-i].tag
		}
	}
	release, err := h.content.hold()
	if err != nil {
		return res, err
	}
	fetched := map[string]bool{}
	defer func() {
		release()
		if err != nil && (errdefs.IsInvalidArgument(err) || errdefs.IsFailedPrecondition(err)) {
			// Refused: nothing of it stays. (Cut short: the verified
			// blobs stay, for the next try.)
			h.cache.remove(keys(fetched))
		}
		if err != nil {
			if _, serr := h.Sweep(); serr != nil {
				h.log.Warn("hub sweep", "err", serr)
			}
		}
	}()
	plan := h.plan(links)
	if err := h.checkSpace(plan, links); err != nil {
		return res, err
	}
	t.setPhase("fetch")
	say(ctx, "pulling %s: %d link(s) to fetch, %d blobs, %s", origin, countNew(links), len(plan), mib(planBytes(plan)))
	if err := h.fetch(ctx, src, t, plan, fetched, &cached); err != nil {
		return res, err
	}
	for _, f := range t.snapshot().Files {
		fileDone(ctx, t, f.Name, "fetched")
	}
	t.setPhase("assemble")
	nNew := countNew(links)
	var made []string
	for i := len(links) - 1; i >= 0; i-- {
		l := links[i]
		if l.local != nil {
			continue
		}
		var parent *snapshot.Snapshot
		if i+1 < len(links) {
			parent = links[i+1].local
		}
		sn, err := h.assemble(ctx, l, parent, origin)
		if err != nil {
			for _, tg := range made {
				if rerr := h.cfg.Store.Remove(tg); rerr != nil {
					h.log.Warn("roll back pulled snapshot", "snapshot", tg, "err", rerr)
				}
			}
			return res, fmt.Errorf("snapshot %s: %w", l.tag, err)
		}
		l.local = sn
		made = append(made, sn.Tag)
	}
	entries := map[string]indexEntry{}
	for _, l := range links {
		entries[l.digest] = indexEntry{Tag: l.local.Tag, ContentHash: l.local.ContentHash, Ref: origin, Time: time.Now().UTC()}
	}
	if err := h.index.add(entries); err != nil {
		h.log.Warn("hub index", "err", err)
	}
	h.cache.remove(planDigests(plan))
	t.setPhase("done")
	say(ctx, "pulled %s as %s: %d link(s), %s fetched of %s (%s verified in the cache already)", origin, res.Tag,
		nNew, mib(planBytes(plan)-cached.Load()), mib(planBytes(plan)), mib(cached.Load()))
	return res, nil
}

// resolve reads the manifest and config of ref and of its parents until
// one this host has, or the base; top first. Each is checked (bounds,
// digests, restorable here) before the next is read.
func (h *Hub) resolve(ctx context.Context, src source, ref string, host Host) ([]*link, error) {
	l := h.cfg.Limits
	idx := h.index.load()
	var links []*link
	for cur := ref; ; {
		if len(links) >= l.Depth {
			return nil, errdefs.InvalidArgument("%s: a chain of more than %d links", src.name(), l.Depth)
		}
		raw, digest, err := src.manifest(ctx, cur, l.ManifestBytes)
		if err != nil {
			return nil, err
		}
		var m v1.Manifest
		if err := json.Unmarshal(raw, &m); err != nil {
			return nil, errdefs.InvalidArgument("manifest %s: %v", digest, err)
		}
		cdesc, err := checkManifest(&m, l)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", digest, err)
		}
		var buf bytes.Buffer
		if err := src.blob(ctx, cdesc.Digest.String(), cdesc.Size, &buf); err != nil {
			return nil, err
		}
		if got := digestOf(buf.Bytes()); got != cdesc.Digest.String() {
			return nil, errdefs.InvalidArgument("config %s of %s does not match its digest (it hashes to %s): refused", cdesc.Digest, digest, got)
		}
		var cfg ArtifactConfig
		if err := json.Unmarshal(buf.Bytes(), &cfg); err != nil {
			return nil, errdefs.InvalidArgument("config of %s: %v", digest, err)
		}
		if err := cfg.validate(l); err != nil {
			return nil, fmt.Errorf("%s: %w", digest, err)
		}
		if err := checkLayers(&m, &cfg); err != nil {
			return nil, fmt.Errorf("%s: %w", digest, err)
		}
		if n := len(links); n > 0 {
			child := links[n-1].cfg
			if child.Parent.ContentHash != cfg.ContentHash || !bytes.Equal(child.Machine, cfg.Machine) {
				return nil, errdefs.InvalidArgument("%s: the parent %s of %s is not the snapshot it names (content or machine differ)", src.name(), digest, links[n-1].digest)
			}
		}
		if err := h.compatible(ctx, host, &cfg); err != nil {
			return nil, err
		}
		lk := &link{digest: digest, m: &m, cfg: &cfg, local: h.findLocal(idx, digest, cfg.ContentHash)}
		links = append(links, lk)
		if lk.local != nil || cfg.Parent == nil {
			return links, nil
		}
		cur = cfg.Parent.Digest
	}
}

// findLocal returns the ready snapshot here with the content of artifact
// digest (the index says which, its content hash confirms; else any with
// that content hash), or nil.
func (h *Hub) findLocal(idx map[string]indexEntry, digest, contentHash string) *snapshot.Snapshot {
	if contentHash == "" {
		return nil
	}
	ok := func(sn *snapshot.Snapshot) bool {
		return sn.Status == snapshot.StatusReady && sn.ContentHash == contentHash && sn.Verify() == nil
	}
	if e, found := idx[digest]; found {
		if sn, err := h.cfg.Store.Get(e.Tag); err == nil && ok(sn) {
			return sn
		}
	}
	all, err := h.cfg.Store.List()
	if err != nil {
		return nil
	}
	for _, sn := range all {
		if ok(sn) {
			return sn
		}
	}
	return nil
}

// assignTags names the links to make: the top tag (or the tag it was
// pushed under), the others their pushed tags, or that and a short digest
// when the tag is taken here.
func (h *Hub) assignTags(links []*link, tag string) error {
	taken := map[string]bool{}
	free := func(t string) bool {
		if taken[t] {
			return false
		}
		_, err := h.cfg.Store.Get(t)
		return errdefs.IsNotFound(err)
	}
	for i, l := range links {
		if l.local != nil {
			continue
		}
		want := l.cfg.Tag
		if i == 0 && tag != "" {
			want = tag
		}
		switch {
		case free(want):
		case i == 0:
			return errdefs.AlreadyExists("snapshot %q exists here with other content; pull with --tag NEW (or remove it first)", want)
		default:
			short := strings.TrimPrefix(l.digest, "sha256:")[:12]
			want = want[:min(len(want), snapshot.MaxTagLen-13)] + "-" + short
			if !free(want) {
				return errdefs.AlreadyExists("snapshot %q exists here with other content", want)
			}
		}
		taken[want] = true
		l.tag = want
	}
	return nil
}

// fetchItem is a blob a pull needs.
type fetchItem struct {
	digest string
	size   int64
	file   string // for progress
}

// plan lists the blobs the new links need, each once: their boot files
// unless the content store (or a snapshot here) has them, their state and
// their memory chunks.
func (h *Hub) plan(links []*link) []fetchItem {
	var out []fetchItem
	seen := map[string]bool{}
	add := func(d string, size int64, file string) {
		if !seen[d] {
			seen[d] = true
			out = append(out, fetchItem{d, size, file})
		}
	}
	for i := len(links) - 1; i >= 0; i-- {
		l := links[i]
		if l.local != nil {
			continue
		}
		prefix := ""
		if i > 0 {
			prefix = l.tag + "/"
		}
		c := l.cfg
		for _, b := range []struct {
			b    *Blob
			name string
		}{{c.Kernel, "kernel"}, {c.Initrd, "initrd"}} {
			if b.b != nil && h.bootFile(b.b.SHA256, b.b.Bytes) == "" {
				add(b.b.Digest, b.b.Size, prefix+b.name)
			}
		}
		if c.Rootfs != nil && h.bootFile(c.Rootfs.SHA256, c.Rootfs.Bytes) == "" {
			for _, ch := range c.Rootfs.Chunks {
				add(ch.Digest, ch.Size, prefix+"rootfs")
			}
		}
		add(c.State.Digest, c.State.Size, prefix+"state")
		for _, ch := range c.Memory.Chunks {
			add(ch.Digest, ch.Size, prefix+"memory")
		}
	}
	return out
}

// bootFile returns a verified file here with sha256 sum and size bytes:
// in the content store, or a ready snapshot's (which Verify vouches for);
// "" if none.
func (h *Hub) bootFile(sum string, size int64) string {
	if h.content.has(sum, size) {
		return h.content.path(sum)
	}
	all, err := h.cfg.Store.List()
	if err != nil {
		return ""
	}
	for _, sn := range all {
		if sn.Status != snapshot.StatusReady || sn.Verify() != nil {
			continue
		}
		// Only the root filesystem's identity is checked by Verify.
		if sn.Rootfs.SHA256 == sum && sn.Rootfs.ID != nil && sn.Rootfs.ID.Size == size {
			return sn.Rootfs.Path
		}
	}
	return ""
}

// checkSpace refuses a pull the data dir's filesystem cannot hold: the
// blobs to fetch, the bytes they restore, and the memory a link's
// materialisation copies.
func (h *Hub) checkSpace(plan []fetchItem, links []*link) error {
	need := planBytes(plan)
	for _, l := range links {
		if l.local != nil {
			continue
		}
		need += l.cfg.Memory.DataBytes() + l.cfg.State.Bytes
		if l.cfg.Rootfs != nil && h.bootFile(l.cfg.Rootfs.SHA256, l.cfg.Rootfs.Bytes) == "" {
			need += l.cfg.Rootfs.DataBytes()
		}
		if l.cfg.Parent != nil {
			need += l.cfg.Memory.Bytes / 2 // a materialised copy, about
		}
	}
	var st unix.Statfs_t
	if err := unix.Statfs(h.cfg.Dir, &st); err != nil {
		return nil //nolint:nilerr // no figure: the writes will tell
	}
	if avail := int64(st.Bavail) * st.Bsize; avail < need {
		return errdefs.ResourceExhausted("pull needs about %s on %s; %s is free", mib(need), h.cfg.Dir, mib(avail))
	}
	return nil
}

// fetch brings every blob of plan into the cache, verified; blobs the
// cache has already (a pull cut short) are not fetched again.
func (h *Hub) fetch(ctx context.Context, src source, t *tracker, plan []fetchItem, fetched map[string]bool, cached *atomic.Int64) error {
	var mu sync.Mutex
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(fetchers)
	for _, it := range plan {
		t.expect(it.file, it.size)
		t.work(it.file, it.size)
		if h.cache.has(it.digest, it.size) {
			t.skipped(it.file, it.size)
			t.workDone(it.file, it.size)
			cached.Add(it.size)
			continue
		}
		g.Go(func() error {
			if err := h.cache.fetch(gctx, src, it.digest, it.size); err != nil {
				return fmt.Errorf("%s: %w", it.file, err)
			}
			mu.Lock()
			fetched[it.digest] = true
			mu.Unlock()
			t.moved(it.file, it.size)
			t.workDone(it.file, it.size)
			return nil
		})
	}
	return g.Wait()
}

// assemble makes link l a snapshot from the cached blobs: its boot files
// into the content store, its state, its memory (a link's layer over
// parent's memory), committed under l.tag.
func (h *Hub) assemble(ctx context.Context, l *link, parent *snapshot.Snapshot, origin string) (*snapshot.Snapshot, error) {
	c := l.cfg
	if c.Parent != nil && (parent == nil || parent.ContentHash != c.Parent.ContentHash) {
		return nil, errdefs.FailedPrecondition("its parent is not here")
	}
	var srcs sources
	defer srcs.close()
	paths := map[int]string{}
	for _, b := range []struct {
		src int
		b   *Blob
	}{{srcKernel, c.Kernel}, {srcInitrd, c.Initrd}} {
		if b.b == nil {
			continue
		}
		p, err := h.bootBlob(b.b)
		if err != nil {
			return nil, err
		}
		paths[b.src] = p
	}
	if c.Rootfs != nil {
		p, err := h.bootImage(ctx, c.Rootfs)
		if err != nil {
			return nil, fmt.Errorf("rootfs: %w", err)
		}
		paths[srcRootfs] = p
	}
	for src, p := range paths {
		f, err := os.Open(p)
		if err != nil {
			return nil, err
		}
		st, err := f.Stat()
		if err != nil {
			f.Close()
			return nil, err
		}
		srcs.f[src], srcs.size[src] = f, st.Size()
	}

	w, err := h.cfg.Store.Create(l.tag)
	if err != nil {
		return nil, err
	}
	defer func() { _ = w.Abort() }() // a no-op once committed
	if err := h.writeState(c, w.StatePath()); err != nil {
		return nil, err
	}
	mem := w.MemoryPath()
	if c.Parent != nil {
		mem = w.LayerPath()
	}
	out, err := os.OpenFile(mem, os.O_CREATE|os.O_EXCL|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	err = h.decodeImage(ctx, out, &c.Memory, &srcs)
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, fmt.Errorf("memory: %w", err)
	}
	if c.Parent != nil {
		if err := memimage.Materialize(parent.MemoryPath(), w.LayerPath(), w.MemoryPath()); err != nil {
			return nil, fmt.Errorf("materialise its memory: %w", err)
		}
	}
	md := snapshot.Metadata{
		Backend: c.Backend, BackendVersion: c.BackendVersion, Accelerator: c.Accelerator, Machine: c.Machine,
		Image: c.Image, MemoryMiB: c.MemoryMiB, VCPUs: c.VCPUs, Network: c.Network, DiskSlot: c.DiskSlot, Python: c.Python,
		Preload: c.Preload, Warmup: c.Warmup, ContentHash: c.ContentHash, Created: c.Created, Kind: c.Kind,
		Origin: &snapshot.Origin{Ref: origin, Digest: l.digest, Pulled: time.Now().UTC(), CPU: &c.CPU},
	}
	if c.Kernel != nil {
		md.Kernel = snapshot.FileRef{Path: paths[srcKernel], SHA256: c.Kernel.SHA256}
	}
	if c.Initrd != nil {
		md.Initrd = snapshot.FileRef{Path: paths[srcInitrd], SHA256: c.Initrd.SHA256}
	}
	if c.Rootfs != nil {
		md.Rootfs = snapshot.FileRef{Path: paths[srcRootfs], SHA256: c.Rootfs.SHA256}
	}
	if c.Branch != nil {
		md.Branch = &snapshot.BranchInfo{Mode: c.Branch.Mode, Depth: c.Branch.Depth}
	}
	if c.Parent != nil {
		md.Parent, md.ParentHash = parent.Tag, parent.ContentHash
	}
	if md.Created.IsZero() {
		md.Created = time.Now().UTC()
	}
	return w.Commit(md)
}

// bootBlob puts a boot file (kernel, initramfs) in the content store
// from the cache, unless it is here already, and returns its path.
func (h *Hub) bootBlob(b *Blob) (string, error) {
	if p := h.bootFile(b.SHA256, b.Bytes); p != "" {
		return p, nil
	}
	f, err := h.content.create(b.SHA256)
	if err != nil {
		return "", err
	}
	if err := h.cache.copyTo(b.Digest, f); err != nil {
		f.Close()
		os.Remove(f.Name())
		return "", err
	}
	if err := h.content.commit(f, b.SHA256); err != nil {
		return "", err
	}
	return h.content.path(b.SHA256), nil
}

// bootImage puts a root filesystem in the content store from its cached
// chunks, unless it is here already, and returns its path.
func (h *Hub) bootImage(ctx context.Context, im *Image) (string, error) {
	if p := h.bootFile(im.SHA256, im.Bytes); p != "" {
		return p, nil
	}
	f, err := h.content.create(im.SHA256)
	if err != nil {
		return "", err
	}
	if err := h.decodeImage(ctx, f, im, nil); err != nil {
		f.Close()
		os.Remove(f.Name())
		return "", err
	}
	if err := h.content.commit(f, im.SHA256); err != nil {
		return "", err
	}
	return h.content.path(im.SHA256), nil
}

// writeState decompresses the state blob into path, verified.
func (h *Hub) writeState(c *ArtifactConfig, path string) error {
	b, err := h.cache.read(c.State.Digest, c.State.Size)
	if err != nil {
		return fmt.Errorf("state: %w", err)
	}
	// The output is capped at the state's size; the window can be no
	// smaller than zstd's least, however small the state.
	zr, err := zstd.NewReader(nil, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxMemory(uint64(max(c.State.Bytes, zstd.MinWindowSize))),
		zstd.WithDecodeAllCapLimit(true))
	if err != nil {
		return err
	}
	defer zr.Close()
	state, err := zr.DecodeAll(b, make([]byte, 0, c.State.Bytes))
	if err != nil {
		return errdefs.InvalidArgument("state: %v", err)
	}
	sum := sha256.Sum256(state)
	if int64(len(state)) != c.State.Bytes || hex.EncodeToString(sum[:]) != c.State.SHA256 {
		return errdefs.InvalidArgument("state: %d bytes hashing to %x, not the %d bytes hashing to %s its config names", len(state), sum, c.State.Bytes, c.State.SHA256)
	}
	return os.WriteFile(path, state, 0o600)
}

// decodeImage writes im's chunks (from the cache, each verified again)
// into out, an empty file it sizes, and checks the pages they restore
// against im.PagesSHA256.
func (h *Hub) decodeImage(ctx context.Context, out *os.File, im *Image, srcs *sources) error {
	if err := out.Truncate(im.Bytes); err != nil {
		return writeErr(err)
	}
	jobs := make(chan Chunk)
	var mu sync.Mutex
	outs := make([]chunkOut, 0, len(im.Chunks))
	g, gctx := errgroup.WithContext(ctx)
	for range min(h.cfg.Workers, max(1, len(im.Chunks))) {
		g.Go(func() error {
			d, err := newDecoder(im.ChunkBytes, srcs)
			if err != nil {
				return err
			}
			defer d.close()
			for c := range jobs {
				b, err := h.cache.read(c.Digest, c.Size)
				if err != nil {
					return err
				}
				sum, err := d.decode(b, c.Index, im.Bytes, c.Pages, out)
				if err != nil {
					return err
				}
				mu.Lock()
				outs = append(outs, chunkOut{index: c.Index, pages: c.Pages, hash: sum})
				mu.Unlock()
			}
			return nil
		})
	}
	g.Go(func() error {
		defer close(jobs)
		for _, c := range im.Chunks {
			select {
			case jobs <- c:
			case <-gctx.Done():
				return gctx.Err()
			}
		}
		return nil
	})
	if err := g.Wait(); err != nil {
		return err
	}
	sort.Slice(outs, func(i, j int) bool { return outs[i].index < outs[j].index })
	if got := imageHash(outs); got != im.PagesSHA256 {
		return errdefs.InvalidArgument("the pages restored hash to %s, not the %s the config names: refused", got, im.PagesSHA256)
	}
	return nil
}

func keys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

func planBytes(plan []fetchItem) int64 {
	var n int64
	for _, it := range plan {
		n += it.size
	}
	return n
}

func planDigests(plan []fetchItem) []string {
	out := make([]string, len(plan))
	for i, it := range plan {
		out[i] = it.digest
	}
	return out
}

func countNew(links []*link) int {
	n := 0
	for _, l := range links {
		if l.local == nil {
			n++
		}
	}
	return n
}
