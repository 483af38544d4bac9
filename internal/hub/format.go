package hub

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/forkd/forkd/internal/errdefs"
	"github.com/forkd/forkd/internal/snapshot"
)

// Media types of a snapshot artifact (see the package doc).
const (
	ArtifactType    = "application/vnd.forkd.snapshot.v1"
	ConfigType      = "application/vnd.forkd.snapshot.config.v1+json"
	StateType       = "application/vnd.forkd.snapshot.state.v1+zstd"
	MemoryChunkType = "application/vnd.forkd.snapshot.memory.chunk.v1+zstd"
	RootfsChunkType = "application/vnd.forkd.rootfs.chunk.v1+zstd"
	KernelType      = "application/vnd.forkd.kernel.v1"
	InitrdType      = "application/vnd.forkd.initrd.v1"
)

// FormatVersion is the version of ArtifactConfig this code writes and reads.
const FormatVersion = 1

// Annotations of a snapshot's manifest.
const (
	AnnotationTag     = "dev.forkd.snapshot.tag"
	AnnotationParent  = "dev.forkd.snapshot.parent"
	AnnotationCreated = "org.opencontainers.image.created"
	AnnotationTitle   = "org.opencontainers.image.title"
)

// Hole modes of an Image: what a page no chunk holds reads as.
const (
	// HolesZero: zeros (a boot snapshot's memory, a root filesystem).
	HolesZero = "zero"
	// HolesParent: the parent's page (a chain link's layer).
	HolesParent = "parent"
)

// ArtifactConfig is a snapshot artifact's config blob: everything about the
// snapshot but its bytes, and where its bytes are. A puller reads it
// first, and refuses a snapshot it cannot restore before fetching more.
type ArtifactConfig struct {
	FormatVersion int       `json:"format_version"`
	Tag           string    `json:"tag"`
	Created       time.Time `json:"created"`
	// Kind and Branch are as in snapshot.Metadata.
	Kind   string  `json:"kind,omitempty"`
	Branch *Branch `json:"branch,omitempty"`
	// Backend, BackendVersion, Accelerator and Machine (the backend's
	// machine identity) say what can restore the snapshot; CPU is the
	// host CPU it was made on.
	Backend        string          `json:"backend"`
	BackendVersion string          `json:"backend_version"`
	Accelerator    string          `json:"accelerator"`
	Machine        json.RawMessage `json:"machine"`
	CPU            CPU             `json:"cpu"`
	MemoryMiB      int             `json:"memory_mib"`
	VCPUs          int             `json:"vcpus"`
	Network        bool            `json:"network,omitempty"`
	// DiskSlot: the machine has a disk slot after its root file system
	// (snapshot.Metadata's); its children need that disk to restore.
	DiskSlot bool     `json:"disk_slot,omitempty"`
	Image    string   `json:"image,omitempty"`
	Python   string   `json:"python,omitempty"`
	Preload  []string `json:"preload,omitempty"`
	Warmup   []string `json:"warmup,omitempty"`
	// ContentHash is the snapshot's content hash (snapshot.Metadata's).
	ContentHash string `json:"content_hash"`
	// Parent, for a chain link, names the artifact of the snapshot its
	// layer applies to.
	Parent *Parent `json:"parent,omitempty"`
	// State is the device state; Memory the guest RAM (a link: its layer,
	// HolesParent); Kernel, Initrd and Rootfs the boot files (Rootfs nil
	// for an image without a root filesystem).
	State  Blob   `json:"state"`
	Memory Image  `json:"memory"`
	Kernel *Blob  `json:"kernel,omitempty"`
	Initrd *Blob  `json:"initrd,omitempty"`
	Rootfs *Image `json:"rootfs,omitempty"`
}

// Branch is what a branch records of its making.
type Branch struct {
	Mode  string `json:"mode"`
	Depth int    `json:"depth,omitempty"`
}

// Parent names a chain link's parent: its artifact's manifest digest (in
// the same repository) and its content hash.
type Parent struct {
	Digest      string `json:"digest"`
	ContentHash string `json:"content_hash"`
	Tag         string `json:"tag,omitempty"`
}

// CPU is the host CPU a snapshot was made on. Under KVM with the host's
// CPU model a restoring host needs every one of its flags.
type CPU = snapshot.CPU

