// Package v1 holds the wire types of forkd's REST API v1: what `forkd
// serve` accepts and returns, and what package client sends and decodes.
// Only types and their documentation live here, no logic.
//
// Conventions: JSON field names are snake_case; times are RFC 3339 in UTC;
// durations are seconds (fields ending in _secs) or milliseconds (_ms).
// Every error is an ErrorResponse with a stable Error.Code (see the Code*
// constants) and the HTTP status that goes with it. Responses only gain
// fields; requests are decoded strictly (an unknown field is an error).
// A field's `doc` tag is its description in the OpenAPI document.
package v1

import "time"

// Version is this API's version, the path prefix of its routes.
const Version = "v1"

// Error codes. They name the errdefs classes and never change.
const (
	CodeNotFound           = "not_found"           // 404
	CodeAlreadyExists      = "already_exists"      // 409
	CodeInvalidArgument    = "invalid_argument"    // 400 (413 for a body over the limit)
	CodeFailedPrecondition = "failed_precondition" // 409
	CodeResourceExhausted  = "resource_exhausted"  // 429
	CodeUnavailable        = "unavailable"         // 503
	CodeNotImplemented     = "not_implemented"     // 501
	CodeUnauthenticated    = "unauthenticated"     // 401
	CodeDeadlineExceeded   = "deadline_exceeded"   // 504
	CodeInternal           = "internal"            // 500
)

// ErrorResponse is the body of every response with a 4xx or 5xx status.
type ErrorResponse struct {
	Error Error `json:"error"`
}

// Error is one error: a stable code and a message for people.
type Error struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// ControllerFile is the file, in the daemon's data dir, where a running
// daemon says where it listens (a ControllerInfo).
const ControllerFile = "controller.json"

// ControllerInfo is the content of ControllerFile.
type ControllerInfo struct {
	Socket string `json:"socket,omitempty"`
	URL    string `json:"url,omitempty"` // http(s)://host:port, when it listens on TCP
	PID    int    `json:"pid"`
}

// Health answers GET /healthz.
type Health struct {
	Status string `json:"status"` // "ok"
}

// VersionInfo answers GET /version.
type VersionInfo struct {
	Version     string `json:"version"`
	APIVersion  string `json:"api_version"`
	Backend     string `json:"backend"`
	Accelerator string `json:"accelerator"`
	// DataDir is the daemon's data directory; the CLI uses it to check
	// that a daemon it found serves the data it was asked about.
	DataDir string `json:"data_dir"`
}

// Snapshot statuses.
const (
	SnapshotWriting = "writing"
	SnapshotReady   = "ready"
	SnapshotFailed  = "failed"
	// SnapshotCorrupt: a tag the daemon cannot use (its metadata is
	// missing, unreadable, invalid or of another format version); Error
	// says why. Getting, forking or creating over it is 409; DELETE
	// removes it.
	SnapshotCorrupt = "corrupt"
)

// Snapshot is a warm snapshot children are forked from.
type Snapshot struct {
	Tag         string    `json:"tag"`
	Status      string    `json:"status"`
	Image       string    `json:"image,omitempty"`
	Backend     string    `json:"backend,omitempty"`
	Accelerator string    `json:"accelerator,omitempty"`
	MemoryMiB   int       `json:"memory_mib,omitempty"`
	VCPUs       int       `json:"vcpus,omitempty"`
	SizeBytes   int64     `json:"size_bytes"`
	Refcount    int       `json:"refcount"` // live sandboxes using it
	Created     time.Time `json:"created,omitzero"`
	Parent      string    `json:"parent,omitempty"`
	Error       string    `json:"error,omitempty"` // why a failed snapshot failed
	// Network: the machine has a NIC, so each child has its own network.
	Network bool `json:"network,omitempty"`
	// Python is the guest's warm interpreter ("" when eval is unavailable).
	Python string `json:"python,omitempty"`
	// Problem says why this daemon cannot fork the snapshot (not ready,
	// files changed, another backend or accelerator, a NIC without root);
	// empty when it can.
	Problem string `json:"problem,omitempty"`
	// Kind is "boot" (built from an image) or "branch" (the state of a
	// running sandbox: Mode full, diff or live, taken from Source, at
	// Depth in its chain).
	Kind   string `json:"kind,omitempty"`
	Mode   string `json:"mode,omitempty"`
	Source string `json:"source,omitempty"`
	Depth  int    `json:"depth,omitempty"`
	// Ephemeral: it belongs to the sandboxes forked from it (fork from a
	// sandbox), and goes with the last of them.
	Ephemeral bool `json:"ephemeral,omitempty"`
	// Origin is where a snapshot pulled from a registry (or unpacked from
	// a layout file) came from; absent for one made here.
	Origin *SnapshotOrigin `json:"origin,omitempty"`
	// DiskSlot: its children can have a writable disk (disk_mib).
	// DiskMiB: it is a branch of a sandbox with a disk of that size,
	// which every child of it gets.
	DiskSlot bool `json:"disk_slot,omitempty"`
	DiskMiB  int  `json:"disk_mib,omitempty"`
}

