package hub

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/klauspost/compress/zstd"
	"golang.org/x/sync/errgroup"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/fsutil"
	"github.com/forkd/forkd/internal/snapshot"
)

// PushSpec says what Push sends where.
type PushSpec struct {
	// Tag is the snapshot; Ref the registry reference to push it to (its
	// tag names the snapshot there: "registry/repo:tag").
	Tag, Ref string
	Remote   Remote
	// OnProgress, if set, receives the progress as it goes.
	OnProgress func(Progress)
}

// Push sends snapshot spec.Tag, and its chain of parents (each its own
// artifact, by digest), to the registry. Blobs the repository has already
// (chunks of memory that did not change, a root filesystem another
// snapshot pushed) are not sent again.
func (h *Hub) Push(ctx context.Context, spec PushSpec) (*Result, error) {
	start := time.Now()
	if err := snapshot.ValidateTag(spec.Tag); err != nil {
		return nil, err
	}
	ref, err := parseRef(spec.Ref)
	if err != nil {
		return nil, err
	}
	t, ok := ref.(name.Tag)
	if !ok {
		return nil, errdefs.InvalidArgument("push to %s: give a tag (registry/repo:tag), not a digest", errdefs.Quote(spec.Ref))
	}
	g, err := dial(ctx, spec.Ref, spec.Remote, true)
	if err != nil {
		return nil, err
	}
	res, err := h.push(ctx, g, spec.Tag, t.TagStr(), spec.OnProgress, start)
	if res != nil {
		res.Op, res.Ref = "push", spec.Ref
		res.NetSent, res.NetReceived = g.stats.sent.Load(), g.stats.received.Load()
	}
	if err != nil {
		return res, err
	}
	entries := map[string]indexEntry{}
	for _, l := range res.Links {
		if sn, err := h.cfg.Store.Get(l.Tag); err == nil {
			entries[l.Digest] = indexEntry{Tag: l.Tag, ContentHash: sn.ContentHash, Ref: g.repo.String(), Time: time.Now().UTC()}
		}
	}
	if err := h.index.add(entries); err != nil {
		h.log.Warn("hub index", "err", err)
	}
	say(ctx, "pushed %s to %s (%s): %s of %s sent, %s already there, %.1fs", spec.Tag, spec.Ref, res.Digest,
		mib(res.Moved), mib(res.BlobBytes), mib(res.Skipped), res.Seconds)
	return res, nil
}

// push writes tag's chain to s, base first, and names the top refTag.
func (h *Hub) push(ctx context.Context, s sink, tag, refTag string, onProgress func(Progress), start time.Time) (*Result, error) {
	top, ref, err := h.cfg.Store.Acquire(tag)
	if err != nil {
		return nil, err
	}
	defer ref.Close()
	anc, err := h.cfg.Store.Ancestors(top)
	if err != nil {
		return nil, fmt.Errorf("%w; compact it to push it alone (forkd snapshot compact %s --to NEW)", err, tag)
	}
	if len(anc) >= h.cfg.Limits.Depth {
		return nil, errdefs.FailedPrecondition("snapshot %q: a chain of %d links; at most %d are pushed", tag, len(anc)+1, h.cfg.Limits.Depth)
	}
	chain := []*snapshot.Snapshot{top}
	for _, a := range anc {
		sn, r, err := h.cfg.Store.Acquire(a.Tag) // held: no rmi while it is read
		if err != nil {
			return nil, err
		}
		defer r.Close()
		chain = append(chain, sn)
	}
	slices.Reverse(chain)
	for _, sn := range chain {
		if _, mib := sn.DiskLayer(); mib > 0 {
			return nil, errdefs.FailedPrecondition("snapshot %q carries a writable disk of %d MiB (a branch of a sandbox with --disk-mib), which the hub does not move yet", sn.Tag, mib)
		}
	}
	host, err := h.cfg.Host(ctx)
	if err != nil {
		return nil, err
	}
	t := newTracker(onProgress)
	res := &Result{Tag: tag}
	defer func() { t.close(); res.finish(t, start) }()
	var parent *Parent
	var topRaw []byte
	for i, sn := range chain {
		prefix := ""
		if i < len(chain)-1 {
			prefix = sn.Tag + "/"
		}
		t.setPhase("push " + sn.Tag)
		cfg, digest, raw, err := h.pushLink(ctx, s, t, sn, parent, host.CPU, prefix)
		if err != nil {
			return res, fmt.Errorf("push %s: %w", sn.Tag, err)
		}
		res.Links = append(res.Links, Link{Tag: sn.Tag, Digest: digest})
		parent = &Parent{Digest: digest, ContentHash: sn.ContentHash, Tag: sn.Tag}
		if i == len(chain)-1 {
			res.Digest, topRaw = digest, raw
			res.MemoryBytes, res.MemoryData, res.MemoryBlobs = cfg.Memory.Bytes, cfg.Memory.DataBytes(), cfg.Memory.BlobBytes()
		}
	}
	if err := s.putManifest(ctx, topRaw, res.Digest, refTag); err != nil {
		return res, err
	}
	t.setPhase("done")
	return res, nil
}