// Blob is a file stored as one blob: Digest and Size are the blob's,
// SHA256 and Bytes the file's (they differ when the blob is compressed).
type Blob struct {
	Digest string `json:"digest"`
	Size   int64  `json:"size"`
	SHA256 string `json:"sha256"`
	Bytes  int64  `json:"bytes"`
}

// Image is a sparse image stored as chunks: windows of ChunkBytes, each
// chunk holding the pages its window has data for (chunk.go). Pages no
// chunk holds read as Holes says.
type Image struct {
	Bytes      int64  `json:"bytes"`
	ChunkBytes int64  `json:"chunk_bytes"`
	Holes      string `json:"holes"`
	// SHA256 is, for a root filesystem, the sha256 of the whole file; for
	// memory, PagesSHA256 is the hash of the pages the chunks restore
	// (see imageHash).
	SHA256      string  `json:"sha256,omitempty"`
	PagesSHA256 string  `json:"pages_sha256,omitempty"`
	Chunks      []Chunk `json:"chunks"`
}

// Chunk is one window's blob.
type Chunk struct {
	Index  int64  `json:"index"`
	Digest string `json:"digest"`
	Size   int64  `json:"size"`
	// Pages is how many pages the chunk restores.
	Pages int `json:"pages"`
}

// DataBytes is the bytes of pages the image's chunks restore.
func (im *Image) DataBytes() int64 {
	var n int64
	for _, c := range im.Chunks {
		n += int64(c.Pages) * PageSize
	}
	return n
}

// BlobBytes is the bytes of the image's chunk blobs.
func (im *Image) BlobBytes() int64 {
	var n int64
	for _, c := range im.Chunks {
		n += c.Size
	}
	return n
}

// Limits bound what a pull or unpack accepts: a hostile registry or file
// cannot make it hold or write more.
type Limits struct {
	ManifestBytes int64 // a manifest (default 4 MiB)
	ConfigBytes   int64 // a config blob (default 4 MiB)
	MemoryMiB     int   // guest RAM (default 64 GiB)
	RootfsBytes   int64 // a root filesystem image (default 64 GiB)
	StateBytes    int64 // device state (default 256 MiB)
	BootBytes     int64 // a kernel or initramfs (default 512 MiB)
	Depth         int   // links in a chain (default snapshot.MaxDepth)
}

func (l Limits) withDefaults() Limits {
	def := func(v *int64, d int64) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&l.ManifestBytes, 4<<20)
	def(&l.ConfigBytes, 4<<20)
	def(&l.RootfsBytes, 64<<30)
	def(&l.StateBytes, 256<<20)
	def(&l.BootBytes, 512<<20)
	if l.MemoryMiB <= 0 {
		l.MemoryMiB = 64 << 10
	}
	if l.Depth <= 0 {
		l.Depth = snapshot.MaxDepth
	}
	return l
}

var (
	digestRE = regexp.MustCompile(`^sha256:[0-9a-f]{64}$`)
	hexRE    = regexp.MustCompile(`^[0-9a-f]{64}$`)
	titleRE  = regexp.MustCompile(`^[a-z]{1,16}(\.[0-9]{1,9})?$`)
	flagRE   = regexp.MustCompile(`^[a-z0-9_.]{1,64}$`)
)

// Chunk windows accepted: a power of two from 1 MiB to 64 MiB.
const (
	minChunkBytes = 1 << 20
	maxChunkBytes = 64 << 20
)

// maxChunkBlob bounds a chunk blob of a window of w bytes: its pages
// stored raw, with zstd's framing and the chunk header.
func maxChunkBlob(w int64) int64 { return w + w/64 + 64<<10 }

// checkDigest checks a digest's form.
func checkDigest(what, d string) error {
	if !digestRE.MatchString(d) {
		return errdefs.InvalidArgument("%s: digest %s is not sha256:<64 hex digits>", what, errdefs.Quote(d))
	}
	return nil
}

