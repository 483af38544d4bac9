// Sandbox: the surface of E2B's JS SDK (camelCase) over a Controller.

import { OutputMessage, toExecution, type Execution, type ExecutionError, type Logs, type Result } from './code.js'
import { Commands } from './commands.js'
import { Controller, eventBytes, type ControllerOptions } from './controller.js'
import { DeadlineExceededError, InvalidArgumentError, NotFoundError, NotImplementedError, UnavailableError } from './errors.js'
import { Filesystem } from './filesystem.js'
import type {
  BranchMode,
  CreateSandboxesRequest,
  EvalResult,
  Limits,
  NetworkSpec,
  PingResult,
  Sandbox as WireSandbox,
  SandboxNetwork,
  Snapshot,
} from './types.js'

/** The default lifetime of a sandbox, as in E2B: 300 s (timeoutMs 0: none). */
export const DEFAULT_SANDBOX_TIMEOUT_MS = 300_000

/** The default timeout of runCode, as in E2B: 60 s (0: none). */
export const DEFAULT_CODE_TIMEOUT_MS = 60_000

/** The default template (snapshot tag), as in E2B. */
export const DEFAULT_TEMPLATE = 'base'

/** Options of one request. */
export interface SandboxRequestOpts {
  signal?: AbortSignal
}

/** How to reach the daemon: a Controller to share, or options to make one. */
export interface SandboxConnectionOpts extends ControllerOptions, SandboxRequestOpts {
  /** Use this controller (it is not closed with the sandbox). */
  controller?: Controller
}

/** Options of Sandbox.create. */
export interface SandboxOpts extends SandboxConnectionOpts {
  /** The snapshot tag to fork from; default "base". */
  template?: string
  /** Kill the sandbox this long after it is ready; default 300 000 (5 min); 0: never. */
  timeoutMs?: number
  /** The same in seconds (timeoutMs wins). */
  timeout?: number
  metadata?: Record<string, string>
  /** Environment of every command this object runs (kept by the SDK, not the daemon). */
  envs?: Record<string, string>
  /** Egress policy and published ports (a snapshot with a network). */
  network?: NetworkSpec
  /** Resource limits (the daemon must run as root). */
  limits?: Limits
  /** Caps the processes inside the guest. */
  guestPidsLimit?: number
  /** What to do when its agent stops answering: keep (default) or kill. */
  onUnresponsive?: 'keep' | 'kill'
  /** A writable disk for its root file system, 64 to 1048576 MiB (default: none, writes live in guest RAM). */
  diskMiB?: number
  /** Idle seconds before the daemon freezes it (any call wakes it): 1 to 86400, -1 never; default: the daemon's. */
  idleFreezeSecs?: number
}

/** A sandbox as listed or described. */
export interface SandboxInfo {
  sandboxId: string
  /** The snapshot it was forked from. */
  templateId: string
  /** starting, running, unresponsive, frozen (idle, woken by the next call), dead, oom. */
  state: string
  startedAt: Date
  /** When the daemon kills it, if ever. */
  endAt?: Date
  metadata: Record<string, string>
  /** The VMM's host pid. */
  pid: number
  /** How long it took to be ready. */
  readyMs: number
  network?: SandboxNetwork
}

/** A snapshot, as branch returns it. */
export interface SnapshotDetails {
  tag: string
  status: string
  image?: string
  /** "boot" or "branch". */
  kind?: string
  /** full, diff or live. */
  mode?: string
  /** The sandbox it was branched from. */
  source?: string
  /** The snapshot below it in its chain. */
  parent?: string
  depth?: number
  sizeBytes: number
  refcount: number
  createdAt?: Date
  ephemeral?: boolean
  python?: string
  problem?: string
  error?: string
}

/** Options of runCode, E2B's code interpreter's. */
export interface RunCodeOpts extends SandboxRequestOpts {
  /** Only "python" (the warm interpreter). */
  language?: string
  onStdout?: (msg: OutputMessage) => void | Promise<void>
  onStderr?: (msg: OutputMessage) => void | Promise<void>
  onResult?: (r: Result) => void | Promise<void>
  onError?: (e: ExecutionError) => void | Promise<void>
  /** Interrupt the code after this long; default 60 s; 0: none. */
  timeoutMs?: number
  /** Not supported: eval has no per-call environment (throws NotImplementedError). */
  envs?: Record<string, string>
}

/** The outcome of sbx.eval (forkd's own: the repr of the last expression). */
export interface EvalOutcome {
  value?: string
  stdout: string
  stderr: string
  error?: { name: string; message: string; traceback?: string }
  timedOut: boolean
  restarted: boolean
  truncated: boolean
  durationMs: number
}