// pushLink writes one snapshot's artifact: its boot files, state and
// memory (its layer, for a link), config and manifest (by digest). It
// returns the config, the manifest's digest and the manifest.
func (h *Hub) pushLink(ctx context.Context, s sink, t *tracker, sn *snapshot.Snapshot, parent *Parent, cpu CPU, prefix string) (*ArtifactConfig, string, []byte, error) {
	if sn.Branch != nil && sn.Branch.Disk != "" {
		return nil, "", nil, errdefs.NotImplemented("snapshot %q has a writable disk layer, which cannot be pushed yet", sn.Tag)
	}
	if (sn.Parent != "") != (parent != nil) {
		return nil, "", nil, errdefs.FailedPrecondition("snapshot %q: its chain changed while it was pushed", sn.Tag)
	}
	cfg := configOf(sn, cpu)
	cfg.Parent = parent

	// Boot files: kernel and initramfs as they are (already compressed),
	// each only if it is still the file the snapshot was made with.
	var srcFiles [nSources]*os.File
	defer func() {
		for _, f := range srcFiles {
			if f != nil {
				f.Close()
			}
		}
	}()
	for _, b := range []struct {
		src   int
		ref   snapshot.FileRef
		name  string
		media string
		dst   **Blob
	}{{srcKernel, sn.Kernel, "kernel", KernelType, &cfg.Kernel}, {srcInitrd, sn.Initrd, "initrd", InitrdType, &cfg.Initrd}} {
		if b.ref.Path == "" {
			continue
		}
		f, blob, err := rawBlob(b.ref.Path, b.media)
		if err != nil || (b.ref.SHA256 != "" && "sha256:"+b.ref.SHA256 != blob.digest) {
			if f != nil {
				f.Close()
			}
			say(ctx, "%s: %s is not the file it was made with any more; pushed without it", sn.Tag, b.name)
			continue
		}
		srcFiles[b.src] = f
		*b.dst = &Blob{Digest: blob.digest, Size: blob.size, SHA256: strings.TrimPrefix(blob.digest, "sha256:"), Bytes: blob.size}
		if err := h.send(ctx, s, t, prefix+b.name, blob); err != nil {
			return nil, "", nil, err
		}
		fileDone(ctx, t, prefix+b.name, "sent")
	}
	if sn.Rootfs.Path != "" {
		if sn.Rootfs.SHA256 == "" {
			return nil, "", nil, errdefs.FailedPrecondition("snapshot %q records no sha256 of its root filesystem; rebuild it to push it", sn.Tag)
		}
		f, err := os.Open(sn.Rootfs.Path)
		if err != nil {
			return nil, "", nil, err
		}
		srcFiles[srcRootfs] = f
		im, err := h.pushImage(ctx, s, t, prefix+"rootfs", imageSpec{
			file: f, holes: HolesZero, media: RootfsChunkType,
			key: "rootfs-" + sn.Rootfs.SHA256,
		})
		if err != nil {
			return nil, "", nil, fmt.Errorf("rootfs: %w", err)
		}
		im.SHA256 = sn.Rootfs.SHA256
		cfg.Rootfs = im
		fileDone(ctx, t, prefix+"rootfs", "sent")
	}

	// Device state, compressed whole.
	state, err := os.ReadFile(sn.StatePath())
	if err != nil {
		return nil, "", nil, err
	}
	zw, err := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedDefault), zstd.WithEncoderConcurrency(1))
	if err != nil {
		return nil, "", nil, err
	}
	zs := zw.EncodeAll(state, nil)
	stateSum := sha256.Sum256(state)
	cfg.State = Blob{Digest: digestOf(zs), Size: int64(len(zs)), SHA256: hex.EncodeToString(stateSum[:]), Bytes: int64(len(state))}
	if err := h.send(ctx, s, t, prefix+"state", blob{digest: cfg.State.Digest, size: cfg.State.Size, mediaType: StateType, data: zs}); err != nil {
		return nil, "", nil, err
	}

	// Memory: a link's layer (the pages that differ from its parent), or
	// the whole memory, pages of zeros left out.
	mem, holes := sn.MemoryPath(), HolesZero
	if parent != nil {
		mem, holes = sn.LayerPath(), HolesParent
	}
	f, err := os.Open(mem)
	if err != nil {
		return nil, "", nil, err
	}
	defer f.Close()
	id, err := snapshot.Identify(mem)
	if err != nil {
		return nil, "", nil, err
	}
	if id.Size != int64(sn.MemoryMiB)<<20 {
		return nil, "", nil, errdefs.FailedPrecondition("snapshot %q: %s is %d bytes for %d MiB of RAM", sn.Tag, filepath.Base(mem), id.Size, sn.MemoryMiB)
	}
	keyParts := []string{"memory-v1", sn.ContentHash, holes, fmt.Sprint(id.Ino, id.Size, id.MtimeNS)}
	for _, b := range []*Blob{cfg.Kernel, cfg.Initrd} {
		if b != nil {
			keyParts = append(keyParts, b.SHA256)
		}
	}
	if cfg.Rootfs != nil {
		keyParts = append(keyParts, cfg.Rootfs.SHA256)
	}
	im, err := h.pushImage(ctx, s, t, prefix+"memory", imageSpec{
		file: f, holes: holes, media: MemoryChunkType, key: "memory-" + hashStrings(keyParts),
		refs: func() (*pageIndex, error) { return newPageIndex(srcFiles) },
	})
	if err != nil {
		return nil, "", nil, fmt.Errorf("memory: %w", err)
	}
	cfg.Memory = *im
	fileDone(ctx, t, prefix+"memory", "sent")

	// Config, then the manifest naming it all.
	cb, err := json.Marshal(cfg)
	if err != nil {
		return nil, "", nil, err
	}
	cdesc := v1.Descriptor{MediaType: types.MediaType(ConfigType), Size: int64(len(cb))}
	if cdesc.Digest, err = v1.NewHash(digestOf(cb)); err != nil {
		return nil, "", nil, err
	}
	if err := h.send(ctx, s, t, prefix+"config", blob{digest: cdesc.Digest.String(), size: cdesc.Size, mediaType: ConfigType, data: cb}); err != nil {
		return nil, "", nil, err
	}
	m, err := cfg.manifest(cdesc)
	if err != nil {
		return nil, "", nil, err
	}
	raw, err := json.Marshal(m)
	if err != nil {
		return nil, "", nil, err
	}
	digest := digestOf(raw)
	if err := s.putManifest(ctx, raw, digest, ""); err != nil {
		return nil, "", nil, err
	}
	return &cfg, digest, raw, nil
}

