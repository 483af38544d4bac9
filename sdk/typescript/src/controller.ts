// Controller: every route of forkd's REST API v1, one method each, with the
// wire types of api/v1 (snake_case) in and out. client/client.go is the
// reference for how each call is made.

import { ForkdError, UnavailableError, fromCode } from './errors.js'
import { resolveConnection, type Connection, type ConnectionOptions } from './connection.js'
import {
  HttpClient,
  ndjson,
  readAll,
  toWebStream,
  type BodyData,
  type CallOptions,
  type RawResponse,
  type RetryOptions,
  type Transport,
} from './http.js'
import {
  EXEC_STDIN_STREAM,
  type CreateSandboxesRequest,
  type CreateSandboxesResponse,
  type CreateSnapshotRequest,
  type CreateWorkspaceRequest,
  type EvalRequest,
  type EvalResult,
  type ExecRequest,
  type ExecResult,
  type FileInfo,
  type FileList,
  type ForkRequest,
  type BranchRequest,
  type Health,
  type MakeDirResult,
  type NetworkSpec,
  type Operation,
  type OperationList,
  type PingResult,
  type Process,
  type ProcessList,
  type PublishedPort,
  type Sandbox,
  type SandboxList,
  type Snapshot,
  type SnapshotInfo,
  type SnapshotList,
  type StartProcessRequest,
  type StreamEvent,
  type VersionInfo,
  type Workspace,
  type WorkspaceList,
  type WriteFileResult,
} from './types.js'

/** Options of a Controller: where the daemon is, and retries. */
export interface ControllerOptions extends ConnectionOptions {
  retry?: RetryOptions
  /** A transport to use instead of fetch / node:http (tests). */
  transport?: Transport
}

/** Filters of listSandboxes. */
export interface ListSandboxesOptions extends CallOptions {
  snapshot?: string
  status?: string
  /** All must match. */
  metadata?: Record<string, string>
}

/** Options of waitOperation. */
export interface WaitOptions extends CallOptions {
  /** Called with each progress line the operation reports, in order, once. */
  onProgress?: (line: string) => void
  /** The longest pause between polls; default 1000 ms (the first is 100 ms). */
  maxPollMs?: number
}

/** What deleteSnapshot does with the snapshots made from the one removed. */
export interface DeleteSnapshotOptions extends CallOptions {
  /** Remove them too, recursively. */
  cascade?: boolean
  /** Remove it and leave them (their chain is broken). */
  force?: boolean
}

/**
 * A stream of NDJSON events: iterate it for the events up to and including
 * the last one (`exit` or `result`); an `error` event is thrown as its
 * classed error. Breaking out of the loop closes the connection.
 */
export type EventStream = AsyncGenerator<StreamEvent, void, undefined>

const enc = encodeURIComponent

function sandboxPath(id: string, rest = ''): string {
  return `/v1/sandboxes/${enc(id)}${rest}`
}

function processPath(id: string, pid: number, rest = ''): string {
  return sandboxPath(id, `/processes/${Math.trunc(pid)}${rest}`)
}

function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((res, rej) => {
    if (signal?.aborted) return rej(signal.reason)
    const t = setTimeout(res, ms)
    signal?.addEventListener(
      'abort',
      () => {
        clearTimeout(t)
        rej(signal.reason)
      },
      { once: true },
    )
  })
}

// events reads the NDJSON events of res up to the last one; an error event
// is thrown. The connection is closed when the caller stops early.
async function* events(res: RawResponse, path: string): EventStream {
  let done = false
  try {
    for await (const ev of ndjson<StreamEvent>(res.body)) {
      switch (ev.type) {
        case 'stdout':
        case 'stderr':
          yield ev
          continue
        case 'error':
          done = true
          if (!ev.error) throw new ForkdError(`${path}: error event without error`, 'unknown', res.status)
          // The stream began with 200: the status is the one the code maps to.
          throw fromCode(ev.error.code, ev.error.message)
        default:
          done = true
          yield ev
          return
      }
    }
  } finally {
    if (!done) res.cancel()
  }
  throw new UnavailableError(`${path}: stream ended without a result`, 0)
}

