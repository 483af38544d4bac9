// Where the daemon is and what token it gets, by the rules of the forkd CLI
// (internal/cli/remote.go): options, else FORKD_URL with FORKD_TOKEN, else
// the local unix socket. The data dir's token file goes only to a loopback
// address, and plain http to another host is refused unless insecure.

import { existsSync, readFileSync } from 'node:fs'
import { isIP } from 'node:net'
import { homedir } from 'node:os'
import { join, resolve } from 'node:path'

import { InvalidArgumentError, UnavailableError } from './errors.js'
import type { ControllerInfo } from './types.js'

/** How to reach a daemon; every field is optional. */
export interface ConnectionOptions {
  /**
   * The daemon: `unix:///path/to/sock`, `http://host:port` or
   * `https://host:port`. Default: $FORKD_URL, else the local socket.
   */
  url?: string
  /** The bearer token for TCP. Default: $FORKD_TOKEN, else (loopback only) the data dir's token file. */
  token?: string
  /** The daemon's data dir, for its token file and controller.json. Default: $FORKD_DATA, else /var/lib/forkd as root, else ~/.local/share/forkd. */
  dataDir?: string
  /** Allow plain http to a host that is not loopback (the token travels in clear). Default: $FORKD_INSECURE=1. */
  insecure?: boolean
  /** Environment to read instead of process.env (tests). */
  env?: Record<string, string | undefined>
}

/** A resolved connection. */
export interface Connection {
  /** The URL as resolved, for messages. */
  url: string
  /** "unix" or "tcp". */
  kind: 'unix' | 'tcp'
  /** The socket path (unix only). */
  socketPath?: string
  /** scheme://host[:port] (tcp only). */
  base?: string
  token: string
}

/** The daemon's default unix socket: /run/forkd/forkd.sock as root, else $XDG_RUNTIME_DIR/forkd/forkd.sock (undefined without it). */
export function defaultSocket(env: Record<string, string | undefined> = process.env): string | undefined {
  if (typeof process.geteuid === 'function' && process.geteuid() === 0) return '/run/forkd/forkd.sock'
  const d = env['XDG_RUNTIME_DIR']
  return d ? join(d, 'forkd', 'forkd.sock') : undefined
}

/** The daemon's default TCP address. */
export const DEFAULT_ADDR = '127.0.0.1:8889'

/** The data dir: opts.dataDir, $FORKD_DATA, /var/lib/forkd as root, ~/.local/share/forkd otherwise. */
export function defaultDataDir(env: Record<string, string | undefined> = process.env): string {
  const d = env['FORKD_DATA']
  if (d) return resolve(d)
  if (typeof process.geteuid === 'function' && process.geteuid() === 0) return '/var/lib/forkd'
  return join(env['HOME'] || homedir(), '.local', 'share', 'forkd')
}

/** Whether host (a URL hostname, maybe bracketed) names this machine: localhost or a loopback address. */
export function isLoopback(host: string): boolean {
  let h = host.toLowerCase()
  if (h === 'localhost') return true
  if (h.startsWith('[') && h.endsWith(']')) h = h.slice(1, -1)
  switch (isIP(h)) {
    case 4:
      return h.startsWith('127.')
    case 6: {
      if (h === '::1' || /^(0{0,4}:){7}0{0,3}1$/.test(h)) return true
      const m = /^::ffff:(\d+\.\d+\.\d+\.\d+)$/.exec(h)
      if (m) return m[1]!.startsWith('127.')
      // ::ffff:7f00:1 (the mapped form as WHATWG URLs write it).
      return /^::ffff:7f[0-9a-f]{2}:[0-9a-f]{1,4}$/.test(h)
    }
  }
  return false
}

/** parseUrl checks a daemon URL and splits it. */
export function parseUrl(raw: string): { kind: 'unix'; socketPath: string } | { kind: 'tcp'; base: string; url: URL } {
  let u: URL
  try {
    u = new URL(raw)
  } catch (err) {
    throw new InvalidArgumentError(`daemon url ${JSON.stringify(raw)}: ${(err as Error).message}`, 0)
  }
  switch (u.protocol) {
    case 'unix:': {
      const p = decodeURIComponent(u.pathname)
      if (!p || p === '/' || u.host) {
        throw new InvalidArgumentError(`daemon url ${JSON.stringify(raw)}: want unix:///path/to/socket`, 0)
      }
      return { kind: 'unix', socketPath: p }
    }
    case 'http:':
    case 'https:':
      if (!u.host) throw new InvalidArgumentError(`daemon url ${JSON.stringify(raw)}: no host`, 0)
      return { kind: 'tcp', base: `${u.protocol}//${u.host}`, url: u }
    default:
      throw new InvalidArgumentError(`daemon url ${JSON.stringify(raw)}: want unix://, http:// or https://`, 0)
  }
}

function readToken(dataDir: string): string {
  try {
    return readFileSync(join(dataDir, 'token'), 'utf8').trim()
  } catch {
    return ''
  }
}

/**
 * resolveConnection finds the daemon: opts.url, else $FORKD_URL, else the
 * socket a running daemon recorded in <data>/controller.json, else the
 * default socket. The token is opts.token, else $FORKD_TOKEN, else (for a
 * loopback http(s) URL only) the data dir's token file; a unix socket needs
 * none. Plain http to a host that is not loopback is refused unless
 * insecure ($FORKD_INSECURE=1): it would carry the token in clear.
 */
export function resolveConnection(opts: ConnectionOptions = {}): Connection {
  const env = opts.env ?? process.env
  const dataDir = opts.dataDir ? resolve(opts.dataDir) : defaultDataDir(env)
  const raw = opts.url || env['FORKD_URL']
  if (raw) {
    const p = parseUrl(raw)
    if (p.kind === 'unix') {
      return { url: raw, kind: 'unix', socketPath: p.socketPath, token: opts.token ?? env['FORKD_TOKEN'] ?? '' }
    }
    let token = opts.token ?? env['FORKD_TOKEN'] ?? ''
    const insecure = opts.insecure ?? env['FORKD_INSECURE'] === '1'
    if (!isLoopback(p.url.hostname)) {
      if (p.url.protocol === 'http:' && !insecure) {
        throw new InvalidArgumentError(
          `${raw}: plain http to a host that is not loopback would send the token in clear; use https:// (or set FORKD_INSECURE=1)`,
          0,
        )
      }
    } else if (!token) {
      token = readToken(dataDir)
    }
    return { url: raw, kind: 'tcp', base: p.base, token }
  }
  const socks: string[] = []
  try {
    const info = JSON.parse(readFileSync(join(dataDir, 'controller.json'), 'utf8')) as ControllerInfo
    if (info.socket) socks.push(info.socket)
  } catch {
    // no daemon recorded
  }
  const def = defaultSocket(env)
  if (def) socks.push(def)
  for (const s of socks) {
    if (existsSync(s)) return { url: 'unix://' + s, kind: 'unix', socketPath: s, token: opts.token ?? '' }
  }
  throw new UnavailableError(
    `no forkd daemon found: set FORKD_URL (and FORKD_TOKEN), or start \`forkd serve\` (tried ${socks.length ? socks.join(', ') : 'no socket: XDG_RUNTIME_DIR is unset'})`,
    0,
  )
}