// validate checks a config from elsewhere before anything of it is used:
// every field in range, every digest well formed, every chunk inside its
// image and no bigger than its window allows, and the total within l.
func (c *ArtifactConfig) validate(l Limits) error {
	bad := func(format string, args ...any) error {
		return errdefs.InvalidArgument("snapshot config: "+format, args...)
	}
	switch {
	case c.FormatVersion != FormatVersion:
		return errdefs.FailedPrecondition("snapshot config: format version %d; this forkd reads %d", c.FormatVersion, FormatVersion)
	case c.MemoryMiB <= 0 || c.MemoryMiB > l.MemoryMiB:
		return bad("memory_mib %d: want 1 to %d", c.MemoryMiB, l.MemoryMiB)
	case c.VCPUs <= 0 || c.VCPUs > 1024:
		return bad("vcpus %d", c.VCPUs)
	case len(c.Machine) == 0 || len(c.Machine) > 64<<10:
		return bad("machine identity of %d bytes", len(c.Machine))
	case len(c.ContentHash) > 128 || !printable(c.ContentHash):
		return bad("content hash %s", errdefs.Quote(c.ContentHash))
	case c.Kind != "" && c.Kind != snapshot.KindBoot && c.Kind != snapshot.KindBranch:
		return bad("kind %s", errdefs.Quote(c.Kind))
	}
	if err := snapshot.ValidateTag(c.Tag); err != nil {
		return bad("tag: %v", err)
	}
	for _, s := range []struct{ what, v string }{
		{"backend", c.Backend}, {"backend version", c.BackendVersion}, {"accelerator", c.Accelerator},
	} {
		if s.v == "" || len(s.v) > 64 || !printable(s.v) || strings.ContainsAny(s.v, " ,/") {
			return bad("%s %s", s.what, errdefs.Quote(s.v))
		}
	}
	if c.Image != "" {
		if err := snapshot.ValidateTag(c.Image); err != nil || strings.Contains(c.Image, "..") {
			return bad("image name %s", errdefs.Quote(c.Image))
		}
	}
	if len(c.Python) > 256 || !printable(c.Python) || len(c.Preload) > 64 || len(c.Warmup) > 64 {
		return bad("python, preload or warmup out of bounds")
	}
	for _, s := range append(append([]string(nil), c.Preload...), c.Warmup...) {
		if len(s) > 4096 {
			return bad("a preload or warmup entry of %d bytes", len(s))
		}
	}
	if len(c.CPU.Flags) > 1024 || len(c.CPU.Vendor) > 64 || len(c.CPU.Model) > 256 {
		return bad("cpu description out of bounds")
	}
	for _, f := range c.CPU.Flags {
		if !flagRE.MatchString(f) {
			return bad("cpu flag %s", errdefs.Quote(f))
		}
	}
	if b := c.Branch; b != nil {
		if b.Depth < 0 || b.Depth > l.Depth || len(b.Mode) > 16 || !printable(b.Mode) {
			return bad("branch %s at depth %d", errdefs.Quote(b.Mode), b.Depth)
		}
	}
	if p := c.Parent; p != nil {
		if err := checkDigest("parent", p.Digest); err != nil {
			return err
		}
		if p.ContentHash == "" || len(p.ContentHash) > 128 || !printable(p.ContentHash) {
			return bad("parent content hash %s", errdefs.Quote(p.ContentHash))
		}
		if p.Tag != "" && snapshot.ValidateTag(p.Tag) != nil {
			return bad("parent tag %s", errdefs.Quote(p.Tag))
		}
	}
	if err := c.State.validate("state", l.StateBytes); err != nil {
		return err
	}
	memBytes := int64(c.MemoryMiB) << 20
	holes := HolesZero
	if c.Parent != nil {
		holes = HolesParent
	}
	if err := c.Memory.validate("memory", memBytes, holes, memBytes); err != nil {
		return err
	}
	if c.Memory.Bytes != memBytes {
		return bad("memory of %d bytes for %d MiB of RAM", c.Memory.Bytes, c.MemoryMiB)
	}
	for _, b := range []struct {
		what string
		b    *Blob
	}{{"kernel", c.Kernel}, {"initrd", c.Initrd}} {
		if b.b != nil {
			if err := b.b.validate(b.what, l.BootBytes); err != nil {
				return err
			}
		}
	}
	if c.Rootfs != nil {
		if err := c.Rootfs.validate("rootfs", c.Rootfs.Bytes, HolesZero, l.RootfsBytes); err != nil {
			return err
		}
		if !hexRE.MatchString(c.Rootfs.SHA256) {
			return bad("rootfs sha256 %s", errdefs.Quote(c.Rootfs.SHA256))
		}
	}
	return nil
}

