// Commands: E2B's `sbx.commands` over forkd's exec, exec/stream and
// background-process routes.

import type { Controller } from './controller.js'
import { eventBytes } from './controller.js'
import { CommandExitError, DeadlineExceededError, FailedPreconditionError, ForkdError, NotFoundError } from './errors.js'
import type { BodyData } from './http.js'
import type { ExecRequest, ExecResult, Process } from './types.js'

/** The default timeout of a foreground command, as in E2B: 60 s (0: none). */
export const DEFAULT_COMMAND_TIMEOUT_MS = 60_000

/** How a command ended. */
export interface CommandResult {
  /** The exit status; -1 when a signal ended it. */
  exitCode: number
  stdout: string
  stderr: string
  /** Why it failed: `exit status N` or `signal: SIGKILL`; absent on success. */
  error?: string
  signal?: string
  timedOut?: boolean
  durationMs?: number
  /** Output past the daemon's buffer limit was dropped (buffered runs; stream it instead). */
  truncated?: boolean
}

/** A command killed at its timeout; result holds what it wrote. */
export class CommandTimeoutError extends DeadlineExceededError {
  constructor(
    message: string,
    readonly result: CommandResult,
  ) {
    super(message, 0)
  }
}

/** Options of one request. */
export interface CommandRequestOpts {
  signal?: AbortSignal
}

/** Options of commands.run, E2B's plus forkd's. */
export interface CommandStartOpts extends CommandRequestOpts {
  /** Return a CommandHandle at once instead of waiting. */
  background?: boolean
  cwd?: string
  user?: string
  /** Merged over the sandbox's envs. */
  envs?: Record<string, string>
  onStdout?: (data: string) => void | Promise<void>
  onStderr?: (data: string) => void | Promise<void>
  /**
   * true keeps stdin open for sendStdin/closeStdin (E2B); a string or bytes
   * is the process's whole stdin.
   */
  stdin?: boolean | string | Uint8Array
  /** Kill the command after this long; default 60 s in the foreground, none in the background; 0: none. */
  timeoutMs?: number
  /** A label listed with a background process. */
  tag?: string
}

/** Options of commands.stream. */
export interface CommandStreamOpts extends CommandRequestOpts {
  cwd?: string
  user?: string
  envs?: Record<string, string>
  /** Stdin, streamed while the output streams (full duplex); its end closes it. */
  stdin?: BodyData | AsyncIterable<string>
  /** Kill the command after this long (default: none). */
  timeoutMs?: number
}

/** One event of commands.stream: output as it comes, then how it ended. */
export type CommandEvent =
  | { type: 'stdout' | 'stderr'; data: string; bytes: Uint8Array }
  | ({ type: 'exit' } & Omit<CommandResult, 'stdout' | 'stderr'>)

/** A background process, as commands.list reports it. */
export interface ProcessInfo {
  pid: number
  tag?: string
  /** The command line (args joined). */
  cmd: string
  args: string[]
  cwd?: string
  startedAt?: Date
  running: boolean
  result?: Omit<CommandResult, 'stdout' | 'stderr'>
}

function decode(text: string | undefined, b64: string | undefined): string {
  if (b64) return new TextDecoder().decode(Buffer.from(b64, 'base64'))
  return text ?? ''
}

/** toResult maps the wire result to a CommandResult with the output given. */
export function toResult(r: ExecResult, stdout: string, stderr: string): CommandResult {
  const out: CommandResult = { exitCode: r.exit_code, stdout, stderr, durationMs: r.duration_ms }
  if (r.signal) out.signal = r.signal
  if (r.timed_out) out.timedOut = true
  if (r.truncated) out.truncated = true
  if (r.signal) out.error = `signal: ${r.signal}`
  else if (r.exit_code !== 0) out.error = `exit status ${r.exit_code}`
  return out
}

// finish throws for a command that timed out or failed, as E2B does.
function finish(res: CommandResult, timeoutMs: number | undefined): CommandResult {
  if (res.timedOut) throw new CommandTimeoutError(`command timed out after ${(timeoutMs ?? 0) / 1000}s`, res)
  if (res.exitCode !== 0) throw new CommandExitError(res)
  return res
}

function secs(ms: number | undefined): number | undefined {
  return ms && ms > 0 ? ms / 1000 : undefined
}

function toBytes(s: string | Uint8Array): Uint8Array {
  return typeof s === 'string' ? new TextEncoder().encode(s) : s
}

async function* encodeStrings(src: AsyncIterable<string | Uint8Array>): AsyncGenerator<Uint8Array> {
  for await (const c of src) yield toBytes(c)
}

/**
 * CommandHandle is a background command: its pid, its output so far (when
 * attached), wait, kill and stdin.
 */
export class CommandHandle {
  private _stdout = ''
  private _stderr = ''
  private result?: CommandResult
  private attached?: Promise<CommandResult>
  private abort = new AbortController()

  constructor(
    readonly pid: number,
    private readonly sandboxId: string,
    private readonly ctl: Controller,
    private readonly onStdout?: (data: string) => void | Promise<void>,
    private readonly onStderr?: (data: string) => void | Promise<void>,
    private readonly timeoutMs?: number,
  ) {
    if (onStdout || onStderr) this.attach().catch(() => {})
  }