/** The bytes of an output event (data, or data_b64 decoded). */
export function eventBytes(ev: StreamEvent): Uint8Array {
  if (ev.data_b64) return Buffer.from(ev.data_b64, 'base64')
  return Buffer.from(ev.data ?? '', 'utf8')
}

/**
 * Controller is a client of one forkd daemon with a method per REST route.
 * Safe for concurrent use. Call close() when done to drop idle connections.
 */
export class Controller {
  readonly http: HttpClient

  constructor(opts: ControllerOptions = {}) {
    const conn = resolveConnection(opts)
    this.http = new HttpClient(conn, opts.retry, opts.transport)
  }

  /** The resolved connection (URL, socket, token). */
  get connection(): Connection {
    return this.http.conn
  }

  /** close releases idle connections. */
  close(): void {
    this.http.close()
  }

  // --- daemon ---

  /** health checks the daemon is up (no token needed). */
  health(o: CallOptions = {}): Promise<Health> {
    return this.http.json('GET', '/healthz', o)
  }

  version(o: CallOptions = {}): Promise<VersionInfo> {
    return this.http.json('GET', '/version', o)
  }

  /** metrics returns the Prometheus text. */
  async metrics(o: CallOptions = {}): Promise<string> {
    const res = await this.http.request('GET', '/metrics', o)
    return new TextDecoder().decode(await readAll(res.body))
  }

  /** openapi returns the daemon's OpenAPI 3.1 document. */
  openapi(o: CallOptions = {}): Promise<Record<string, unknown>> {
    return this.http.json('GET', '/v1/openapi.json', o)
  }

  // --- snapshots and operations ---

  async listSnapshots(o: CallOptions = {}): Promise<Snapshot[]> {
    return (await this.http.json<SnapshotList>('GET', '/v1/snapshots', o)).snapshots ?? []
  }

  getSnapshot(tag: string, o: CallOptions = {}): Promise<Snapshot> {
    return this.http.json('GET', `/v1/snapshots/${enc(tag)}`, o)
  }

  /** snapshotInfo returns a snapshot's chain and sizes. */
  snapshotInfo(tag: string, o: CallOptions = {}): Promise<SnapshotInfo> {
    return this.http.json('GET', `/v1/snapshots/${enc(tag)}/info`, o)
  }

  /** createSnapshot starts building a snapshot (202); see waitOperation, or buildSnapshot for both. */
  createSnapshot(req: CreateSnapshotRequest, o: CallOptions = {}): Promise<Operation> {
    return this.http.json('POST', '/v1/snapshots', { ...o, json: req })
  }

  /** buildSnapshot creates a snapshot and waits for it; a failed build is thrown. */
  async buildSnapshot(req: CreateSnapshotRequest, o: WaitOptions = {}): Promise<Snapshot> {
    const op = await this.createSnapshot(req, o)
    await this.waitOperation(op.id, o)
    return this.getSnapshot(op.snapshot ?? req.tag, o)
  }

  /** deleteSnapshot removes a snapshot (409 while in use, or with dependents unless cascade or force). */
  async deleteSnapshot(tag: string, o: DeleteSnapshotOptions = {}): Promise<void> {
    await this.http.json('DELETE', `/v1/snapshots/${enc(tag)}`, {
      signal: o.signal,
      query: { cascade: o.cascade ? 'true' : undefined, force: o.force ? 'true' : undefined },
    })
  }

  /** compactSnapshot makes snapshot `to`, standing alone, from tag and its chain. */
  compactSnapshot(tag: string, to: string, o: CallOptions = {}): Promise<Snapshot> {
    return this.http.json('POST', `/v1/snapshots/${enc(tag)}/compact`, { ...o, json: { to } })
  }

  async listOperations(o: CallOptions = {}): Promise<Operation[]> {
    return (await this.http.json<OperationList>('GET', '/v1/operations', o)).operations ?? []
  }

  getOperation(id: string, o: CallOptions = {}): Promise<Operation> {
    return this.http.json('GET', `/v1/operations/${enc(id)}`, o)
  }