/** Options of fork. */
export interface ForkOpts extends SandboxRequestOpts {
  count?: number
  /** How the state is taken: diff (default), full or live. */
  mode?: BranchMode
  /** The children's lifetime; default 300 s; 0: none. */
  timeoutMs?: number
  metadata?: Record<string, string>
  network?: NetworkSpec
  limits?: Limits
  /** As SandboxOpts.idleFreezeSecs; the children get this sandbox's disk. */
  idleFreezeSecs?: number
}

/** Options of branch. */
export interface BranchOpts extends SandboxRequestOpts {
  /** The new snapshot's tag (default: made up). */
  tag?: string
  /** diff (default), full or live. */
  mode?: BranchMode
  /** false: return at once with the snapshot writing. */
  wait?: boolean
}

/** wholeOpt returns v when it is absent or an integer; the daemon checks its range. */
function wholeOpt(name: string, v: number | undefined): number | undefined {
  if (v !== undefined && !Number.isSafeInteger(v)) throw new TypeError(`${name} must be an integer, not ${JSON.stringify(v)}`)
  return v
}

function lifetimeSecs(o: { timeoutMs?: number; timeout?: number }): number {
  const ms = o.timeoutMs ?? (o.timeout !== undefined ? o.timeout * 1000 : DEFAULT_SANDBOX_TIMEOUT_MS)
  return ms > 0 ? Math.ceil(ms / 1000) : 0
}

/** toSandboxInfo maps the wire Sandbox. */
export function toSandboxInfo(s: WireSandbox): SandboxInfo {
  const out: SandboxInfo = {
    sandboxId: s.id,
    templateId: s.snapshot_tag,
    state: s.status,
    startedAt: new Date(s.created),
    metadata: s.metadata ?? {},
    pid: s.pid,
    readyMs: s.ready_ms,
  }
  if (s.expires_at) out.endAt = new Date(s.expires_at)
  if (s.network) out.network = s.network
  return out
}

/** toSnapshotDetails maps the wire Snapshot. */
export function toSnapshotDetails(s: Snapshot): SnapshotDetails {
  const out: SnapshotDetails = { tag: s.tag, status: s.status, sizeBytes: s.size_bytes ?? 0, refcount: s.refcount ?? 0 }
  if (s.image) out.image = s.image
  if (s.kind) out.kind = s.kind
  if (s.mode) out.mode = s.mode
  if (s.source) out.source = s.source
  if (s.parent) out.parent = s.parent
  if (s.depth) out.depth = s.depth
  if (s.created) out.createdAt = new Date(s.created)
  if (s.ephemeral) out.ephemeral = true
  if (s.python) out.python = s.python
  if (s.problem) out.problem = s.problem
  if (s.error) out.error = s.error
  return out
}

function controllerFor(o: SandboxConnectionOpts): { ctl: Controller; owned: boolean } {
  if (o.controller) return { ctl: o.controller, owned: false }
  return { ctl: new Controller(o), owned: true }
}

/**
 * Sandbox is one forkd sandbox (a microVM forked from a warm snapshot),
 * with E2B's methods: commands, files, runCode, setTimeout, kill.
 *
 *     const sbx = await Sandbox.create({ template: 'py' })
 *     const r = await sbx.commands.run('echo hi')
 *     await sbx.kill()
 */
export class Sandbox {
  readonly sandboxId: string
  readonly controller: Controller
  readonly commands: Commands
  readonly files: Filesystem
  /** The environment of every command run through this object. */
  envs: Record<string, string>
  private readonly ownsController: boolean

  protected constructor(id: string, ctl: Controller, owned: boolean, envs: Record<string, string> = {}) {
    this.sandboxId = id
    this.controller = ctl
    this.ownsController = owned
    this.envs = { ...envs }
    this.commands = new Commands(id, ctl, () => this.envs)
    this.files = new Filesystem(id, ctl)
  }

  /**
   * create forks a sandbox from a snapshot (the template) and resolves once
   * it is ready.
   */
  static async create(opts?: SandboxOpts): Promise<Sandbox>
  static async create(template: string, opts?: SandboxOpts): Promise<Sandbox>
  static async create(a?: string | SandboxOpts, b?: SandboxOpts): Promise<Sandbox> {
    const o: SandboxOpts = typeof a === 'string' ? { ...(b ?? {}), template: a } : (a ?? {})
    const { ctl, owned } = controllerFor(o)
    try {
      const req: CreateSandboxesRequest = { snapshot_tag: o.template ?? DEFAULT_TEMPLATE, n: 1, ...(o.limits ?? {}) }
      const t = lifetimeSecs(o)
      if (t) req.timeout_secs = t
      if (o.metadata) req.metadata = o.metadata
      if (o.network) req.network = o.network
      if (o.guestPidsLimit) req.guest_pids_limit = o.guestPidsLimit
      if (o.onUnresponsive) req.on_unresponsive = o.onUnresponsive
      const disk = wholeOpt('diskMiB', o.diskMiB)
      if (disk) req.disk_mib = disk
      const idle = wholeOpt('idleFreezeSecs', o.idleFreezeSecs)
      if (idle) req.idle_freeze_secs = idle
      const res = await ctl.createSandboxes(req, { signal: o.signal })
      const s = res.sandboxes[0]
      if (!s) throw new NotFoundError('create answered without a sandbox', 0)
      return new Sandbox(s.id, ctl, owned, o.envs)
    } catch (err) {
      if (owned) ctl.close()
      throw err
    }
  }

