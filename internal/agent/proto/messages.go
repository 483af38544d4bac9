package proto

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/forkd/forkd/internal/errdefs"
)

// Protocol versions. A host and an agent talk when each one's version is at
// least the other's minimum.
//
// Version 2 adds TypeResend.
const (
	ProtocolVersion    = 2
	MinProtocolVersion = 1
)

// CheckVersions returns a FailedPrecondition error naming both sides'
// versions when they cannot talk, nil otherwise.
func CheckVersions(host, hostMin, agent, agentMin int) error {
	if host < agentMin || agent < hostMin {
		return errdefs.FailedPrecondition(
			"agent protocol mismatch: host speaks v%d (accepts v%d and up), agent speaks v%d (accepts v%d and up)",
			host, hostMin, agent, agentMin)
	}
	return nil
}

// Features an agent may announce in HelloAck and PingResult.
const (
	FeatureExec      = "exec"
	FeatureFiles     = "files"
	FeatureProcesses = "processes"
	FeatureEval      = "eval" // a Python interpreter is configured
	// FeatureLimits: the agent runs its processes in a workload cgroup
	// and applies InitRequest.PIDsLimit.
	FeatureLimits = "limits"
	// FeatureDisk: the agent moves the root's writable layer onto a disk
	// when InitRequest.Disk asks.
	FeatureDisk = "disk"
	// FeaturePTY: exec takes ExecRequest.PTY and OpProcessResize.
	FeaturePTY = "pty"
	// FeatureAttach: exec takes ExecRequest.Attach, and connect
	// ProcessRef.Live.
	FeatureAttach = "attach"
	// FeatureWatch: OpFileWatch.
	FeatureWatch = "watch"
	// FeatureRich: eval takes EvalRequest.Context, Reset, Env, Dir and
	// Rich, and reports EvalResult.Results and Count.
	FeatureRich = "rich"
)

// Operations named in Request.Op.
const (
	OpPing           = "ping"           // nothing → PingResult
	OpInit           = "init"           // InitRequest → nothing
	OpExec           = "exec"           // ExecRequest, stdin data → stdout/stderr data, ExecResult
	OpProcessList    = "processes.list" // nothing → ProcessList
	OpProcessWait    = "processes.wait" // ProcessRef → ExecResult
	OpProcessSignal  = "processes.signal"
	OpProcessKill    = "processes.kill"    // ProcessRef → nothing
	OpProcessConnect = "processes.connect" // ProcessRef → stdout/stderr data, ExecResult
	OpProcessStdin   = "processes.stdin"   // StdinRequest → nothing
	OpProcessResize  = "processes.resize"  // ResizeRequest → nothing
	OpFileRead       = "files.read"        // PathRequest → file data, FileInfo
	OpFileWrite      = "files.write"       // WriteRequest, file data → FileInfo
	OpFileList       = "files.list"        // ListRequest → ListResult
	OpFileStat       = "files.stat"        // PathRequest → FileInfo
	OpFileMkdir      = "files.mkdir"       // PathRequest → MkdirResult
	OpFileRemove     = "files.remove"      // RemoveRequest → nothing
	OpFileRename     = "files.rename"      // RenameRequest → nothing
	OpFileWatch      = "files.watch"       // WatchRequest → "started" event, WatchEvent lines as watch data
	OpEval           = "eval"              // EvalRequest → stdout/stderr data, EvalResult
)

// Hello opens a session (TypeHello). A new nonce starts a new session and
// cancels the previous session's foreground requests; a repeated nonce is
// only acknowledged again.
type Hello struct {
	Version    int    `json:"version"`
	MinVersion int    `json:"min_version"`
	Nonce      string `json:"nonce"`
}

// HelloAck answers a Hello (TypeHelloAck), echoing its nonce. Error is set
// when the agent refuses the session (versions).
type HelloAck struct {
	Version      int      `json:"version"`
	MinVersion   int      `json:"min_version"`
	Nonce        string   `json:"nonce"`
	AgentVersion string   `json:"agent_version"`
	Features     []string `json:"features,omitempty"`
	// Clocksource is the guest kernel's clocksource when the agent
	// answered ("" from agents that do not say); see ClockFollowsHost.
	Clocksource string `json:"clocksource,omitempty"`
	Error       *Error `json:"error,omitempty"`
}