// SnapshotOrigin is where a snapshot made elsewhere came from.
type SnapshotOrigin struct {
	// Ref is the registry reference pulled, or the layout file unpacked.
	Ref string `json:"ref"`
	// Digest is the manifest digest of its artifact: pull REPO@DIGEST to
	// get exactly this snapshot again.
	Digest string    `json:"digest"`
	Pulled time.Time `json:"pulled,omitzero"`
}

// SnapshotList answers GET /v1/snapshots.
type SnapshotList struct {
	Snapshots []Snapshot `json:"snapshots"`
}

// CreateSnapshotRequest is the body of POST /v1/snapshots: boot Image,
// run the Warmup commands, save it as Tag. The answer is 202 with an
// Operation; Operation.Snapshot names the tag.
type CreateSnapshotRequest struct {
	Tag       string   `json:"tag"`
	Image     string   `json:"image,omitempty"` // default "minimal"
	MemoryMiB int      `json:"memory_mib,omitempty"`
	VCPUs     int      `json:"vcpus,omitempty"`
	Warmup    []string `json:"warmup,omitempty"`
	// Network gives the machine a NIC so that every child gets its own
	// network namespace; absent: on when the daemon can (runs as root).
	Network *bool `json:"network,omitempty"`
	// OCI, if set, imports an OCI image first (forkd from-image) and
	// boots it instead of Image; the image is recorded under Tag.
	OCI *OCISource `json:"oci,omitempty"`
}

// OCISource is an OCI image to import: a registry reference, a docker save
// tarball or an OCI layout path, on the daemon's host.
type OCISource struct {
	Ref string `json:"ref"`
	// Extra Debian/Ubuntu packages to install into the image.
	Extra []string `json:"extra,omitempty"`
	// Preload: Python modules the warm interpreter imports.
	Preload []string `json:"preload,omitempty"`
	// Insecure allows a plain-HTTP registry.
	Insecure bool `json:"insecure,omitempty"`
}

// ExecStdinStream is the Content-Type of an exec/stream request whose body
// is an ExecRequest JSON object followed by the process's raw stdin.
const ExecStdinStream = "application/vnd.forkd.exec-stdin"

// Operation statuses.
const (
	OperationRunning   = "running"
	OperationSucceeded = "succeeded"
	OperationFailed    = "failed"
)

// Operation is long work started by a 202 response; poll GET
// /v1/operations/{id} until Status is not "running". Operations are kept
// on disk: one running when the daemon stopped is reported failed.
type Operation struct {
	ID       string    `json:"id"`
	Kind     string    `json:"kind"` // "create_snapshot", "push", "pull", "pack", "unpack"
	Status   string    `json:"status"`
	Snapshot string    `json:"snapshot,omitempty"`
	Error    *Error    `json:"error,omitempty"`
	Created  time.Time `json:"created"`
	Finished time.Time `json:"finished,omitzero"`
	// Progress holds the operation's latest human progress lines (at most
	// MaxOperationProgress); ProgressLines counts every line it ever
	// reported, so a poller prints the last ProgressLines-(what it saw)
	// lines of Progress as new.
	Progress      []string `json:"progress,omitempty"`
	ProgressLines int      `json:"progress_lines,omitempty"`
	// Transfer is a push, pull, pack or unpack: its progress while it
	// runs, its summary once it ended.
	Transfer *Transfer `json:"transfer,omitempty"`
}

// MaxOperationProgress bounds Operation.Progress.
const MaxOperationProgress = 200

