// The HTTP layer: two transports (global fetch for TCP, node:http over a
// unix socket), error answers turned into classed errors, retries of
// refused requests, and NDJSON streams.

import * as http from 'node:http'

import { ForkdError, UnavailableError, fromResponse } from './errors.js'
import type { Connection } from './connection.js'

/** A request body: bytes, text, or a stream of bytes (sent as it is produced). */
export type BodyData = Uint8Array | ArrayBuffer | string | Blob | ReadableStream<Uint8Array> | AsyncIterable<Uint8Array>

/** An answer whose body has not been read yet. */
export interface RawResponse {
  status: number
  statusText: string
  header(name: string): string | null
  /** The body, once; iterate it to the end or call cancel. */
  body: AsyncIterable<Uint8Array>
  cancel(): void
}

interface SendOptions {
  method: string
  path: string
  headers: Record<string, string>
  body?: BodyData
  signal?: AbortSignal
}

/** A transport sends one request and resolves once the answer's headers are in. */
export interface Transport {
  send(o: SendOptions): Promise<RawResponse>
  close(): void
}

/** Retries of requests the daemon refused (429, 503). */
export interface RetryOptions {
  /** Retries after the first try; default 3, 0 for none. */
  maxRetries?: number
  /** The first backoff without Retry-After, doubled each time (with jitter); default 250 ms. */
  baseDelayMs?: number
  /** The longest wait: a longer backoff is cut to it, a longer Retry-After is not waited for (the error is thrown); default 30 s. */
  maxDelayMs?: number
  /** Called before each retry. */
  onRetry?: (info: { attempt: number; status: number; delayMs: number; method: string; path: string }) => void
}

function isStreamBody(b: BodyData | undefined): b is ReadableStream<Uint8Array> | AsyncIterable<Uint8Array> {
  if (b == null || typeof b === 'string' || b instanceof Uint8Array || b instanceof ArrayBuffer) return false
  if (typeof Blob !== 'undefined' && b instanceof Blob) return false
  return true
}

// iterateWeb reads a web stream; a reader that stops early cancels it (and
// so closes its connection).
async function* iterateWeb(stream: ReadableStream<Uint8Array>): AsyncGenerator<Uint8Array> {
  const reader = stream.getReader()
  let ended = false
  try {
    for (;;) {
      const { done, value } = await reader.read()
      if (done) {
        ended = true
        return
      }
      if (value) yield value
    }
  } finally {
    if (!ended) await reader.cancel().catch(() => {})
    reader.releaseLock()
  }
}

/** iterate reads a web ReadableStream or an async iterable of bytes. */
export function iterate(src: ReadableStream<Uint8Array> | AsyncIterable<Uint8Array>): AsyncIterable<Uint8Array> {
  if (typeof (src as ReadableStream<Uint8Array>).getReader === 'function') return iterateWeb(src as ReadableStream<Uint8Array>)
  return src as AsyncIterable<Uint8Array>
}

/** toWebStream turns an async iterable of bytes into a web ReadableStream (Node 18 has no ReadableStream.from). */
export function toWebStream(src: AsyncIterable<Uint8Array>, onCancel?: () => void): ReadableStream<Uint8Array> {
  const it = src[Symbol.asyncIterator]()
  return new ReadableStream<Uint8Array>({
    async pull(ctl) {
      const { done, value } = await it.next()
      if (done) ctl.close()
      else ctl.enqueue(value instanceof Uint8Array ? value : new Uint8Array(value))
    },
    async cancel() {
      onCancel?.()
      await it.return?.()
    },
  })
}

function unreachable(conn: Connection, err: unknown): ForkdError {
  const cause = (err as { cause?: { code?: string; message?: string } })?.cause
  const detail = cause?.message ?? (err as Error)?.message ?? String(err)
  return new UnavailableError(`forkd daemon at ${conn.url}: ${detail}`, 0, { cause: err })
}

function isAbort(err: unknown, signal?: AbortSignal): boolean {
  return !!signal?.aborted || (err as Error)?.name === 'AbortError'
}

/** FetchTransport sends over TCP with the global fetch. */
export class FetchTransport implements Transport {
  constructor(
    private readonly conn: Connection,
    private readonly base: string,
  ) {}

  async send(o: SendOptions): Promise<RawResponse> {
    let body: unknown = o.body
    const init: Record<string, unknown> = { method: o.method, headers: o.headers, signal: o.signal }
    if (isStreamBody(o.body)) {
      body = typeof (o.body as ReadableStream).getReader === 'function' ? o.body : toWebStream(o.body as AsyncIterable<Uint8Array>)
      init['duplex'] = 'half'
    }
    if (body !== undefined) init['body'] = body
    let res: Response
    try {
      res = await fetch(this.base + o.path, init as RequestInit)
    } catch (err) {
      if (isAbort(err, o.signal)) throw o.signal?.reason ?? err
      throw unreachable(this.conn, err)
    }
    const stream = res.body
    return {
      status: res.status,
      statusText: res.statusText,
      header: (n) => res.headers.get(n),
      body: stream ? iterateWeb(stream as ReadableStream<Uint8Array>) : (async function* () {})(),
      cancel: () => {
        stream?.cancel().catch(() => {})
      },
    }
  }