  /** Output so far (read while attached: with callbacks, or during wait). */
  get stdout(): string {
    return this._stdout
  }
  get stderr(): string {
    return this._stderr
  }
  /** The exit status once it has ended and been waited for. */
  get exitCode(): number | undefined {
    return this.result?.exitCode
  }
  get error(): string | undefined {
    return this.result?.error
  }

  // attach streams the process's output (recent, then live) until it ends.
  private attach(): Promise<CommandResult> {
    this.attached ??= (async () => {
      const outDec = new TextDecoder()
      const errDec = new TextDecoder()
      for await (const ev of this.ctl.streamProcess(this.sandboxId, this.pid, { signal: this.abort.signal })) {
        if (ev.type === 'stdout' || ev.type === 'stderr') {
          const isOut = ev.type === 'stdout'
          const s = (isOut ? outDec : errDec).decode(eventBytes(ev), { stream: true })
          if (isOut) this._stdout += s
          else this._stderr += s
          const cb = isOut ? this.onStdout : this.onStderr
          if (cb && s) await cb(s)
        } else if (ev.type === 'exit' && ev.exec) {
          this.result = toResult(ev.exec, this._stdout, this._stderr)
          return this.result
        }
      }
      throw new ForkdError(`process ${this.pid}: stream ended without its exit`)
    })()
    return this.attached
  }

  /**
   * wait waits for the command to end and returns its result; a non-zero
   * exit throws CommandExitError, a timeout CommandTimeoutError.
   */
  async wait(): Promise<CommandResult> {
    return finish(await this.attach(), this.timeoutMs)
  }

  /** kill kills the command (SIGKILL to its group); false when it is not there or has ended. */
  kill(): Promise<boolean> {
    return killProcess(this.ctl, this.sandboxId, this.pid)
  }

  /** sendStdin writes to the command's stdin (started with stdin: true). */
  sendStdin(data: string | Uint8Array, opts: CommandRequestOpts = {}): Promise<void> {
    return this.ctl.sendStdin(this.sandboxId, this.pid, data, opts)
  }

  /** closeStdin closes the command's stdin. */
  closeStdin(opts: CommandRequestOpts = {}): Promise<void> {
    return this.ctl.sendStdin(this.sandboxId, this.pid, new Uint8Array(0), { ...opts, eof: true })
  }

  /** disconnect stops reading the output; the command goes on. */
  disconnect(): void {
    this.abort.abort()
  }
}

/** Commands runs processes in one sandbox. */
export class Commands {
  constructor(
    private readonly sandboxId: string,
    private readonly ctl: Controller,
    private readonly envs: () => Record<string, string>,
  ) {}

  private request(cmd: string, o: { cwd?: string; user?: string; envs?: Record<string, string> }, timeoutMs?: number): ExecRequest {
    const req: ExecRequest = { shell: cmd }
    const env = { ...this.envs(), ...(o.envs ?? {}) }
    if (Object.keys(env).length) req.env = env
    if (o.cwd) req.cwd = o.cwd
    if (o.user) req.user = o.user
    const t = secs(timeoutMs)
    if (t) req.timeout_secs = t
    return req
  }

  /**
   * run runs cmd under /bin/sh -c. In the foreground it resolves with the
   * result once the command ends (a non-zero exit throws CommandExitError);
   * with background it resolves with a CommandHandle at once.
   */
  run(cmd: string, opts: CommandStartOpts & { background: true }): Promise<CommandHandle>
  run(cmd: string, opts?: CommandStartOpts & { background?: false }): Promise<CommandResult>
  run(cmd: string, opts?: CommandStartOpts): Promise<CommandHandle | CommandResult>
  async run(cmd: string, opts: CommandStartOpts = {}): Promise<CommandHandle | CommandResult> {
    if (opts.background || opts.stdin === true) {
      const h = await this.start(cmd, opts)
      return opts.background ? h : h.wait()
    }
    const timeoutMs = opts.timeoutMs ?? DEFAULT_COMMAND_TIMEOUT_MS
    const req = this.request(cmd, opts, timeoutMs)
    if (opts.stdin !== undefined && opts.stdin !== false) req.stdin = Buffer.from(toBytes(opts.stdin)).toString('base64')
    if (!opts.onStdout && !opts.onStderr) {
      const r = await this.ctl.exec(this.sandboxId, req, { signal: opts.signal })
      const res = toResult(r, decode(r.stdout, r.stdout_b64), decode(r.stderr, r.stderr_b64))
      return finish(res, timeoutMs)
    }
    let stdout = ''
    let stderr = ''
    const outDec = new TextDecoder()
    const errDec = new TextDecoder()
    for await (const ev of this.ctl.execStream(this.sandboxId, req, { signal: opts.signal })) {
      if (ev.type === 'stdout' || ev.type === 'stderr') {
        const isOut = ev.type === 'stdout'
        const s = (isOut ? outDec : errDec).decode(eventBytes(ev), { stream: true })
        if (isOut) stdout += s
        else stderr += s
        const cb = isOut ? opts.onStdout : opts.onStderr
        if (cb && s) await cb(s)
      } else if (ev.type === 'exit' && ev.exec) {
        return finish(toResult(ev.exec, stdout, stderr), timeoutMs)
      }
    }
    throw new ForkdError('exec stream ended without an exit')
  }