// OperationList answers GET /v1/operations.
type OperationList struct {
	Operations []Operation `json:"operations"`
}

// Egress policy modes of NetworkSpec.Egress.
const (
	EgressAllow     = "allow"
	EgressDeny      = "deny"
	EgressAllowlist = "allowlist"
)

// NetworkSpec is a sandbox's network: its egress policy and published
// ports, enforced in the sandbox's own network namespace (see
// docs/isolation.md). Its snapshot must have been made with a network.
type NetworkSpec struct {
	// Egress is "allow" (default), "deny" or "allowlist".
	Egress string `json:"egress,omitempty"`
	// Allow lists destinations: the only ones in "allowlist" mode,
	// exceptions to the blocked private ranges in "allow" mode.
	Allow []NetworkRule `json:"allow,omitempty"`
	// Publish lists guest TCP ports each sandbox publishes on a host port
	// (create only).
	Publish []int `json:"publish,omitempty"`
}

// SandboxNetwork is a sandbox's own network as it stands.
type SandboxNetwork struct {
	// Address is where the host reaches the guest (every port).
	Address string `json:"address"`
	// Egress and Allow are the current egress policy.
	Egress string        `json:"egress"`
	Allow  []NetworkRule `json:"allow,omitempty"`
	// Ports are the guest ports published on host ports.
	Ports []PublishedPort `json:"ports,omitempty"`
}

// PublishedPort is a guest port reachable on a host port (127.0.0.1 and
// the host's own addresses).
type PublishedPort struct {
	Proto     string `json:"proto"`
	GuestPort int    `json:"guest_port"`
	HostPort  int    `json:"host_port"`
}

// PublishRequest is the body of POST /v1/sandboxes/{id}/ports.
type PublishRequest struct {
	GuestPort int `json:"guest_port"`
}

// NetworkRule allows connections to CIDR, optionally for one protocol
// ("tcp", "udp", "icmp") and some ports ("443", "8000-8100").
type NetworkRule struct {
	CIDR  string   `json:"cidr"`
	Proto string   `json:"proto,omitempty"`
	Ports []string `json:"ports,omitempty"`
}

// CreateSandboxesRequest is the body of POST /v1/sandboxes: fork N
// children of SnapshotTag. The batch is all or nothing unless KeepPartial.
type CreateSandboxesRequest struct {
	SnapshotTag string `json:"snapshot_tag"`
	// N is the number of children: 1 to the daemon's --max-per-request
	// (default 100); 0 or absent means 1.
	N int `json:"n,omitempty" doc:"children to fork: 1 to the daemon's --max-per-request (default 100); 0 or absent means 1"`
	// TimeoutSecs, when positive, kills each sandbox that long after it
	// became ready (see POST /v1/sandboxes/{id}/timeout).
	TimeoutSecs int               `json:"timeout_secs,omitempty"`
	Metadata    map[string]string `json:"metadata,omitempty"`
	// Limits of each sandbox (their fields sit in the request itself).
	Limits
	// Network is the egress policy and published ports of each sandbox;
	// its snapshot must have been made with a network.
	Network *NetworkSpec `json:"network,omitempty"`
	// GuestPIDsLimit caps the processes and threads inside each guest
	// (pids.max of the guest agent's workload cgroup, applied by the agent
	// after restore): 16 to 4194304, or 0 for the guest's default, one
	// task per 512 KiB of its workload's memory, 64 to 4096 (341 in a
	// 256 MiB guest). A fork bomb then fails with EAGAIN. Unlike PIDsLimit
	// (the VMM's host tasks) it needs no root, only a snapshot made with
	// an agent that supports it.
	GuestPIDsLimit int `json:"guest_pids_limit,omitempty"`
	// KeepPartial keeps the children that came up when others failed and
	// reports each failure in Failed.
	KeepPartial bool `json:"keep_partial,omitempty"`
	// DiskMiB gives each sandbox a writable disk of that many MiB that
	// takes the writes to its root file system (/root, /usr, ...) instead
	// of its RAM; /tmp, /run and /dev/shm stay in RAM. A branch carries
	// the disk, copy-on-write, to its children.
	DiskMiB int `json:"disk_mib,omitempty" doc:"a writable disk per sandbox, in MiB: 0 (none: root file system writes live in guest RAM) or 64 to 1048576; needs a snapshot made by a forkd with disk support from an image with a root file system. Children of a branch of a sandbox with a disk get that disk (0 or its size)"`
	// OnUnresponsive is what happens to a sandbox whose agent stops
	// answering (a liveness ping unanswered while calls wait): "keep"
	// marks it "unresponsive" and keeps it for inspection (it turns
	// "running" again if the agent answers), "kill" kills it; empty
	// follows the daemon's --unresponsive.
	OnUnresponsive string `json:"on_unresponsive,omitempty"`
	// IdleFreezeSecs is how long each sandbox may go without a request or
	// inbound traffic before the daemon freezes it (any request wakes it):
	// 1 to 86400 seconds, 0 for the daemon's --idle-freeze, -1 never.
	IdleFreezeSecs int `json:"idle_freeze_secs,omitempty"`
}

