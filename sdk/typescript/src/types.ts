// Wire types of forkd's REST API v1, mirroring api/v1/types.go field for
// field (JSON names are snake_case; times are RFC 3339 strings; Go []byte
// fields are base64 strings). The daemon's responses only gain fields, so
// every interface here may carry more than it declares.

/** The API version, the path prefix of its routes. */
export const API_VERSION = 'v1'

/** Error codes: they name the daemon's error classes and never change. */
export const ErrorCode = {
  NotFound: 'not_found',
  AlreadyExists: 'already_exists',
  InvalidArgument: 'invalid_argument',
  FailedPrecondition: 'failed_precondition',
  ResourceExhausted: 'resource_exhausted',
  Unavailable: 'unavailable',
  NotImplemented: 'not_implemented',
  Unauthenticated: 'unauthenticated',
  DeadlineExceeded: 'deadline_exceeded',
  Internal: 'internal',
} as const
export type ErrorCode = (typeof ErrorCode)[keyof typeof ErrorCode]

/** The body of every response with a 4xx or 5xx status. */
export interface ErrorResponse {
  error: ApiErrorBody
}

/** One error: a stable code and a message for people. */
export interface ApiErrorBody {
  code: string
  message: string
}

/** The content of `<data>/controller.json`: where a running daemon listens. */
export interface ControllerInfo {
  socket?: string
  url?: string
  pid: number
}

/** Answers GET /healthz. */
export interface Health {
  status: string
}

/** Answers GET /version. */
export interface VersionInfo {
  version: string
  api_version: string
  backend: string
  accelerator: string
  data_dir: string
}

export type SnapshotStatus = 'writing' | 'ready' | 'failed' | 'corrupt'

/** A warm snapshot children are forked from. */
export interface Snapshot {
  tag: string
  status: SnapshotStatus | string
  image?: string
  backend?: string
  accelerator?: string
  memory_mib?: number
  vcpus?: number
  size_bytes: number
  /** Live sandboxes using it. */
  refcount: number
  created?: string
  parent?: string
  /** Why a failed snapshot failed. */
  error?: string
  network?: boolean
  /** The guest's warm interpreter ("" or absent when eval is unavailable). */
  python?: string
  /** Why this daemon cannot fork the snapshot; absent when it can. */
  problem?: string
  /** "boot" (built from an image) or "branch" (the state of a running sandbox). */
  kind?: string
  mode?: string
  source?: string
  depth?: number
  /** It belongs to the sandboxes forked from it and goes with the last of them. */
  ephemeral?: boolean
}

export interface SnapshotList {
  snapshots: Snapshot[]
}

/** The body of POST /v1/snapshots (answered 202 with an Operation). */
export interface CreateSnapshotRequest {
  tag: string
  /** Default "minimal". */
  image?: string
  memory_mib?: number
  vcpus?: number
  warmup?: string[]
  network?: boolean
  oci?: OCISource
}

export interface OCISource {
  ref: string
  extra?: string[]
  preload?: string[]
  insecure?: boolean
}

/** Content-Type of an exec/stream request whose body streams stdin. */
export const EXEC_STDIN_STREAM = 'application/vnd.forkd.exec-stdin'

export type OperationStatus = 'running' | 'succeeded' | 'failed'

/** Long work started by a 202 response. */
export interface Operation {
  id: string
  kind: string
  status: OperationStatus | string
  snapshot?: string
  error?: ApiErrorBody
  created: string
  finished?: string
  /** The latest (at most 200) human progress lines. */
  progress?: string[]
  /** Every progress line ever reported, counted. */
  progress_lines?: number
}

export interface OperationList {
  operations: Operation[]
}

export type Egress = 'allow' | 'deny' | 'allowlist'

/** A sandbox's egress policy and published ports. */
export interface NetworkSpec {
  egress?: Egress | string
  allow?: NetworkRule[]
  /** Guest TCP ports each sandbox publishes (create only). */
  publish?: number[]
}

export interface SandboxNetwork {
  address: string
  egress: Egress | string
  allow?: NetworkRule[]
  ports?: PublishedPort[]
}

export interface PublishedPort {
  proto: string
  guest_port: number
  host_port: number
}

export interface PublishRequest {
  guest_port: number
}

export interface NetworkRule {
  cidr: string
  proto?: string
  ports?: string[]
}

/** A sandbox's resource limits; absent fields set none. */
export interface Limits {
  memory_limit_mib?: number
  cpus?: number
  pids_limit?: number
  io_weight?: number
  io_read_bps?: number
  io_write_bps?: number
}

/** The body of POST /v1/sandboxes. */
export interface CreateSandboxesRequest extends Limits {
  snapshot_tag: string
  /** 1 to the daemon's --max-per-request; 0 or absent means 1. */
  n?: number
  timeout_secs?: number
  metadata?: Record<string, string>
  network?: NetworkSpec
  guest_pids_limit?: number
  keep_partial?: boolean
  /** "keep" or "kill"; absent follows the daemon's --unresponsive. */
  on_unresponsive?: string
  /** A writable disk per sandbox for its root file system, 64 to 1048576 MiB. */
  disk_mib?: number
  /** Idle seconds before the daemon freezes each (any call wakes it): 1 to 86400, -1 never; absent: the daemon's. */
  idle_freeze_secs?: number
}

