// runCode's results, shaped like E2B's code interpreter (Execution,
// Result, ExecutionError, OutputMessage), made from forkd's eval, which
// runs Python in the sandbox's warm interpreter: state is kept across
// calls.

import type { EvalResult } from './types.js'

/** One chunk of output. */
export class OutputMessage {
  constructor(
    /** The text. */
    readonly line: string,
    /** Unix epoch in nanoseconds (when the SDK received it). */
    readonly timestamp: number,
    /** Whether it came on stderr. */
    readonly error: boolean,
  ) {}

  toString(): string {
    return this.line
  }
}

/** An exception raised by the code. */
export class ExecutionError {
  constructor(
    readonly name: string,
    /** The exception's message (E2B calls it value). */
    readonly value: string,
    /** The formatted traceback. */
    readonly traceback: string,
  ) {}
}

/** A result of the code: the value of its last expression, as repr() text. */
export class Result {
  readonly text?: string
  readonly raw: Record<string, unknown>

  constructor(
    raw: { text?: string } & Record<string, unknown>,
    readonly isMainResult: boolean,
  ) {
    this.raw = { ...raw }
    if (raw.text !== undefined) this.text = raw.text
  }

  /** The formats this result has besides text (none: eval gives text). */
  formats(): string[] {
    return Object.keys(this.raw).filter((k) => k !== 'text')
  }

  toJSON(): Record<string, unknown> {
    return { text: this.text }
  }
}

/** What the code printed, chunk by chunk. */
export interface Logs {
  stdout: string[]
  stderr: string[]
}

/** The outcome of runCode. */
export class Execution {
  constructor(
    /** The value of the last expression, when it has one (not None). */
    public results: Result[] = [],
    public logs: Logs = { stdout: [], stderr: [] },
    /** The exception the code raised, if any (not thrown). */
    public error?: ExecutionError,
    public executionCount?: number,
    /** The interpreter had been restarted: earlier state was lost. */
    public restarted = false,
    /** Output past the daemon's limit was dropped. */
    public truncated = false,
    public durationMs = 0,
  ) {}

  /** The text of the main result. */
  get text(): string | undefined {
    return this.results.find((r) => r.isMainResult)?.text
  }

  toJSON(): Record<string, unknown> {
    return { results: this.results, logs: this.logs, error: this.error }
  }
}

/** toExecution maps an eval result; logs are the chunks given, else the buffered output. */
export function toExecution(r: EvalResult, logs?: Logs): Execution {
  const results = r.value !== undefined && r.value !== '' ? [new Result({ text: r.value }, true)] : []
  const l = logs ?? { stdout: r.stdout ? [r.stdout] : [], stderr: r.stderr ? [r.stderr] : [] }
  const err = r.error ? new ExecutionError(r.error.name, r.error.message, r.error.traceback ?? '') : undefined
  return new Execution(results, l, err, undefined, !!r.restarted, !!r.truncated, r.duration_ms)
}