// Limits are a sandbox's resource limits; zero fields set none. Each
// needs the controller in charge to run as root.
type Limits struct {
	// MemoryLimitMiB caps the sandbox's host memory (its VMM process,
	// guest pages it wrote included); a sandbox over it is killed and
	// reported "oom". CPUs caps its CPU time in cores; PIDsLimit its VMM's
	// tasks.
	MemoryLimitMiB int     `json:"memory_limit_mib,omitempty"`
	CPUs           float64 `json:"cpus,omitempty"`
	PIDsLimit      int     `json:"pids_limit,omitempty"`
	// IOWeight (1–10000) is the relative disk share; IOReadBps and
	// IOWriteBps cap bytes per second on the data dir's disk.
	IOWeight   int   `json:"io_weight,omitempty"`
	IOReadBps  int64 `json:"io_read_bps,omitempty"`
	IOWriteBps int64 `json:"io_write_bps,omitempty"`
}

// CreateSandboxesResponse answers POST /v1/sandboxes (201).
type CreateSandboxesResponse struct {
	Sandboxes []Sandbox `json:"sandboxes"`
	// Failed lists the children that did not come up (KeepPartial only).
	Failed []ChildFailure `json:"failed,omitempty"`
	WallMS float64        `json:"wall_ms"`
}

// ChildFailure is one child of a batch that failed.
type ChildFailure struct {
	ID    string `json:"id"`
	Error Error  `json:"error"`
}

// Sandbox statuses.
const (
	SandboxStarting = "starting"
	SandboxRunning  = "running"
	// SandboxFrozen is a running sandbox frozen while idle; any request
	// wakes it.
	SandboxFrozen = "frozen"
	SandboxDead   = "dead"
	SandboxOOM    = "oom"
)

// Sandbox is one child VM.
type Sandbox struct {
	ID          string            `json:"id"`
	SnapshotTag string            `json:"snapshot_tag"`
	Status      string            `json:"status"`
	PID         int               `json:"pid"`
	Created     time.Time         `json:"created"`
	ReadyMS     int64             `json:"ready_ms"`
	ExpiresAt   time.Time         `json:"expires_at,omitzero"`
	Metadata    map[string]string `json:"metadata,omitempty"`
	// Limits in force (their fields sit in the sandbox itself).
	Limits
	// Network is the sandbox's own network, when its snapshot has one.
	Network *SandboxNetwork `json:"network,omitempty"`
	// OnUnresponsive is the sandbox's own unresponsive policy ("" follows
	// the daemon's).
	OnUnresponsive string `json:"on_unresponsive,omitempty"`
	// DiskMiB is the size of the sandbox's writable disk (0: none).
	DiskMiB int `json:"disk_mib,omitempty"`
	// IdleFreezeSecs is the sandbox's own idle-freeze time (0 follows the
	// daemon's, -1 never).
	IdleFreezeSecs int `json:"idle_freeze_secs,omitempty"`
}

// SandboxList answers GET /v1/sandboxes. Query parameters filter it:
// snapshot=TAG, metadata=KEY=VALUE (repeatable; all must match) and
// status=S (starting, running, unresponsive, frozen, building, dead or oom;
// parked is accepted but matches nothing, as parked VMMs are never
// listed).
type SandboxList struct {
	Sandboxes []Sandbox `json:"sandboxes"`
}

// SetTimeoutRequest is the body of POST /v1/sandboxes/{id}/timeout: the
// sandbox is killed TimeoutSecs from now; 0 removes the deadline.
type SetTimeoutRequest struct {
	TimeoutSecs int `json:"timeout_secs"`
}