  close(): void {}
}

/** SocketTransport sends over a unix socket with node:http. */
export class SocketTransport implements Transport {
  private readonly agent = new http.Agent({ keepAlive: true, maxSockets: 64 })

  constructor(
    private readonly conn: Connection,
    private readonly socketPath: string,
  ) {}

  send(o: SendOptions): Promise<RawResponse> {
    return new Promise<RawResponse>((resolvePromise, reject) => {
      let settled = false
      const fail = (err: unknown) => {
        if (settled) return
        settled = true
        reject(isAbort(err, o.signal) ? (o.signal?.reason ?? err) : unreachable(this.conn, err))
      }
      const req = http.request({
        socketPath: this.socketPath,
        path: o.path,
        method: o.method,
        headers: { host: 'forkd', ...o.headers },
        agent: this.agent,
        signal: o.signal,
      })
      req.on('error', fail)
      req.on('response', (res) => {
        if (settled) {
          res.destroy()
          return
        }
        settled = true
        resolvePromise({
          status: res.statusCode ?? 0,
          statusText: res.statusMessage ?? '',
          header: (n) => {
            const v = res.headers[n.toLowerCase()]
            return v === undefined ? null : Array.isArray(v) ? v.join(', ') : v
          },
          body: (async function* () {
            try {
              for await (const chunk of res) yield chunk as Uint8Array
            } catch (err) {
              if (isAbort(err, o.signal)) throw o.signal?.reason ?? err
              throw new UnavailableError(`stream cut: ${(err as Error).message}`, 0, { cause: err })
            }
            if (!res.complete) throw new UnavailableError('stream cut: the connection closed early', 0)
          })(),
          cancel: () => res.destroy(),
        })
      })
      const b = o.body
      if (b === undefined) {
        req.end()
      } else if (typeof b === 'string' || b instanceof Uint8Array) {
        req.end(b)
      } else if (b instanceof ArrayBuffer) {
        req.end(new Uint8Array(b))
      } else {
        const src = typeof Blob !== 'undefined' && b instanceof Blob ? iterateWeb(b.stream() as ReadableStream<Uint8Array>) : iterate(b as ReadableStream<Uint8Array> | AsyncIterable<Uint8Array>)
        pump(req, src).catch((err) => req.destroy(err as Error))
      }
    })
  }

  close(): void {
    this.agent.destroy()
  }
}

// pump writes src into req with back-pressure, then ends it.
async function pump(req: http.ClientRequest, src: AsyncIterable<Uint8Array>): Promise<void> {
  for await (const chunk of src) {
    if (req.destroyed) return
    if (!req.write(chunk)) {
      await new Promise<void>((res) => {
        const done = () => {
          req.off('drain', done)
          req.off('close', done)
          res()
        }
        req.on('drain', done)
        req.on('close', done)
      })
    }
  }
  req.end()
}

/** readAll reads a body to its end (at most limit bytes kept). */
export async function readAll(body: AsyncIterable<Uint8Array>, limit = Infinity): Promise<Uint8Array> {
  const parts: Uint8Array[] = []
  let n = 0
  for await (const c of body) {
    if (n < limit) {
      const take = Math.min(c.length, limit - n)
      parts.push(take === c.length ? c : c.subarray(0, take))
      n += take
    }
  }
  const out = new Uint8Array(n)
  let off = 0
  for (const p of parts) {
    out.set(p, off)
    off += p.length
  }
  return out
}

/** ndjson yields the JSON objects of a newline-delimited stream. */
export async function* ndjson<T>(body: AsyncIterable<Uint8Array>): AsyncGenerator<T> {
  const dec = new TextDecoder()
  let buf = ''
  for await (const chunk of body) {
    buf += dec.decode(chunk, { stream: true })
    let nl: number
    while ((nl = buf.indexOf('\n')) >= 0) {
      const line = buf.slice(0, nl).trim()
      buf = buf.slice(nl + 1)
      if (line) yield JSON.parse(line) as T
    }
  }
  buf += dec.decode()
  if (buf.trim()) yield JSON.parse(buf) as T
}

const idempotent = new Set(['GET', 'HEAD', 'PUT', 'DELETE', 'OPTIONS'])