  /** connect returns the sandbox with this id (NotFoundError when there is none). */
  static async connect(sandboxId: string, opts: SandboxConnectionOpts & { envs?: Record<string, string> } = {}): Promise<Sandbox> {
    const { ctl, owned } = controllerFor(opts)
    try {
      await ctl.getSandbox(sandboxId, { signal: opts.signal })
    } catch (err) {
      if (owned) ctl.close()
      throw err
    }
    return new Sandbox(sandboxId, ctl, owned, opts.envs)
  }

  /** list lists the sandboxes (filtered by template, state, metadata). */
  static async list(
    opts: SandboxConnectionOpts & { query?: { template?: string; state?: string; metadata?: Record<string, string> } } = {},
  ): Promise<SandboxInfo[]> {
    const { ctl, owned } = controllerFor(opts)
    try {
      const q = opts.query ?? {}
      const l = await ctl.listSandboxes({ signal: opts.signal, snapshot: q.template, status: q.state, metadata: q.metadata })
      return l.map(toSandboxInfo)
    } finally {
      if (owned) ctl.close()
    }
  }

  /** kill kills the sandbox with this id; false when there is none. */
  static async kill(sandboxId: string, opts: SandboxConnectionOpts = {}): Promise<boolean> {
    const { ctl, owned } = controllerFor(opts)
    try {
      await ctl.deleteSandbox(sandboxId, { signal: opts.signal })
      return true
    } catch (err) {
      if (err instanceof NotFoundError) return false
      throw err
    } finally {
      if (owned) ctl.close()
    }
  }

  /**
   * with creates a sandbox, runs fn with it and kills it whatever fn does,
   * returning what fn returns.
   */
  static async with<T>(opts: SandboxOpts | string, fn: (sbx: Sandbox) => T | Promise<T>): Promise<T> {
    const sbx = typeof opts === 'string' ? await Sandbox.create(opts) : await Sandbox.create(opts)
    try {
      return await fn(sbx)
    } finally {
      try {
        await sbx.kill()
      } finally {
        sbx.close()
      }
    }
  }

  /** kill kills this sandbox; false when it was gone already. */
  async kill(opts: SandboxRequestOpts = {}): Promise<boolean> {
    try {
      await this.controller.deleteSandbox(this.sandboxId, opts)
      return true
    } catch (err) {
      if (err instanceof NotFoundError) return false
      throw err
    }
  }

  /** close releases this object's idle connections (when it made its own controller). */
  close(): void {
    if (this.ownsController) this.controller.close()
  }

  /** setTimeout makes the daemon kill the sandbox timeoutMs from now (0: never). */
  async setTimeout(timeoutMs: number, opts: SandboxRequestOpts = {}): Promise<void> {
    await this.controller.setTimeout(this.sandboxId, timeoutMs > 0 ? Math.ceil(timeoutMs / 1000) : 0, opts)
  }

  /** getInfo describes the sandbox. */
  async getInfo(opts: SandboxRequestOpts = {}): Promise<SandboxInfo> {
    return toSandboxInfo(await this.controller.getSandbox(this.sandboxId, opts))
  }

  /** isRunning reports whether the sandbox's agent answers. */
  async isRunning(opts: SandboxRequestOpts = {}): Promise<boolean> {
    try {
      await this.controller.ping(this.sandboxId, opts)
      return true
    } catch (err) {
      if (err instanceof NotFoundError) return false
      throw err
    }
  }

  /** ping round-trips to the sandbox's agent. */
  ping(opts: SandboxRequestOpts = {}): Promise<PingResult> {
    return this.controller.ping(this.sandboxId, opts)
  }