// ExecRequest is the body of POST /v1/sandboxes/{id}/exec and
// .../exec/stream. Exactly one of Args and Shell is set.
type ExecRequest struct {
	Args  []string          `json:"args,omitempty"`
	Shell string            `json:"shell,omitempty"` // run under /bin/sh -c
	Env   map[string]string `json:"env,omitempty"`
	Cwd   string            `json:"cwd,omitempty"`
	User  string            `json:"user,omitempty"`
	// Stdin is given to the process (base64 in JSON); without it the
	// process reads /dev/null.
	Stdin []byte `json:"stdin,omitempty"`
	// StdinStream (exec/stream only, with Content-Type ExecStdinStream):
	// the request body goes on after this JSON object (and one optional
	// newline) with the process's stdin, raw, as the caller produces it;
	// the end of the body closes stdin. The response streams meanwhile.
	StdinStream bool `json:"stdin_stream,omitempty"`
	// TimeoutSecs, when positive, kills the process after that long.
	TimeoutSecs float64 `json:"timeout_secs,omitempty"`
}

// ExecResult answers POST /v1/sandboxes/{id}/exec, and ends a stream.
type ExecResult struct {
	// ExitCode is the exit status, -1 when a signal ended the process.
	ExitCode   int    `json:"exit_code"`
	Signal     string `json:"signal,omitempty"`
	TimedOut   bool   `json:"timed_out,omitempty"`
	DurationMS int64  `json:"duration_ms"`
	// Stdout and Stderr hold the output (buffered exec only), as text
	// when it is valid UTF-8 and in StdoutB64/StderrB64 otherwise.
	Stdout    string `json:"stdout,omitempty"`
	Stderr    string `json:"stderr,omitempty"`
	StdoutB64 []byte `json:"stdout_b64,omitempty"`
	StderrB64 []byte `json:"stderr_b64,omitempty"`
	// Truncated reports that output past the daemon's buffer limit was
	// dropped (use the streamed form for large output).
	Truncated bool `json:"truncated,omitempty"`
}

// Stream event types, one JSON object per line (application/x-ndjson).
const (
	EventStdout = "stdout"
	EventStderr = "stderr"
	EventExit   = "exit"   // Exec set: the process ended; the last line
	EventResult = "result" // Eval set: the code finished; the last line
	EventError  = "error"  // Error set: the call failed; the last line
)

// StreamEvent is one line of a streamed exec or eval. Output is in Data
// when it is valid UTF-8, else in DataB64.
type StreamEvent struct {
	Type    string      `json:"type"`
	Data    string      `json:"data,omitempty"`
	DataB64 []byte      `json:"data_b64,omitempty"`
	Exec    *ExecResult `json:"exec,omitempty"`
	Eval    *EvalResult `json:"eval,omitempty"`
	Error   *Error      `json:"error,omitempty"`
}

// EvalRequest is the body of POST /v1/sandboxes/{id}/eval and
// .../eval/stream: Python run in the sandbox's warm interpreter.
type EvalRequest struct {
	Code        string  `json:"code"`
	TimeoutSecs float64 `json:"timeout_secs,omitempty"`
}

// EvalResult is the outcome of an eval. An exception or timeout of the
// code is reported here with status 200, not as an HTTP error.
type EvalResult struct {
	Value      string     `json:"value,omitempty"` // repr() of the last expression
	Stdout     string     `json:"stdout,omitempty"`
	Stderr     string     `json:"stderr,omitempty"`
	Truncated  bool       `json:"truncated,omitempty"`
	Error      *EvalError `json:"error,omitempty"`
	TimedOut   bool       `json:"timed_out,omitempty"`
	Restarted  bool       `json:"restarted,omitempty"` // the interpreter's state was lost
	DurationMS int64      `json:"duration_ms"`
}

// EvalError is an exception raised by the evaluated code.
type EvalError struct {
	Name      string `json:"name"`
	Message   string `json:"message"`
	Traceback string `json:"traceback,omitempty"`
}