// ClockFollowsHost reports whether a guest whose kernel reads clocksource
// src keeps the right time while its VMM is stopped (SIGSTOP, a cgroup
// freeze): tsc and kvm-clock count the host's TSC, which runs on. A guest
// on jiffies only counts its own timer ticks, and falls behind by as long
// as it was stopped.
func ClockFollowsHost(src string) bool {
	return src == "tsc" || src == "kvm-clock"
}

// Request opens request id (TypeRequest).
type Request struct {
	Op   string          `json:"op"`
	Args json.RawMessage `json:"args,omitempty"`
}

// Result ends request id (TypeResult): either Result or Error is set.
type Result struct {
	Result json.RawMessage `json:"result,omitempty"`
	Error  *Error          `json:"error,omitempty"`
}

// Event reports progress of request id (TypeEvent).
type Event struct {
	// Kind is "started" (PID set) for exec.
	Kind string `json:"kind"`
	PID  int    `json:"pid,omitempty"`
}

// Error is an error on the wire: an errdefs code and a message.
type Error struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// ErrorOf encodes err.
func ErrorOf(err error) *Error {
	return &Error{Code: errdefs.Code(err), Message: err.Error()}
}

// Err decodes e into an error of its errdefs class.
func (e *Error) Err() error { return errdefs.FromCode(e.Code, e.Message) }

// PingResult answers OpPing.
type PingResult struct {
	AgentVersion    string   `json:"agent_version"`
	ProtocolVersion int      `json:"protocol_version"`
	UptimeMS        int64    `json:"uptime_ms"`
	SandboxID       string   `json:"sandbox_id,omitempty"`
	Hostname        string   `json:"hostname,omitempty"`
	Features        []string `json:"features,omitempty"`
	// PythonReady reports whether the warm interpreter is up and has
	// preloaded its modules.
	PythonReady bool `json:"python_ready,omitempty"`
	// Python is the interpreter's state: "" (none configured), "starting"
	// (importing its preload), "ready", "exited" (restarts on the next
	// eval) or "failed: <reason>".
	Python string `json:"python,omitempty"`
}

// InitRequest is sent after first boot and after every restore: set the
// clock, add entropy, take an identity. Empty fields are left alone. The
// agent answers once its warm interpreter, if any, is ready (or failed).
type InitRequest struct {
	Time      time.Time `json:"time,omitzero"`
	Entropy   []byte    `json:"entropy,omitempty"`
	SandboxID string    `json:"sandbox_id,omitempty"`
	Hostname  string    `json:"hostname,omitempty"`
	// PIDsLimit caps the tasks (processes and threads) of everything the
	// agent starts: pids.max of its workload cgroup. 0 applies the
	// agent's default, which it derives from the guest's RAM; agents
	// without FeatureLimits ignore it.
	PIDsLimit int `json:"pids_limit,omitempty"`
	// Disk, when set, moves the root's writable layer from RAM onto a
	// disk, so that files written anywhere on the root file system but
	// in its RAM-backed mounts (/tmp, /run, /dev/shm) go to the disk.
	// The agent answers once they do. Agents without FeatureDisk ignore
	// it.
	Disk *Disk `json:"disk,omitempty"`
}

// Disk is a guest's writable disk: the virtio disk whose serial number is
// Serial, of MiB MiB, holding an ext4 file system. A guest whose root is
// on that disk already (a child of a branch of a sandbox with a disk:
// its memory says so, and its disk holds the same files) keeps it; one
// whose root is on another disk refuses.
type Disk struct {
	Serial string `json:"serial"`
	MiB    int    `json:"mib"`
}

// ExecRequest starts a process. Exactly one of Args and Shell is set; Shell
// runs under /bin/sh -c.
type ExecRequest struct {
	Args  []string          `json:"args,omitempty"`
	Shell string            `json:"shell,omitempty"`
	Env   map[string]string `json:"env,omitempty"`
	Dir   string            `json:"dir,omitempty"`
	// User is a name or numeric uid from the guest's /etc/passwd.
	User string `json:"user,omitempty"`
	// Stdin: for a foreground process the host streams stdin data frames
	// ending with FlagEOF; for a background one stdin stays open for
	// OpProcessStdin. Without it stdin is /dev/null.
	Stdin bool `json:"stdin,omitempty"`
	// Timeout, when positive, kills the process group (nanoseconds on the
	// wire).
	Timeout    time.Duration `json:"timeout_ns,omitempty"`
	Background bool          `json:"background,omitempty"`
	// Tag names a background process for the host's convenience.
	Tag string `json:"tag,omitempty"`
	// Attach, with Background, keeps the call open: after its "started"
	// event it streams the process's output as a foreground exec does
	// (paced by the host's credit) and ends with the process's result.
	// The process is a background process all along: its output also
	// goes to its rings, stdin (with Stdin) is fed by OpProcessStdin, and
	// it lives on, unattached, when the call is cancelled or its session
	// ends.
	Attach bool `json:"attach,omitempty"`
	// PTY, when set, runs the process on a new pseudo-terminal of that
	// size, as the session leader with the terminal as its controlling
	// one: its stdin, stdout and stderr are the terminal, whose output
	// comes as stdout data and whose input is fed as stdin (so Stdin is
	// implied). Background only.
	PTY *PTYSize `json:"pty,omitempty"`
}