/** retryAfterMs parses Retry-After (seconds or an HTTP date); null when absent or bad. */
export function retryAfterMs(v: string | null, now = Date.now()): number | null {
  if (v == null || v.trim() === '') return null
  const s = v.trim()
  if (/^\d+(\.\d+)?$/.test(s)) return Math.round(parseFloat(s) * 1000)
  const t = Date.parse(s)
  return Number.isNaN(t) ? null : Math.max(0, t - now)
}

function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((res, rej) => {
    if (signal?.aborted) return rej(signal.reason)
    const t = setTimeout(() => {
      signal?.removeEventListener('abort', onAbort)
      res()
    }, ms)
    const onAbort = () => {
      clearTimeout(t)
      rej(signal!.reason)
    }
    signal?.addEventListener('abort', onAbort, { once: true })
  })
}

/** Options of one call. */
export interface CallOptions {
  /** Aborts the call (and, for a stream, stops reading it). */
  signal?: AbortSignal
}

export interface RequestOptions extends CallOptions {
  query?: Record<string, string | string[] | number | boolean | undefined>
  /** A JSON body (Content-Type application/json). */
  json?: unknown
  /** A raw body, with contentType. */
  body?: BodyData
  contentType?: string
}

/** HttpClient speaks to one daemon. */
export class HttpClient {
  readonly transport: Transport
  private readonly retry: Required<Omit<RetryOptions, 'onRetry'>> & Pick<RetryOptions, 'onRetry'>

  constructor(
    readonly conn: Connection,
    retry: RetryOptions = {},
    transport?: Transport,
  ) {
    this.transport = transport ?? (conn.kind === 'unix' ? new SocketTransport(conn, conn.socketPath!) : new FetchTransport(conn, conn.base!))
    this.retry = {
      maxRetries: retry.maxRetries ?? 3,
      baseDelayMs: retry.baseDelayMs ?? 250,
      maxDelayMs: retry.maxDelayMs ?? 30_000,
      onRetry: retry.onRetry,
    }
  }

  /**
   * request sends a request and returns the answer when its status is 2xx;
   * otherwise it throws the answer's classed error. A 429, and a 503 that
   * carries Retry-After or answers an idempotent method, is retried (when
   * the body can be sent again): after Retry-After when given, else after
   * an exponential backoff with jitter.
   */
  async request(method: string, path: string, o: RequestOptions = {}): Promise<RawResponse> {
    let url = path
    if (o.query) {
      const q = new URLSearchParams()
      for (const [k, v] of Object.entries(o.query)) {
        if (v === undefined) continue
        for (const x of Array.isArray(v) ? v : [v]) q.append(k, String(x))
      }
      const s = q.toString()
      if (s) url += '?' + s
    }
    const headers: Record<string, string> = { accept: 'application/json' }
    let body: BodyData | undefined
    if (o.json !== undefined) {
      body = JSON.stringify(o.json)
      headers['content-type'] = 'application/json'
    } else if (o.body !== undefined) {
      body = o.body
      headers['content-type'] = o.contentType ?? 'application/octet-stream'
    }
    if (this.conn.token) headers['authorization'] = 'Bearer ' + this.conn.token
    const replayable = !isStreamBody(body)
    for (let attempt = 0; ; attempt++) {
      const res = await this.transport.send({ method, path: url, headers, body, signal: o.signal })
      if (res.status >= 200 && res.status < 300) return res
      const text = new TextDecoder().decode(await readAll(res.body, 1 << 20))
      const ra = retryAfterMs(res.header('retry-after'))
      const again =
        replayable &&
        attempt < this.retry.maxRetries &&
        (res.status === 429 || (res.status === 503 && (ra !== null || idempotent.has(method))))
      if (again) {
        let delay: number
        if (ra !== null) {
          delay = ra
        } else {
          const cap = Math.min(this.retry.maxDelayMs, this.retry.baseDelayMs * 2 ** attempt)
          delay = cap / 2 + Math.random() * (cap / 2)
        }
        if (delay <= this.retry.maxDelayMs) {
          this.retry.onRetry?.({ attempt: attempt + 1, status: res.status, delayMs: delay, method, path })
          await sleep(delay, o.signal)
          continue
        }
      }
      throw fromResponse(res.status, res.statusText, text)
    }
  }

  /** json sends a request and decodes its JSON answer (undefined for an empty body). */
  async json<T>(method: string, path: string, o: RequestOptions = {}): Promise<T> {
    const res = await this.request(method, path, o)
    const text = new TextDecoder().decode(await readAll(res.body))
    if (!text.trim()) return undefined as T
    try {
      return JSON.parse(text) as T
    } catch (err) {
      throw new ForkdError(`${method} ${path}: bad response: ${(err as Error).message}`, 'unknown', res.status)
    }
  }

  close(): void {
    this.transport.close()
  }
}