func (b *Blob) validate(what string, max int64) error {
	if err := checkDigest(what, b.Digest); err != nil {
		return err
	}
	switch {
	case b.Bytes < 0 || b.Bytes > max:
		return errdefs.InvalidArgument("snapshot config: %s of %d bytes (the limit is %d)", what, b.Bytes, max)
	case b.Size <= 0 || b.Size > max+max/64+64<<10:
		return errdefs.InvalidArgument("snapshot config: %s blob of %d bytes for a file of %d", what, b.Size, b.Bytes)
	case !hexRE.MatchString(b.SHA256):
		return errdefs.InvalidArgument("snapshot config: %s sha256 %s", what, errdefs.Quote(b.SHA256))
	}
	return nil
}

// validate checks an image of size bytes at most max, with holes mode
// want: chunk windows, indexes strictly increasing inside the image, blob
// and page counts each window can hold.
func (im *Image) validate(what string, size int64, want string, max int64) error {
	bad := func(format string, args ...any) error {
		return errdefs.InvalidArgument("snapshot config: %s: "+format, append([]any{what}, args...)...)
	}
	w := im.ChunkBytes
	switch {
	case im.Bytes <= 0 || im.Bytes > max || im.Bytes != size:
		return bad("%d bytes (the limit is %d)", im.Bytes, max)
	case im.Bytes%PageSize != 0:
		return bad("%d bytes is not whole pages", im.Bytes)
	case w < minChunkBytes || w > maxChunkBytes || w&(w-1) != 0:
		return bad("chunk window of %d bytes: want a power of two from %d to %d", w, minChunkBytes, maxChunkBytes)
	case im.Holes != want:
		return bad("holes %s, want %s", errdefs.Quote(im.Holes), want)
	}
	if !hexRE.MatchString(im.PagesSHA256) {
		return bad("pages_sha256 %s", errdefs.Quote(im.PagesSHA256))
	}
	windows := (im.Bytes + w - 1) / w
	if int64(len(im.Chunks)) > windows {
		return bad("%d chunks for %d windows", len(im.Chunks), windows)
	}
	last := int64(-1)
	for i, c := range im.Chunks {
		switch {
		case c.Index <= last || c.Index >= windows:
			return bad("chunk %d has window %d (after %d, of %d)", i, c.Index, last, windows)
		case c.Size <= 0 || c.Size > maxChunkBlob(w):
			return bad("chunk %d is %d bytes; a window of %d holds at most %d", i, c.Size, w, maxChunkBlob(w))
		case c.Pages <= 0 || int64(c.Pages) > w/PageSize:
			return bad("chunk %d restores %d pages", i, c.Pages)
		}
		if err := checkDigest(fmt.Sprintf("%s chunk %d", what, i), c.Digest); err != nil {
			return err
		}
		last = c.Index
	}
	return nil
}

// printable reports whether s is printable ASCII.
func printable(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return false
		}
	}
	return true
}

// blobRef is one blob an artifact's manifest lists.
type blobRef struct {
	mediaType string
	digest    string
	size      int64
	title     string
}

// blobs lists the config's blobs in manifest order, each once (two
// identical windows share one blob).
func (c *ArtifactConfig) blobs() []blobRef {
	var out []blobRef
	seen := map[string]bool{}
	add := func(r blobRef) {
		if !seen[r.digest] {
			seen[r.digest] = true
			out = append(out, r)
		}
	}
	add(blobRef{StateType, c.State.Digest, c.State.Size, "state"})
	if c.Kernel != nil {
		add(blobRef{KernelType, c.Kernel.Digest, c.Kernel.Size, "kernel"})
	}
	if c.Initrd != nil {
		add(blobRef{InitrdType, c.Initrd.Digest, c.Initrd.Size, "initrd"})
	}
	if c.Rootfs != nil {
		for _, ch := range c.Rootfs.Chunks {
			add(blobRef{RootfsChunkType, ch.Digest, ch.Size, fmt.Sprintf("rootfs.%d", ch.Index)})
		}
	}
	for _, ch := range c.Memory.Chunks {
		add(blobRef{MemoryChunkType, ch.Digest, ch.Size, fmt.Sprintf("memory.%d", ch.Index)})
	}
	return out
}