// PTYSize is a terminal's size in characters.
type PTYSize struct {
	Cols uint16 `json:"cols"`
	Rows uint16 `json:"rows"`
}

// ResizeRequest resizes the terminal of a process started with a PTY.
type ResizeRequest struct {
	PID int `json:"pid"`
	PTYSize
}

// ExecResult is how a process ended, or, with Running, that a background
// process started.
type ExecResult struct {
	PID int    `json:"pid"`
	Tag string `json:"tag,omitempty"`
	// ExitCode is the exit status, or -1 when a signal ended the process.
	ExitCode int `json:"exit_code"`
	// Signal names the signal that ended the process ("SIGKILL").
	Signal     string `json:"signal,omitempty"`
	TimedOut   bool   `json:"timed_out,omitempty"`
	DurationMS int64  `json:"duration_ms"`
	Running    bool   `json:"running,omitempty"`
}

// ProcessRef names a background process by pid.
type ProcessRef struct {
	PID int `json:"pid"`
	// Live, for OpProcessConnect: stream only output produced from now
	// on, not the recent output the agent kept.
	Live bool `json:"live,omitempty"`
}

// SignalRequest sends a signal, by name ("SIGTERM", "TERM") or number, to a
// background process's group.
type SignalRequest struct {
	PID    int    `json:"pid"`
	Signal string `json:"signal"`
}

// StdinRequest feeds a background process started with Stdin.
type StdinRequest struct {
	PID  int    `json:"pid"`
	Data []byte `json:"data,omitempty"`
	EOF  bool   `json:"eof,omitempty"`
}

// ProcessInfo describes a background process.
type ProcessInfo struct {
	PID       int         `json:"pid"`
	Tag       string      `json:"tag,omitempty"`
	Args      []string    `json:"args"`
	Dir       string      `json:"dir,omitempty"`
	StartedAt time.Time   `json:"started_at"`
	Running   bool        `json:"running"`
	Result    *ExecResult `json:"result,omitempty"`
}

// ProcessList answers OpProcessList.
type ProcessList struct {
	Processes []ProcessInfo `json:"processes"`
}

// PathRequest names one guest path (absolute).
type PathRequest struct {
	Path string `json:"path"`
	// Follow, for OpFileStat: describe a final symlink's target (Target
	// is then the resolved path).
	Follow bool `json:"follow,omitempty"`
	// User, for OpFileMkdir: the directories made belong to this user
	// (a name or uid from the guest's /etc/passwd) and its group.
	User string `json:"user,omitempty"`
}

// WriteRequest opens a file write; file data frames follow, the last one
// with FlagEOF. Mode 0 keeps an existing file's permissions or uses 0644.
type WriteRequest struct {
	Path string `json:"path"`
	Mode uint32 `json:"mode,omitempty"`
	// User, if set, owns a file that did not exist (an existing file
	// keeps its owner) and the parent directories the write makes: a name
	// or uid from the guest's /etc/passwd, with its group.
	User string `json:"user,omitempty"`
}

// ListRequest lists a directory to Depth levels (1 when not positive).
type ListRequest struct {
	Path  string `json:"path"`
	Depth int    `json:"depth,omitempty"`
}

// ListResult answers OpFileList, entries sorted by path.
type ListResult struct {
	Entries []FileInfo `json:"entries"`
}

// MkdirResult answers OpFileMkdir: Created is false when the directory
// already existed.
type MkdirResult struct {
	Created bool `json:"created"`
}

// RemoveRequest removes a path; a non-empty directory needs Recursive.
type RemoveRequest struct {
	Path      string `json:"path"`
	Recursive bool   `json:"recursive,omitempty"`
}

