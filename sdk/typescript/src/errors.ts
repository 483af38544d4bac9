// Errors: one class per API error code, all under ForkdError. The daemon's
// answer `{"error":{"code","message"}}` becomes an instance of the class of
// its code with the HTTP status kept; errors the SDK finds itself (a
// connection that fails, a command that exits non-zero) use the same
// classes with status 0.

import type { ErrorCode } from './types.js'

/** The base of every error this SDK throws. */
export class ForkdError extends Error {
  /** The API error code (`not_found`, …) or an SDK one (`command_exit`). */
  readonly code: string
  /** The HTTP status of the answer; 0 when no answer said so. */
  readonly status: number

  constructor(message: string, code = 'unknown', status = 0, options?: { cause?: unknown }) {
    super(message, options)
    this.name = new.target.name
    this.code = code
    this.status = status
  }
}

/** The constructor of every class below: a message, the status, a cause. */
type ErrorClass = new (message: string, status?: number, options?: { cause?: unknown }) => ForkdError

/**
 * classOf returns the base of the class of an API error code: a ForkdError
 * with that code and, unless the constructor is given one, that status.
 * Each class below extends one, named and documented in its own right.
 */
function classOf(code: ErrorCode, defaultStatus: number): ErrorClass {
  return class extends ForkdError {
    constructor(message: string, status = defaultStatus, options?: { cause?: unknown }) {
      super(message, code, status, options)
    }
  }
}

/** 404: the sandbox, snapshot, path, process, … does not exist. */
export class NotFoundError extends classOf('not_found', 404) {}

/** 409: the thing to create exists already. */
export class AlreadyExistsError extends classOf('already_exists', 409) {}

/** 400 (413 for a body over the limit, 415 for a body that is not JSON). */
export class InvalidArgumentError extends classOf('invalid_argument', 400) {}

/** 409: the state forbids it (a snapshot in use, a sandbox still starting). */
export class FailedPreconditionError extends classOf('failed_precondition', 409) {}

/** 429: a limit is reached (sandboxes, pending restores, ports, body bytes). */
export class ResourceExhaustedError extends classOf('resource_exhausted', 429) {}

/** 503, or no answer at all (status 0): the daemon or a guest agent is unreachable. */
export class UnavailableError extends classOf('unavailable', 503) {}

/** 501: not available here (eval in an image without Python, …). */
export class NotImplementedError extends classOf('not_implemented', 501) {}

/** 401: no token, or a wrong one. */
export class UnauthenticatedError extends classOf('unauthenticated', 401) {}

/** 504 (408 for a request body that stalled), or a command or code that timed out (status 0). */
export class DeadlineExceededError extends classOf('deadline_exceeded', 504) {}

/** 500: a bug or an unexpected failure in the daemon. */
export class InternalError extends classOf('internal', 500) {}

/** E2B's names for the same classes. */
export const SandboxError = ForkdError
export type SandboxError = ForkdError
export const TimeoutError = DeadlineExceededError
export type TimeoutError = DeadlineExceededError
export const RateLimitError = ResourceExhaustedError
export type RateLimitError = ResourceExhaustedError
export const AuthenticationError = UnauthenticatedError
export type AuthenticationError = UnauthenticatedError

const byCode: Record<ErrorCode, ErrorClass> = {
  not_found: NotFoundError,
  already_exists: AlreadyExistsError,
  invalid_argument: InvalidArgumentError,
  failed_precondition: FailedPreconditionError,
  resource_exhausted: ResourceExhaustedError,
  unavailable: UnavailableError,
  not_implemented: NotImplementedError,
  unauthenticated: UnauthenticatedError,
  deadline_exceeded: DeadlineExceededError,
  internal: InternalError,
}

// The class a status implies when an answer carries no code (a proxy's
// page, say).
const byStatus: Record<number, ErrorClass> = {
  400: InvalidArgumentError,
  401: UnauthenticatedError,
  404: NotFoundError,
  408: DeadlineExceededError,
  409: FailedPreconditionError,
  413: InvalidArgumentError,
  415: InvalidArgumentError,
  429: ResourceExhaustedError,
  500: InternalError,
  501: NotImplementedError,
  503: UnavailableError,
  504: DeadlineExceededError,
}

/**
 * fromCode returns the error of an API error code; an unknown code gives a
 * plain ForkdError carrying it. Without status, the one the code maps to.
 */
export function fromCode(code: string, message: string, status?: number): ForkdError {
  const cls = (byCode as Record<string, ErrorClass | undefined>)[code]
  if (cls) return new cls(message, status)
  return new ForkdError(message, code || 'unknown', status ?? 0)
}

/** fromResponse turns an error answer's status and body text into an error. */
export function fromResponse(status: number, statusText: string, body: string): ForkdError {
  try {
    const parsed = JSON.parse(body) as { error?: { code?: unknown; message?: unknown } }
    const e = parsed?.error
    if (e && typeof e.code === 'string' && e.code !== '') {
      return fromCode(e.code, typeof e.message === 'string' ? e.message : statusText, status)
    }
  } catch {
    // not JSON: fall through
  }
  const msg = `forkd daemon: ${status} ${statusText}${body.trim() ? ': ' + body.trim().slice(0, 512) : ''}`
  const cls = byStatus[status]
  return cls ? new cls(msg, status) : new ForkdError(msg, 'unknown', status)
}

/** The result of a command, as carried by CommandExitError. */
export interface CommandResultLike {
  exitCode: number
  stdout: string
  stderr: string
  error?: string
}

/** A command that exited non-zero (or was killed by a signal). */
export class CommandExitError extends ForkdError implements CommandResultLike {
  readonly result: CommandResultLike

  constructor(result: CommandResultLike) {
    super(result.error ?? `exit status ${result.exitCode}`, 'command_exit', 0)
    this.result = result
  }

  get exitCode(): number {
    return this.result.exitCode
  }
  get stdout(): string {
    return this.result.stdout
  }
  get stderr(): string {
    return this.result.stderr
  }
  get error(): string | undefined {
    return this.result.error
  }
}