  /**
   * waitOperation polls an operation until it ends (100 ms, doubling to a
   * second; back to 100 ms after progress). A failed operation is thrown as
   * its classed error.
   */
  async waitOperation(id: string, o: WaitOptions = {}): Promise<Operation> {
    const maxPoll = o.maxPollMs ?? 1000
    let delay = 100
    let seen = 0
    for (;;) {
      const op = await this.getOperation(id, o)
      const lines = op.progress_lines ?? 0
      if (o.onProgress && lines > seen) {
        const progress = op.progress ?? []
        const fresh = Math.min(lines - seen, progress.length)
        for (const line of progress.slice(progress.length - fresh)) o.onProgress(line)
        seen = lines
        delay = 100
      }
      if (op.status === 'succeeded') return op
      if (op.status === 'failed') {
        if (op.error) throw fromCode(op.error.code, op.error.message)
        throw new ForkdError(`operation ${id} failed`)
      }
      await sleep(delay, o.signal)
      delay = Math.min(delay * 2, maxPoll)
    }
  }

  // --- sandboxes ---

  /** createSandboxes forks req.n sandboxes and returns once they are ready. */
  createSandboxes(req: CreateSandboxesRequest, o: CallOptions = {}): Promise<CreateSandboxesResponse> {
    return this.http.json('POST', '/v1/sandboxes', { ...o, json: req })
  }

  async listSandboxes(o: ListSandboxesOptions = {}): Promise<Sandbox[]> {
    const md = Object.entries(o.metadata ?? {}).map(([k, v]) => `${k}=${v}`)
    const l = await this.http.json<SandboxList>('GET', '/v1/sandboxes', {
      signal: o.signal,
      query: { snapshot: o.snapshot || undefined, status: o.status || undefined, metadata: md.length ? md : undefined },
    })
    return l.sandboxes ?? []
  }

  getSandbox(id: string, o: CallOptions = {}): Promise<Sandbox> {
    return this.http.json('GET', sandboxPath(id), o)
  }

  /** deleteSandbox kills a sandbox (409 while it is still starting). */
  async deleteSandbox(id: string, o: CallOptions = {}): Promise<void> {
    await this.http.json('DELETE', sandboxPath(id), o)
  }

  /** setTimeout makes the daemon kill the sandbox timeoutSecs from now (0: never). */
  setTimeout(id: string, timeoutSecs: number, o: CallOptions = {}): Promise<Sandbox> {
    return this.http.json('POST', sandboxPath(id, '/timeout'), { ...o, json: { timeout_secs: Math.trunc(timeoutSecs) } })
  }

  /** setNetwork replaces the sandbox's egress policy, atomically. */
  setNetwork(id: string, spec: NetworkSpec, o: CallOptions = {}): Promise<Sandbox> {
    return this.http.json('PUT', sandboxPath(id, '/network'), { ...o, json: spec })
  }

  /** publish publishes a guest TCP port on a host port. */
  publish(id: string, guestPort: number, o: CallOptions = {}): Promise<PublishedPort> {
    return this.http.json('POST', sandboxPath(id, '/ports'), { ...o, json: { guest_port: guestPort } })
  }

  /** ping round-trips to the sandbox's agent. */
  ping(id: string, o: CallOptions = {}): Promise<PingResult> {
    return this.http.json('POST', sandboxPath(id, '/ping'), o)
  }

  /** branch snapshots the running sandbox into a new snapshot (with wait false: at once, status writing). */
  branch(id: string, req: BranchRequest = {}, o: CallOptions = {}): Promise<Snapshot> {
    return this.http.json('POST', sandboxPath(id, '/branch'), { ...o, json: req })
  }

  /** forkFrom forks req.count sandboxes from the running sandbox's current state. */
  forkFrom(id: string, req: ForkRequest = {}, o: CallOptions = {}): Promise<CreateSandboxesResponse> {
    return this.http.json('POST', sandboxPath(id, '/fork'), { ...o, json: req })
  }

  // --- exec and eval ---

  /** exec runs a process and returns its buffered output and exit. */
  exec(id: string, req: ExecRequest, o: CallOptions = {}): Promise<ExecResult> {
    return this.http.json('POST', sandboxPath(id, '/exec'), { ...o, json: req })
  }