// PingResult answers POST /v1/sandboxes/{id}/ping.
type PingResult struct {
	AgentVersion    string   `json:"agent_version"`
	ProtocolVersion int      `json:"protocol_version"`
	UptimeMS        int64    `json:"uptime_ms"`
	Hostname        string   `json:"hostname,omitempty"`
	Features        []string `json:"features,omitempty"`
	PythonReady     bool     `json:"python_ready,omitempty"`
	// LatencyMS is the daemon's round trip to the guest agent.
	LatencyMS float64 `json:"latency_ms"`
}

// File types in FileInfo.Type.
const (
	FileTypeFile    = "file"
	FileTypeDir     = "dir"
	FileTypeSymlink = "symlink"
	FileTypeOther   = "other"
)

// FileInfo describes one guest path (a final symlink is not followed).
type FileInfo struct {
	Name    string    `json:"name"`
	Path    string    `json:"path"`
	Type    string    `json:"type"`
	Size    int64     `json:"size"`
	Mode    uint32    `json:"mode"`
	ModTime time.Time `json:"mtime"`
	Target  string    `json:"target,omitempty"`
}

// FileList answers GET /v1/sandboxes/{id}/files/list?path=P&depth=D.
type FileList struct {
	Entries []FileInfo `json:"entries"`
}

// WriteFileResult answers PUT /v1/sandboxes/{id}/files?path=P[&mode=0644]
// (the body is the file's content, replaced atomically).
type WriteFileResult struct {
	Path  string `json:"path"`
	Bytes int64  `json:"bytes"`
}

// MakeDirRequest is the body of POST /v1/sandboxes/{id}/files/mkdir.
type MakeDirRequest struct {
	Path string `json:"path"`
}

// MakeDirResult answers it; Created is false when the directory existed.
type MakeDirResult struct {
	Created bool `json:"created"`
}

// RenameRequest is the body of POST /v1/sandboxes/{id}/files/rename.
type RenameRequest struct {
	From string `json:"from"`
	To   string `json:"to"`
}

// Empty is the body of a successful response with nothing to say.
type Empty struct{}

// Branch modes (BranchRequest.Mode).
const (
	BranchFull = "full"
	BranchDiff = "diff"
	BranchLive = "live"
)

// BranchRequest is the body of POST /v1/sandboxes/{id}/branch: snapshot
// the running sandbox into a new snapshot Tag ("" makes one up) that more
// sandboxes fork from. Mode is "full" (stands alone), "diff" (default: a
// layer of the pages that differ from the source's snapshot, chained to
// it) or "live" (the source pauses only to switch over). With Wait false
// the answer is 202 with the snapshot in status "writing"; poll GET
// /v1/snapshots/{tag}.
type BranchRequest struct {
	Tag  string `json:"tag,omitempty"`
	Mode string `json:"mode,omitempty"`
	Wait *bool  `json:"wait,omitempty"` // default true
}

// ForkRequest is the body of POST /v1/sandboxes/{id}/fork: branch the
// running sandbox (Mode, as BranchRequest's) into a snapshot that belongs
// to the new sandboxes, and fork Count of them (default 1) from it, with
// the options of a create request. The snapshot goes when its last
// sandbox does. The answer is a CreateSandboxesResponse.
type ForkRequest struct {
	Count       int               `json:"count,omitempty"`
	Mode        string            `json:"mode,omitempty"`
	TimeoutSecs int               `json:"timeout_secs,omitempty"`
	Metadata    map[string]string `json:"metadata,omitempty"`
	Limits
	Network        *NetworkSpec `json:"network,omitempty"`
	KeepPartial    bool         `json:"keep_partial,omitempty"`
	OnUnresponsive string       `json:"on_unresponsive,omitempty"`
	// DiskMiB is as in CreateSandboxesRequest: the children of a sandbox
	// with a disk get its disk, so it is 0 or that size for them.
	DiskMiB        int `json:"disk_mib,omitempty"`
	IdleFreezeSecs int `json:"idle_freeze_secs,omitempty"`
}