// manifest returns the artifact's manifest for config blob cfg.
func (c *ArtifactConfig) manifest(cfg v1.Descriptor) (*v1.Manifest, error) {
	m := &v1.Manifest{
		SchemaVersion: 2,
		MediaType:     types.OCIManifestSchema1,
		ArtifactType:  ArtifactType,
		Config:        cfg,
		Layers:        []v1.Descriptor{},
		Annotations: map[string]string{
			AnnotationTag:     c.Tag,
			AnnotationCreated: c.Created.UTC().Format(time.RFC3339),
		},
	}
	if c.Parent != nil {
		m.Annotations[AnnotationParent] = c.Parent.Digest
	}
	for _, b := range c.blobs() {
		h, err := v1.NewHash(b.digest)
		if err != nil {
			return nil, err
		}
		m.Layers = append(m.Layers, v1.Descriptor{MediaType: types.MediaType(b.mediaType), Digest: h, Size: b.size,
			Annotations: map[string]string{AnnotationTitle: b.title}})
	}
	return m, nil
}

// checkManifest checks a manifest from elsewhere: a forkd snapshot
// artifact whose config blob is bounded by l, whose layers are plain
// blobs (no foreign URLs, no titles that could name a path), each once.
// It returns the config descriptor.
func checkManifest(m *v1.Manifest, l Limits) (v1.Descriptor, error) {
	bad := func(format string, args ...any) error {
		return errdefs.InvalidArgument("manifest: "+format, args...)
	}
	switch {
	case m.SchemaVersion != 2:
		return v1.Descriptor{}, bad("schema version %d", m.SchemaVersion)
	case m.MediaType != "" && m.MediaType != types.OCIManifestSchema1:
		return v1.Descriptor{}, bad("media type %s is not an OCI image manifest", errdefs.Quote(string(m.MediaType)))
	case m.ArtifactType != ArtifactType && string(m.Config.MediaType) != ConfigType:
		return v1.Descriptor{}, errdefs.InvalidArgument("not a forkd snapshot: artifact type %s, config type %s (want %s)",
			errdefs.Quote(m.ArtifactType), errdefs.Quote(string(m.Config.MediaType)), ArtifactType)
	case string(m.Config.MediaType) != ConfigType:
		return v1.Descriptor{}, bad("config media type %s, want %s", errdefs.Quote(string(m.Config.MediaType)), ConfigType)
	case m.Config.Size <= 0 || m.Config.Size > l.ConfigBytes:
		return v1.Descriptor{}, bad("config blob of %d bytes (the limit is %d)", m.Config.Size, l.ConfigBytes)
	}
	if err := checkDigest("config", m.Config.Digest.String()); err != nil {
		return v1.Descriptor{}, err
	}
	seen := map[string]bool{}
	for i, d := range m.Layers {
		if len(d.URLs) > 0 {
			return v1.Descriptor{}, bad("layer %d has foreign URLs", i)
		}
		if t, ok := d.Annotations[AnnotationTitle]; ok && !titleRE.MatchString(t) {
			return v1.Descriptor{}, bad("layer %d is titled %s: not a plain name (path tricks are refused)", i, errdefs.Quote(t))
		}
		if err := checkDigest(fmt.Sprintf("layer %d", i), d.Digest.String()); err != nil {
			return v1.Descriptor{}, err
		}
		if seen[d.Digest.String()] {
			return v1.Descriptor{}, bad("layer %d repeats blob %s", i, d.Digest)
		}
		seen[d.Digest.String()] = true
	}
	return m.Config, nil
}

// checkLayers checks that the manifest lists exactly the config's blobs,
// with the same sizes and media types.
func checkLayers(m *v1.Manifest, c *ArtifactConfig) error {
	want := c.blobs()
	if len(want) != len(m.Layers) {
		return errdefs.InvalidArgument("manifest lists %d layers; its config names %d blobs", len(m.Layers), len(want))
	}
	byDigest := map[string]v1.Descriptor{}
	for _, d := range m.Layers {
		byDigest[d.Digest.String()] = d
	}
	for _, b := range want {
		d, ok := byDigest[b.digest]
		switch {
		case !ok:
			return errdefs.InvalidArgument("manifest lacks blob %s (%s) that its config names", b.digest, b.title)
		case d.Size != b.size:
			return errdefs.InvalidArgument("blob %s (%s): manifest says %d bytes, config %d", b.digest, b.title, d.Size, b.size)
		case string(d.MediaType) != b.mediaType:
			return errdefs.InvalidArgument("blob %s (%s): media type %s, want %s", b.digest, b.title, errdefs.Quote(string(d.MediaType)), b.mediaType)
		}
	}
	return nil
}