// configOf is the artifact config of snapshot sn, made on a host with cpu
// (or, pulled, on the one its origin says).
func configOf(sn *snapshot.Snapshot, cpu CPU) ArtifactConfig {
	md := sn.Metadata
	c := ArtifactConfig{
		FormatVersion: FormatVersion, Tag: md.Tag, Created: md.Created, Kind: md.Kind,
		Backend: md.Backend, BackendVersion: md.BackendVersion, Accelerator: md.Accelerator, Machine: md.Machine,
		CPU: cpu, MemoryMiB: md.MemoryMiB, VCPUs: md.VCPUs, Network: md.Network, DiskSlot: md.DiskSlot, Image: md.Image,
		Python: md.Python, Preload: md.Preload, Warmup: md.Warmup, ContentHash: md.ContentHash,
	}
	if md.Origin != nil && md.Origin.CPU != nil {
		c.CPU = *md.Origin.CPU
	}
	if md.Branch != nil {
		c.Branch = &Branch{Mode: md.Branch.Mode, Depth: md.Branch.Depth}
	}
	return c
}

// fileDone reports a file of a transfer done, from its progress.
func fileDone(ctx context.Context, t *tracker, name, verb string) {
	for _, f := range t.snapshot().Files {
		if f.Name == name {
			line := fmt.Sprintf("%s: %s in %d blob(s), %s %s", name, mib(f.Total), f.Blobs, mib(f.Done), verb)
			if f.Skipped > 0 {
				line += fmt.Sprintf(", %s there already", mib(f.Skipped))
			}
			say(ctx, "%s", line)
		}
	}
}