  private async start(cmd: string, opts: CommandStartOpts): Promise<CommandHandle> {
    const req = this.request(cmd, opts, opts.timeoutMs)
    const p = await this.ctl.startProcess(
      this.sandboxId,
      {
        ...req,
        ...(opts.stdin === true ? { stdin_open: true } : {}),
        ...(opts.stdin !== undefined && typeof opts.stdin !== 'boolean' ? { stdin: Buffer.from(toBytes(opts.stdin)).toString('base64') } : {}),
        ...(opts.tag ? { tag: opts.tag } : {}),
      },
      { signal: opts.signal },
    )
    return new CommandHandle(p.pid, this.sandboxId, this.ctl, opts.onStdout, opts.onStderr, opts.timeoutMs)
  }

  /**
   * stream runs cmd and yields its output as it comes, then an `exit`
   * event (a non-zero exit is not thrown here). With stdin, the process
   * reads it as it is produced.
   *
   *     for await (const ev of sbx.commands.stream('make')) { … }
   */
  async *stream(cmd: string, opts: CommandStreamOpts = {}): AsyncGenerator<CommandEvent, void, undefined> {
    const req = this.request(cmd, opts, opts.timeoutMs)
    let stdin: BodyData | undefined
    if (opts.stdin !== undefined) {
      const s = opts.stdin
      stdin =
        typeof s === 'string' || s instanceof Uint8Array || s instanceof ArrayBuffer || (typeof Blob !== 'undefined' && s instanceof Blob)
          ? s
          : typeof (s as ReadableStream).getReader === 'function'
            ? (s as ReadableStream<Uint8Array>)
            : encodeStrings(s as AsyncIterable<string | Uint8Array>)
    }
    const outDec = new TextDecoder()
    const errDec = new TextDecoder()
    for await (const ev of this.ctl.execStream(this.sandboxId, req, { signal: opts.signal, stdin })) {
      if (ev.type === 'stdout' || ev.type === 'stderr') {
        const bytes = eventBytes(ev)
        const data = (ev.type === 'stdout' ? outDec : errDec).decode(bytes, { stream: true })
        yield { type: ev.type, data, bytes }
      } else if (ev.type === 'exit' && ev.exec) {
        const { stdout: _o, stderr: _e, ...rest } = toResult(ev.exec, '', '')
        yield { type: 'exit', ...rest }
        return
      }
    }
  }

  /** list lists the background processes, running and recently ended. */
  async list(opts: CommandRequestOpts = {}): Promise<ProcessInfo[]> {
    return (await this.ctl.listProcesses(this.sandboxId, opts)).map(toProcessInfo)
  }

  /** connect attaches to a background process by pid. */
  async connect(
    pid: number,
    opts: CommandRequestOpts & Pick<CommandStartOpts, 'onStdout' | 'onStderr'> = {},
  ): Promise<CommandHandle> {
    await this.ctl.getProcess(this.sandboxId, pid, opts)
    return new CommandHandle(pid, this.sandboxId, this.ctl, opts.onStdout, opts.onStderr)
  }

  /** kill kills a background process; false when there is none with that pid running. */
  kill(pid: number, opts: CommandRequestOpts = {}): Promise<boolean> {
    return killProcess(this.ctl, this.sandboxId, pid, opts)
  }

  /** sendStdin writes to a background process's stdin. */
  sendStdin(pid: number, data: string | Uint8Array, opts: CommandRequestOpts = {}): Promise<void> {
    return this.ctl.sendStdin(this.sandboxId, pid, data, opts)
  }

  /** closeStdin closes a background process's stdin. */
  closeStdin(pid: number, opts: CommandRequestOpts = {}): Promise<void> {
    return this.ctl.sendStdin(this.sandboxId, pid, new Uint8Array(0), { ...opts, eof: true })
  }
}

// killProcess kills a background process: false when it is not there
// (404) or has ended (409).
async function killProcess(ctl: Controller, id: string, pid: number, opts: CommandRequestOpts = {}): Promise<boolean> {
  try {
    await ctl.killProcess(id, pid, opts)
    return true
  } catch (err) {
    if (err instanceof NotFoundError || err instanceof FailedPreconditionError) return false
    throw err
  }
}

function toProcessInfo(p: Process): ProcessInfo {
  const out: ProcessInfo = { pid: p.pid, cmd: p.args.join(' '), args: p.args, running: p.running }
  if (p.tag) out.tag = p.tag
  if (p.cwd) out.cwd = p.cwd
  if (p.started_at) out.startedAt = new Date(p.started_at)
  if (p.result) {
    const { stdout: _o, stderr: _e, ...rest } = toResult(p.result, '', '')
    out.result = rest
  }
  return out
}