// SnapshotInfo answers GET /v1/snapshots/{tag}/info: the snapshot, its
// place in its chain and what it takes.
type SnapshotInfo struct {
	Snapshot
	// LogicalBytes is the guest RAM size; PhysicalBytes what the
	// snapshot's files take on disk; LayerBytes what its own layer takes.
	LogicalBytes  int64 `json:"logical_bytes"`
	PhysicalBytes int64 `json:"physical_bytes"`
	LayerBytes    int64 `json:"layer_bytes"`
	// Ancestors are the tags above it, parent first; ChainError why the
	// chain stops early (a parent missing or altered).
	Ancestors  []string `json:"ancestors"`
	ChainError string   `json:"chain_error,omitempty"`
	// Dependents are the snapshots made from it.
	Dependents []string `json:"dependents"`
	// For a branch: how long its source paused, how much it had written,
	// and the whole branch's time.
	PauseMS    float64 `json:"pause_ms,omitempty"`
	DirtyBytes int64   `json:"dirty_bytes,omitempty"`
	TotalMS    float64 `json:"total_ms,omitempty"`
	// DiskSwitchMS is the part of the pause the switch of the source's
	// disk took (paused modes of a sandbox with a disk).
	DiskSwitchMS float64 `json:"disk_switch_ms,omitempty"`
}

// CompactRequest is the body of POST /v1/snapshots/{tag}/compact: make
// snapshot To, standing alone, from the snapshot (and its chain).
type CompactRequest struct {
	To string `json:"to"`
}

// Workspace statuses.
const (
	WorkspaceRunning   = "running"
	WorkspaceSuspended = "suspended"
)

// CreateWorkspaceRequest is the body of POST /v1/workspaces: a named,
// long-lived sandbox forked from SnapshotTag, with the options of a
// create request (its n must be 0 or 1).
type CreateWorkspaceRequest struct {
	Name string `json:"name"`
	CreateSandboxesRequest
}

// Workspace is a named, long-lived sandbox. Suspend branches its sandbox
// into a state snapshot and stops it (no CPU, no RAM held); resume forks
// a new sandbox (a new id, the same name) from its latest state. It
// survives daemon restarts.
type Workspace struct {
	Name     string `json:"name"`
	Snapshot string `json:"snapshot"` // what it was created from
	Status   string `json:"status"`   // running or suspended
	// Sandbox is its sandbox while it runs.
	Sandbox string `json:"sandbox,omitempty"`
	// States are the snapshots it was suspended to, oldest first.
	States  []string  `json:"states,omitempty"`
	Created time.Time `json:"created"`
	Updated time.Time `json:"updated"`
}

// WorkspaceList answers GET /v1/workspaces.
type WorkspaceList struct {
	Workspaces []Workspace `json:"workspaces"`
}

// StartProcessRequest is the body of POST /v1/sandboxes/{id}/processes:
// a process run in the background. Stdin, when set, is its whole input;
// with StdinOpen instead its stdin stays open for POST .../stdin.
type StartProcessRequest struct {
	ExecRequest
	StdinOpen bool   `json:"stdin_open,omitempty"`
	Tag       string `json:"tag,omitempty"` // a label, listed with it
}

// Process is a background process of a sandbox. Result is set once it
// has ended (Running false).
type Process struct {
	PID       int         `json:"pid"`
	Tag       string      `json:"tag,omitempty"`
	Args      []string    `json:"args"`
	Cwd       string      `json:"cwd,omitempty"`
	StartedAt time.Time   `json:"started_at,omitzero"`
	Running   bool        `json:"running"`
	Result    *ExecResult `json:"result,omitempty"`
}

// ProcessList answers GET /v1/sandboxes/{id}/processes: the background
// processes, running and recently ended.
type ProcessList struct {
	Processes []Process `json:"processes"`
}

// SignalRequest is the body of POST .../processes/{pid}/signal: a signal
// by name ("SIGTERM", "TERM") or number, sent to the process's group.
type SignalRequest struct {
	Signal string `json:"signal"`
}

// E2BKey is an E2B-format API key the daemon issued (docs/e2b.md): the E2B
// SDKs present it as E2B_API_KEY to the E2B listener. Key is set only in
// the answer to its creation; the daemon keeps its hash alone.
type E2BKey struct {
	ID      string    `json:"id"`
	Name    string    `json:"name,omitempty"`
	Hint    string    `json:"hint"` // first 8 and last 4 characters
	Created time.Time `json:"created"`
	Key     string    `json:"key,omitempty"`
}

// CreateE2BKeyRequest is the body of POST /v1/e2b/keys.
type CreateE2BKeyRequest struct {
	Name string `json:"name,omitempty"`
}

// E2BKeyList answers GET /v1/e2b/keys.
type E2BKeyList struct {
	Keys []E2BKey `json:"keys"`
}