  /**
   * execStream runs a process and yields its output events as produced,
   * then the `exit` event. With stdin (and not req.stdin) the process reads
   * it as it is produced while its output streams; its end closes stdin.
   */
  async *execStream(id: string, req: ExecRequest, o: CallOptions & { stdin?: BodyData } = {}): EventStream {
    const path = sandboxPath(id, '/exec/stream')
    let res: RawResponse
    if (o.stdin !== undefined) {
      const head = new TextEncoder().encode(JSON.stringify({ ...req, stdin_stream: true }) + '\n')
      res = await this.http.request('POST', path, {
        signal: o.signal,
        body: concatBody(head, o.stdin),
        contentType: EXEC_STDIN_STREAM,
      })
    } else {
      res = await this.http.request('POST', path, { signal: o.signal, json: req })
    }
    yield* events(res, path)
  }

  /** eval runs Python in the sandbox's warm interpreter. */
  eval(id: string, req: EvalRequest, o: CallOptions = {}): Promise<EvalResult> {
    return this.http.json('POST', sandboxPath(id, '/eval'), { ...o, json: req })
  }

  /** evalStream is eval that yields the code's output as it comes, then the `result` event. */
  async *evalStream(id: string, req: EvalRequest, o: CallOptions = {}): EventStream {
    const path = sandboxPath(id, '/eval/stream')
    const res = await this.http.request('POST', path, { signal: o.signal, json: req })
    yield* events(res, path)
  }

  // --- background processes ---

  startProcess(id: string, req: StartProcessRequest, o: CallOptions = {}): Promise<Process> {
    return this.http.json('POST', sandboxPath(id, '/processes'), { ...o, json: req })
  }

  async listProcesses(id: string, o: CallOptions = {}): Promise<Process[]> {
    return (await this.http.json<ProcessList>('GET', sandboxPath(id, '/processes'), o)).processes ?? []
  }

  getProcess(id: string, pid: number, o: CallOptions = {}): Promise<Process> {
    return this.http.json('GET', processPath(id, pid), o)
  }

  /** waitProcess waits for a background process to end. */
  waitProcess(id: string, pid: number, o: CallOptions = {}): Promise<ExecResult> {
    return this.http.json('POST', processPath(id, pid, '/wait'), o)
  }

  /** streamProcess attaches to a background process: recent output, then live output, then `exit`. */
  async *streamProcess(id: string, pid: number, o: CallOptions = {}): EventStream {
    const path = processPath(id, pid, '/stream')
    const res = await this.http.request('GET', path, o)
    yield* events(res, path)
  }

  /** sendStdin writes data to a background process's stdin, closing it after when eof. */
  async sendStdin(id: string, pid: number, data: Uint8Array | string, o: CallOptions & { eof?: boolean } = {}): Promise<void> {
    await this.http.json('POST', processPath(id, pid, '/stdin'), {
      signal: o.signal,
      query: { eof: o.eof ? 'true' : undefined },
      body: data,
      contentType: 'application/octet-stream',
    })
  }

  /** signalProcess sends a signal ("SIGTERM", "TERM" or a number) to a background process's group. */
  async signalProcess(id: string, pid: number, signal: string, o: CallOptions = {}): Promise<void> {
    await this.http.json('POST', processPath(id, pid, '/signal'), { ...o, json: { signal } })
  }

  /** killProcess kills a background process's group (SIGKILL). */
  async killProcess(id: string, pid: number, o: CallOptions = {}): Promise<void> {
    await this.http.json('DELETE', processPath(id, pid), o)
  }

  // --- files ---

  /** readFile returns the guest file's content as a stream of bytes. */
  async readFile(id: string, path: string, o: CallOptions = {}): Promise<ReadableStream<Uint8Array>> {
    const res = await this.http.request('GET', sandboxPath(id, '/files'), { signal: o.signal, query: { path } })
    return toWebStream(res.body, () => res.cancel())
  }

  /** readFileBytes returns the guest file's whole content. */
  async readFileBytes(id: string, path: string, o: CallOptions = {}): Promise<Uint8Array> {
    const res = await this.http.request('GET', sandboxPath(id, '/files'), { signal: o.signal, query: { path } })
    return readAll(res.body)
  }

  /**
   * writeFile replaces the guest file at path with data (streamed when it
   * is a stream), atomically; mode (e.g. 0o644) defaults to keeping an
   * existing file's mode, or 0644.
   */
  writeFile(id: string, path: string, data: BodyData, o: CallOptions & { mode?: number } = {}): Promise<WriteFileResult> {
    return this.http.json('PUT', sandboxPath(id, '/files'), {
      signal: o.signal,
      query: { path, mode: o.mode ? '0' + o.mode.toString(8) : undefined },
      body: data,
      contentType: 'application/octet-stream',
    })
  }