// RenameRequest renames From to To.
type RenameRequest struct {
	From string `json:"from"`
	To   string `json:"to"`
}

// File types in FileInfo.Type.
const (
	FileTypeFile    = "file"
	FileTypeDir     = "dir"
	FileTypeSymlink = "symlink"
	FileTypeOther   = "other"
)

// FileInfo describes one path, without following a final symlink.
type FileInfo struct {
	Name    string    `json:"name"`
	Path    string    `json:"path"`
	Type    string    `json:"type"`
	Size    int64     `json:"size"`
	Mode    uint32    `json:"mode"` // permission bits, setuid/setgid/sticky included
	ModTime time.Time `json:"mtime"`
	Target  string    `json:"target,omitempty"` // symlink target
	// Owner and Group name the file's owner and group from the guest's
	// /etc/passwd and /etc/group (their numbers when not named there).
	Owner string `json:"owner,omitempty"`
	Group string `json:"group,omitempty"`
}

// WatchRequest watches a directory (and with Recursive, the directories
// below it) for changes. The agent answers with a "started" event once
// the watch is set, then one JSON WatchEvent per line as StreamWatch data,
// until the call is cancelled.
type WatchRequest struct {
	Path      string `json:"path"`
	Recursive bool   `json:"recursive,omitempty"`
}

// Watch event operations (WatchEvent.Op).
const (
	WatchCreate   = "create"
	WatchWrite    = "write"
	WatchRemove   = "remove"
	WatchRename   = "rename"
	WatchChmod    = "chmod"
	WatchOverflow = "overflow" // events were lost (Name is empty)
)

// WatchEvent is one change under a watched directory; Name is relative
// to it.
type WatchEvent struct {
	Name string `json:"name"`
	Op   string `json:"op"`
}

// EvalRequest runs Python code in the warm interpreter. Timeout, when
// positive, interrupts the code (nanoseconds on the wire).
type EvalRequest struct {
	Code    string        `json:"code"`
	Timeout time.Duration `json:"timeout_ns,omitempty"`
	// Context names the namespace the code runs in ("" is the
	// interpreter's main one); a new name starts an empty namespace.
	// Reset empties it first (Code may then be empty).
	Context string `json:"context,omitempty"`
	Reset   bool   `json:"reset,omitempty"`
	// Env is set in os.environ while the code runs, then restored; Dir,
	// if set, becomes the working directory first.
	Env map[string]string `json:"env,omitempty"`
	Dir string            `json:"dir,omitempty"`
	// Rich reports Results: the figures the code left or showed (as PNG)
	// and the rich forms of its last expression's value.
	Rich bool `json:"rich,omitempty"`
}

// EvalResult is the outcome of one eval. Errors of the code itself (an
// exception, a timeout) are reported here, not as a call error.
type EvalResult struct {
	// Value is repr() of the final expression; empty when there was none or
	// it was None.
	Value  string `json:"value,omitempty"`
	Stdout string `json:"stdout,omitempty"`
	Stderr string `json:"stderr,omitempty"`
	// Truncated reports that Stdout, Stderr or Value were cut to the agent's
	// limit (everything was still streamed).
	Truncated bool       `json:"truncated,omitempty"`
	Error     *EvalError `json:"error,omitempty"`
	TimedOut  bool       `json:"timed_out,omitempty"`
	// Restarted reports that the interpreter was killed and started again:
	// its state (globals, imports) is lost.
	Restarted  bool  `json:"restarted,omitempty"`
	DurationMS int64 `json:"duration_ms"`
	// Results (EvalRequest.Rich) are what the code displayed, in order,
	// the last expression's value last (Main).
	Results []EvalDisplay `json:"results,omitempty"`
	// Count numbers this eval among those of its context (from 1).
	Count int `json:"count,omitempty"`
}

// EvalDisplay is one thing evaluated code displayed: Formats maps a form
// (text, html, markdown, svg, png, jpeg, pdf, latex, json, javascript) to
// its content, binary forms (png, jpeg, pdf) in base64.
type EvalDisplay struct {
	Formats map[string]string `json:"formats"`
	// Main marks the value of the code's last expression.
	Main bool `json:"main,omitempty"`
}

// EvalError is an exception raised by evaluated code.
type EvalError struct {
	Name      string `json:"name"`
	Message   string `json:"message"`
	Traceback string `json:"traceback,omitempty"`
}

func (e *EvalError) Error() string { return fmt.Sprintf("%s: %s", e.Name, e.Message) }