// send stores b in s unless s has it, counting it for file name.
func (h *Hub) send(ctx context.Context, s sink, t *tracker, name string, b blob) error {
	t.expect(name, b.size)
	t.work(name, b.size)
	defer t.workDone(name, b.size)
	have, err := s.has(ctx, b.digest)
	if err != nil {
		return err
	}
	if have {
		t.skipped(name, b.size)
		return nil
	}
	if err := s.put(ctx, b); err != nil {
		return err
	}
	t.moved(name, b.size)
	return nil
}

// rawBlob is the file at path as a blob; the file is returned open.
func rawBlob(path, media string) (*os.File, blob, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, blob{}, err
	}
	h := sha256.New()
	n, err := io.Copy(h, io.NewSectionReader(f, 0, 1<<62))
	if err != nil {
		return f, blob{}, err
	}
	b := blob{digest: "sha256:" + hex.EncodeToString(h.Sum(nil)), size: n, mediaType: media,
		open: func() (io.ReadCloser, error) {
			return io.NopCloser(io.NewSectionReader(f, 0, n)), nil
		}}
	return f, b, nil
}

// imageSpec is an image file to push in chunks.
type imageSpec struct {
	file  *os.File
	holes string
	media string
	// key names what encoding this file gives, for the push cache: the
	// same key, the same chunks.
	key string
	// refs builds the page index (nil: no page references).
	refs func() (*pageIndex, error)
}