  /** listDir lists a guest directory to depth levels (default 1). */
  async listDir(id: string, path: string, o: CallOptions & { depth?: number } = {}): Promise<FileInfo[]> {
    const l = await this.http.json<FileList>('GET', sandboxPath(id, '/files/list'), {
      signal: o.signal,
      query: { path, depth: o.depth && o.depth > 0 ? o.depth : undefined },
    })
    return l.entries ?? []
  }

  /** stat describes a guest path (a final symlink is not followed). */
  stat(id: string, path: string, o: CallOptions = {}): Promise<FileInfo> {
    return this.http.json('GET', sandboxPath(id, '/files/stat'), { signal: o.signal, query: { path } })
  }

  /** makeDir makes a guest directory and its parents; false when it existed. */
  async makeDir(id: string, path: string, o: CallOptions = {}): Promise<boolean> {
    return (await this.http.json<MakeDirResult>('POST', sandboxPath(id, '/files/mkdir'), { ...o, json: { path } })).created
  }

  /** remove removes a guest path; a non-empty directory needs recursive. */
  async remove(id: string, path: string, o: CallOptions & { recursive?: boolean } = {}): Promise<void> {
    await this.http.json('DELETE', sandboxPath(id, '/files'), {
      signal: o.signal,
      query: { path, recursive: o.recursive ? 'true' : undefined },
    })
  }

  /** rename renames a guest path. */
  async rename(id: string, from: string, to: string, o: CallOptions = {}): Promise<void> {
    await this.http.json('POST', sandboxPath(id, '/files/rename'), { ...o, json: { from, to } })
  }

  // --- workspaces ---

  createWorkspace(req: CreateWorkspaceRequest, o: CallOptions = {}): Promise<Workspace> {
    return this.http.json('POST', '/v1/workspaces', { ...o, json: req })
  }

  async listWorkspaces(o: CallOptions = {}): Promise<Workspace[]> {
    return (await this.http.json<WorkspaceList>('GET', '/v1/workspaces', o)).workspaces ?? []
  }

  getWorkspace(name: string, o: CallOptions = {}): Promise<Workspace> {
    return this.http.json('GET', `/v1/workspaces/${enc(name)}`, o)
  }

  /** suspendWorkspace saves a workspace's state and stops its sandbox. */
  suspendWorkspace(name: string, o: CallOptions = {}): Promise<Workspace> {
    return this.http.json('POST', `/v1/workspaces/${enc(name)}/suspend`, o)
  }

  /** resumeWorkspace starts its sandbox again from its latest state (a new id). */
  resumeWorkspace(name: string, o: CallOptions = {}): Promise<Workspace> {
    return this.http.json('POST', `/v1/workspaces/${enc(name)}/resume`, o)
  }

  /** deleteWorkspace removes a workspace, its sandbox and its state snapshots. */
  async deleteWorkspace(name: string, o: CallOptions = {}): Promise<void> {
    await this.http.json('DELETE', `/v1/workspaces/${enc(name)}`, o)
  }
}

// concatBody is head followed by the bytes of rest.
async function* concatBody(head: Uint8Array, rest: BodyData): AsyncGenerator<Uint8Array> {
  yield head
  if (typeof rest === 'string') {
    yield new TextEncoder().encode(rest)
  } else if (rest instanceof Uint8Array) {
    yield rest
  } else if (rest instanceof ArrayBuffer) {
    yield new Uint8Array(rest)
  } else if (typeof Blob !== 'undefined' && rest instanceof Blob) {
    yield new Uint8Array(await rest.arrayBuffer())
  } else if (typeof (rest as ReadableStream<Uint8Array>).getReader === 'function') {
    const reader = (rest as ReadableStream<Uint8Array>).getReader()
    try {
      for (;;) {
        const { done, value } = await reader.read()
        if (done) return
        yield value
      }
    } finally {
      reader.releaseLock()
    }
  } else {
    for await (const c of rest as AsyncIterable<Uint8Array>) yield typeof c === 'string' ? new TextEncoder().encode(c) : c
  }
}
