package v1

// The wire types of the snapshot hub: push and pull to OCI registries,
// pack and unpack to tar files (docs/hub.md), and their transfers.

// RegistryAuth are credentials for a registry, for one request: never
// stored, logged or returned.
type RegistryAuth struct {
	Username string `json:"username"`
	Password string `json:"password"`
}

// PushRequest is the body of POST /v1/snapshots/{tag}/push: send the
// snapshot (and its chain) to Ref, a registry reference with a tag. The
// answer is 202 with an Operation (kind "push").
type PushRequest struct {
	Ref string `json:"ref"`
	// Auth, if set, authenticates; otherwise the daemon's Docker config
	// (and credential helpers) does.
	Auth *RegistryAuth `json:"auth,omitempty"`
	// CAPEM: extra CA certificates (PEM) to trust for this registry.
	CAPEM string `json:"ca_pem,omitempty"`
	// Insecure allows plain HTTP, to a loopback registry only.
	Insecure bool `json:"insecure,omitempty"`
}

// PullRequest is the body of POST /v1/snapshots/pull: fetch the snapshot
// Ref names (by tag or digest), and the links of its chain the daemon
// lacks, as Tag (default: the tag it was pushed from). The answer is 202
// with an Operation (kind "pull") whose Snapshot is the tag once known.
type PullRequest struct {
	Ref      string        `json:"ref"`
	Tag      string        `json:"tag,omitempty"`
	Auth     *RegistryAuth `json:"auth,omitempty"`
	CAPEM    string        `json:"ca_pem,omitempty"`
	Insecure bool          `json:"insecure,omitempty"`
}

// PackRequest is the body of POST /v1/snapshots/{tag}/pack: write the
// snapshot (and its chain) as an OCI image layout in a tar file at Path,
// a new file on the daemon's host (inside its export directory, unless
// the CLI runs the engine itself). 202 with an Operation (kind "pack").
type PackRequest struct {
	Path string `json:"path"`
}

// UnpackRequest is the body of POST /v1/snapshots/unpack: read a snapshot
// from a layout tar file Pack wrote (on the daemon's host, inside its
// import directory unless the CLI runs the engine itself), as Tag. 202
// with an Operation (kind "unpack").
type UnpackRequest struct {
	Path string `json:"path"`
	Tag  string `json:"tag,omitempty"`
}

// Transfer is a push, pull, pack or unpack. Bytes are those of blobs, as
// they travel (compressed).
type Transfer struct {
	Op    string `json:"op"`
	Phase string `json:"phase,omitempty"`
	// Tag is the snapshot; Ref the registry reference or file; Digest
	// the manifest digest of the snapshot's artifact.
	Tag    string         `json:"tag,omitempty"`
	Ref    string         `json:"ref,omitempty"`
	Digest string         `json:"digest,omitempty"`
	Files  []TransferFile `json:"files"`
	// Links are the chain's snapshots, base first; New those a pull made.
	Links []TransferLink `json:"links,omitempty"`
	// BlobBytes is every blob of the artifacts; MovedBytes those sent or
	// fetched; SkippedBytes those the other side had; CachedBytes those
	// a pull found verified in its cache (a pull cut short before).
	BlobBytes    int64 `json:"blob_bytes"`
	MovedBytes   int64 `json:"moved_bytes"`
	SkippedBytes int64 `json:"skipped_bytes"`
	CachedBytes  int64 `json:"cached_bytes,omitempty"`
	Blobs        int   `json:"blobs"`
	BlobsMoved   int   `json:"blobs_moved"`
	// NetSentBytes and NetReceivedBytes are HTTP body bytes on the wire.
	NetSentBytes     int64 `json:"net_sent_bytes,omitempty"`
	NetReceivedBytes int64 `json:"net_received_bytes,omitempty"`
	// MemoryBytes is the snapshot's guest RAM; MemoryDataBytes the pages
	// its memory blobs restore; MemoryBlobBytes their size.
	MemoryBytes     int64   `json:"memory_bytes,omitempty"`
	MemoryDataBytes int64   `json:"memory_data_bytes,omitempty"`
	MemoryBlobBytes int64   `json:"memory_blob_bytes,omitempty"`
	Seconds         float64 `json:"seconds,omitempty"`
}

// TransferFile is one file of a transfer ("memory", "rootfs", "state",
// "kernel", "initrd", "config"; "TAG/memory" for the chain's other
// links). WorkBytes and WorkDoneBytes are what is to be read and
// encoded (push) or fetched (pull): an ETA's measure while TotalBytes,
// learnt as chunks are encoded, still grows.
type TransferFile struct {
	Name          string `json:"name"`
	TotalBytes    int64  `json:"total_bytes"`
	DoneBytes     int64  `json:"done_bytes"`
	SkippedBytes  int64  `json:"skipped_bytes"`
	Blobs         int    `json:"blobs"`
	BlobsDone     int    `json:"blobs_done"`
	WorkBytes     int64  `json:"work_bytes,omitempty"`
	WorkDoneBytes int64  `json:"work_done_bytes,omitempty"`
}

// TransferLink is one snapshot of a transferred chain.
type TransferLink struct {
	Tag    string `json:"tag"`
	Digest string `json:"digest"`
	New    bool   `json:"new,omitempty"`
}