// pushImage stores the chunks of an image in s. What an earlier push
// encoded for the same key is only checked for (HEAD), not encoded again,
// when the sink has every chunk of it.
func (h *Hub) pushImage(ctx context.Context, s sink, t *tracker, name string, spec imageSpec) (*Image, error) {
	st, err := spec.file.Stat()
	if err != nil {
		return nil, err
	}
	if st.Size()%PageSize != 0 || st.Size() == 0 {
		return nil, errdefs.FailedPrecondition("%s is %d bytes, not whole pages", spec.file.Name(), st.Size())
	}
	if im := h.loadPushed(spec.key); im != nil && im.Bytes == st.Size() {
		all := true
		for _, c := range im.Chunks {
			ok, err := s.has(ctx, c.Digest)
			if err != nil {
				return nil, err
			}
			if !ok {
				all = false
				break
			}
		}
		if all {
			for _, c := range im.Chunks {
				t.expect(name, c.Size)
				t.skipped(name, c.Size)
			}
			return im, nil
		}
	}
	var refs *pageIndex
	if spec.refs != nil {
		if refs, err = spec.refs(); err != nil {
			return nil, err
		}
	}
	w := int64(DefaultChunkBytes)
	windows := (st.Size() + w - 1) / w
	t.work(name, allocated(st))
	jobs := make(chan int64)
	var mu sync.Mutex
	var outs []chunkOut
	g, gctx := errgroup.WithContext(ctx)
	for range min(h.cfg.Workers, int(windows)) {
		g.Go(func() error {
			f, err := os.Open(spec.file.Name())
			if err != nil {
				return err
			}
			defer f.Close()
			enc, err := newEncoder(w, spec.holes == HolesZero, refs)
			if err != nil {
				return err
			}
			for idx := range jobs {
				out, err := enc.encode(f, st.Size(), idx)
				if err != nil {
					return err
				}
				t.workDone(name, out.read)
				if out.blob == nil {
					continue
				}
				b := blob{digest: digestOf(out.blob), size: int64(len(out.blob)), mediaType: spec.media, data: out.blob}
				t.expect(name, b.size)
				have, err := s.has(gctx, b.digest)
				if err != nil {
					return err
				}
				if have {
					t.skipped(name, b.size)
				} else {
					if err := s.put(gctx, b); err != nil {
						return err
					}
					t.moved(name, b.size)
				}
				out.blob, out.digest, out.size = nil, b.digest, b.size
				mu.Lock()
				outs = append(outs, out)
				mu.Unlock()
			}
			return nil
		})
	}
	g.Go(func() error {
		defer close(jobs)
		for idx := range windows {
			select {
			case jobs <- idx:
			case <-gctx.Done():
				return gctx.Err()
			}
		}
		return nil
	})
	if err := g.Wait(); err != nil {
		return nil, err
	}
	sort.Slice(outs, func(i, j int) bool { return outs[i].index < outs[j].index })
	im := &Image{Bytes: st.Size(), ChunkBytes: w, Holes: spec.holes, Chunks: make([]Chunk, len(outs))}
	for i, o := range outs {
		im.Chunks[i] = Chunk{Index: o.index, Digest: o.digest, Size: o.size, Pages: o.pages}
	}
	im.PagesSHA256 = imageHash(outs)
	h.savePushed(spec.key, im)
	return im, nil
}

// allocated is the bytes of data a file holds (its blocks).
func allocated(st os.FileInfo) int64 {
	if s, ok := st.Sys().(interface{ Blocks() int64 }); ok {
		return s.Blocks() * 512
	}
	return st.Size()
}

// loadPushed returns what a push encoded for key, or nil.
func (h *Hub) loadPushed(key string) *Image {
	b, err := os.ReadFile(h.pushedPath(key))
	if err != nil {
		return nil
	}
	var im Image
	if json.Unmarshal(b, &im) != nil || len(im.Chunks) == 0 {
		return nil
	}
	return &im
}

func (h *Hub) savePushed(key string, im *Image) {
	if err := os.MkdirAll(filepath.Dir(h.pushedPath(key)), 0o700); err != nil {
		return
	}
	if err := fsutil.WriteJSON(h.pushedPath(key), im, 0o600); err != nil {
		h.log.Warn("hub push cache", "err", err)
	}
}

func (h *Hub) pushedPath(key string) string {
	return filepath.Join(h.cfg.Dir, "pushed", fmt.Sprintf("%s-w%d.json", key, DefaultChunkBytes))
}

// digestOf is the sha256 digest of b.
func digestOf(b []byte) string {
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:])
}

// hashStrings is a hex sha256 of parts.
func hashStrings(parts []string) string {
	h := sha256.New()
	for _, p := range parts {
		fmt.Fprintf(h, "%d:%s\n", len(p), p)
	}
	return hex.EncodeToString(h.Sum(nil))
}