export interface CreateSandboxesResponse {
  sandboxes: Sandbox[]
  failed?: ChildFailure[]
  wall_ms: number
}

export interface ChildFailure {
  id: string
  error: ApiErrorBody
}

export type SandboxStatus = 'starting' | 'running' | 'unresponsive' | 'frozen' | 'building' | 'dead' | 'oom'

/** One child VM. */
export interface Sandbox extends Limits {
  id: string
  snapshot_tag: string
  status: SandboxStatus | string
  pid: number
  created: string
  ready_ms: number
  expires_at?: string
  metadata?: Record<string, string>
  network?: SandboxNetwork
  on_unresponsive?: string
  /** Its writable disk (absent: none). */
  disk_mib?: number
  /** Its own idle time before a freeze (absent: the daemon's; -1 never). */
  idle_freeze_secs?: number
}

export interface SandboxList {
  sandboxes: Sandbox[]
}

export interface SetTimeoutRequest {
  timeout_secs: number
}

/** The body of POST …/exec and …/exec/stream: exactly one of args and shell. */
export interface ExecRequest {
  args?: string[]
  /** Run under /bin/sh -c. */
  shell?: string
  env?: Record<string, string>
  cwd?: string
  user?: string
  /** The process's whole stdin, base64. */
  stdin?: string
  /** exec/stream only, with Content-Type EXEC_STDIN_STREAM. */
  stdin_stream?: boolean
  timeout_secs?: number
}

/** Answers POST …/exec, and ends a stream. */
export interface ExecResult {
  /** -1 when a signal ended the process. */
  exit_code: number
  signal?: string
  timed_out?: boolean
  duration_ms: number
  stdout?: string
  stderr?: string
  /** Output that is not valid UTF-8, base64. */
  stdout_b64?: string
  stderr_b64?: string
  truncated?: boolean
}

export type StreamEventType = 'stdout' | 'stderr' | 'exit' | 'result' | 'error'

/** One NDJSON line of a streamed exec, eval or process. */
export interface StreamEvent {
  type: StreamEventType | string
  data?: string
  /** Output that is not valid UTF-8, base64. */
  data_b64?: string
  exec?: ExecResult
  eval?: EvalResult
  error?: ApiErrorBody
}

export interface EvalRequest {
  code: string
  timeout_secs?: number
}

/** The outcome of an eval; an exception of the code is reported here (200). */
export interface EvalResult {
  /** repr() of the last expression. */
  value?: string
  stdout?: string
  stderr?: string
  truncated?: boolean
  error?: EvalError
  timed_out?: boolean
  /** The interpreter's state was lost. */
  restarted?: boolean
  duration_ms: number
}

export interface EvalError {
  name: string
  message: string
  traceback?: string
}

export interface PingResult {
  agent_version: string
  protocol_version: number
  uptime_ms: number
  hostname?: string
  features?: string[]
  python_ready?: boolean
  latency_ms: number
}

export type FileType = 'file' | 'dir' | 'symlink' | 'other'

/** One guest path (a final symlink is not followed). */
export interface FileInfo {
  name: string
  path: string
  type: FileType | string
  size: number
  mode: number
  mtime: string
  target?: string
}

export interface FileList {
  entries: FileInfo[]
}

export interface WriteFileResult {
  path: string
  bytes: number
}

export interface MakeDirRequest {
  path: string
}

export interface MakeDirResult {
  created: boolean
}

export interface RenameRequest {
  from: string
  to: string
}

export type BranchMode = 'full' | 'diff' | 'live'

/** The body of POST …/branch. */
export interface BranchRequest {
  tag?: string
  mode?: BranchMode | string
  /** Default true; false answers 202 with the snapshot writing. */
  wait?: boolean
}

/** The body of POST …/fork: count sandboxes from the running sandbox's state. */
export interface ForkRequest extends Limits {
  count?: number
  mode?: BranchMode | string
  timeout_secs?: number
  metadata?: Record<string, string>
  network?: NetworkSpec
  keep_partial?: boolean
  on_unresponsive?: string
  /** 0 or the source's disk size (its children get its disk). */
  disk_mib?: number
  idle_freeze_secs?: number
}

/** Answers GET /v1/snapshots/{tag}/info. */
export interface SnapshotInfo extends Snapshot {
  logical_bytes: number
  physical_bytes: number
  layer_bytes: number
  ancestors: string[]
  chain_error?: string
  dependents: string[]
  pause_ms?: number
  dirty_bytes?: number
  total_ms?: number
}

export interface CompactRequest {
  to: string
}

/** The body of POST /v1/workspaces. */
export interface CreateWorkspaceRequest extends CreateSandboxesRequest {
  name: string
}

export interface Workspace {
  name: string
  snapshot: string
  status: 'running' | 'suspended' | string
  sandbox?: string
  states?: string[]
  created: string
  updated: string
}

export interface WorkspaceList {
  workspaces: Workspace[]
}

/** The body of POST …/processes: a background process. */
export interface StartProcessRequest extends ExecRequest {
  stdin_open?: boolean
  tag?: string
}

export interface Process {
  pid: number
  tag?: string
  args: string[]
  cwd?: string
  started_at?: string
  running: boolean
  result?: ExecResult
}

export interface ProcessList {
  processes: Process[]
}

export interface SignalRequest {
  signal: string
}