  /**
   * runCode runs Python in the sandbox's warm interpreter (state is kept
   * across calls) and returns results, logs and error like E2B's code
   * interpreter; an exception is returned in error, not thrown. A timeout
   * throws TimeoutError.
   */
  async runCode(code: string, opts: RunCodeOpts = {}): Promise<Execution> {
    if (opts.language && opts.language !== 'python') {
      throw new InvalidArgumentError(`runCode: language ${JSON.stringify(opts.language)}: only python is available`, 0)
    }
    if (opts.envs && Object.keys(opts.envs).length) {
      throw new NotImplementedError('runCode: envs are not supported by forkd eval', 0)
    }
    const timeoutMs = opts.timeoutMs ?? DEFAULT_CODE_TIMEOUT_MS
    const req = { code, ...(timeoutMs > 0 ? { timeout_secs: timeoutMs / 1000 } : {}) }
    let r: EvalResult | undefined
    let logs: Logs | undefined
    if (!opts.onStdout && !opts.onStderr) {
      r = await this.controller.eval(this.sandboxId, req, { signal: opts.signal })
    } else {
      logs = { stdout: [], stderr: [] }
      const outDec = new TextDecoder()
      const errDec = new TextDecoder()
      for await (const ev of this.controller.evalStream(this.sandboxId, req, { signal: opts.signal })) {
        if (ev.type === 'stdout' || ev.type === 'stderr') {
          const isOut = ev.type === 'stdout'
          const s = (isOut ? outDec : errDec).decode(eventBytes(ev), { stream: true })
          if (!s) continue
          ;(isOut ? logs.stdout : logs.stderr).push(s)
          const cb = isOut ? opts.onStdout : opts.onStderr
          if (cb) await cb(new OutputMessage(s, Date.now() * 1_000_000, !isOut))
        } else if (ev.type === 'result' && ev.eval) {
          r = ev.eval
        }
      }
      if (!r) throw new UnavailableError('eval stream ended without a result', 0)
    }
    if (r.timed_out) throw new DeadlineExceededError(`runCode timed out after ${timeoutMs / 1000}s`, 0)
    const exe = toExecution(r, logs)
    for (const res of exe.results) await opts.onResult?.(res)
    if (exe.error) await opts.onError?.(exe.error)
    return exe
  }

  /** eval runs Python in the warm interpreter and returns forkd's own result (the repr of the last expression). */
  async eval(code: string, opts: SandboxRequestOpts & { timeoutMs?: number } = {}): Promise<EvalOutcome> {
    const r = await this.controller.eval(
      this.sandboxId,
      { code, ...(opts.timeoutMs && opts.timeoutMs > 0 ? { timeout_secs: opts.timeoutMs / 1000 } : {}) },
      { signal: opts.signal },
    )
    const out: EvalOutcome = {
      stdout: r.stdout ?? '',
      stderr: r.stderr ?? '',
      timedOut: !!r.timed_out,
      restarted: !!r.restarted,
      truncated: !!r.truncated,
      durationMs: r.duration_ms,
    }
    if (r.value !== undefined) out.value = r.value
    if (r.error) out.error = r.error
    return out
  }

  /** branch snapshots the running sandbox into a new snapshot that more sandboxes fork from. */
  async branch(opts: BranchOpts = {}): Promise<SnapshotDetails> {
    const req: { tag?: string; mode?: string; wait?: boolean } = {}
    if (opts.tag) req.tag = opts.tag
    if (opts.mode) req.mode = opts.mode
    if (opts.wait === false) req.wait = false
    return toSnapshotDetails(await this.controller.branch(this.sandboxId, req, { signal: opts.signal }))
  }

  /**
   * fork forks count sandboxes (default 1) from this sandbox's current
   * state: memory, processes, files, interpreter. The state snapshot
   * belongs to them and goes with the last of them.
   */
  async fork(countOrOpts: number | ForkOpts = 1): Promise<Sandbox[]> {
    const o: ForkOpts = typeof countOrOpts === 'number' ? { count: countOrOpts } : countOrOpts
    const t = lifetimeSecs(o)
    const idle = wholeOpt('idleFreezeSecs', o.idleFreezeSecs)
    const res = await this.controller.forkFrom(
      this.sandboxId,
      {
        count: o.count ?? 1,
        ...(o.limits ?? {}),
        ...(o.mode ? { mode: o.mode } : {}),
        ...(t ? { timeout_secs: t } : {}),
        ...(o.metadata ? { metadata: o.metadata } : {}),
        ...(o.network ? { network: o.network } : {}),
        ...(idle ? { idle_freeze_secs: idle } : {}),
      },
      { signal: o.signal },
    )
    return res.sandboxes.map((s) => new Sandbox(s.id, this.controller, false, this.envs))
  }

  /** publishPort publishes a guest TCP port on a host port of the daemon's host. */
  async publishPort(guestPort: number, opts: SandboxRequestOpts = {}): Promise<{ proto: string; guestPort: number; hostPort: number }> {
    const p = await this.controller.publish(this.sandboxId, guestPort, opts)
    return { proto: p.proto, guestPort: p.guest_port, hostPort: p.host_port }
  }

  /** setNetwork replaces the sandbox's egress policy. */
  async setNetwork(spec: Pick<NetworkSpec, 'egress' | 'allow'>, opts: SandboxRequestOpts = {}): Promise<SandboxInfo> {
    return toSandboxInfo(await this.controller.setNetwork(this.sandboxId, spec, opts))
  }
}
