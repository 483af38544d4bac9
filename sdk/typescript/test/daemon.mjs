// A real `forkd serve` for the tests and the bench: its own data dir, a
// socket in a temp dir, a free loopback port with the token of its token
// file, and the shared image cache. stop() kills the sandboxes left, stops
// the daemon and removes its files (never the cache).

import { spawn } from 'node:child_process'
import { existsSync, mkdtempSync, openSync, readFileSync, rmSync, closeSync } from 'node:fs'
import { createServer } from 'node:net'
import { tmpdir } from 'node:os'
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'

import { Controller } from '../dist/index.js'

const here = dirname(fileURLToPath(import.meta.url))

/** forkdBinary is $FORKD_BIN, else the repo's bin/forkd (make build), else undefined. */
export function forkdBinary() {
  if (process.env.FORKD_BIN) return resolve(process.env.FORKD_BIN)
  const p = resolve(here, '../../../bin/forkd')
  return existsSync(p) ? p : undefined
}

/** imageCache is $FORKD_CACHE, else $FORKD_TEST_CACHE/image (default /var/tmp/forkd-test-cache/image), as the Go VM tests use it. */
export function imageCache() {
  if (process.env.FORKD_CACHE) return process.env.FORKD_CACHE
  return join(process.env.FORKD_TEST_CACHE || '/var/tmp/forkd-test-cache', 'image')
}

function freePort() {
  return new Promise((res, rej) => {
    const s = createServer()
    s.once('error', rej)
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address()
      s.close(() => res(port))
    })
  })
}

/**
 * buildSnapshot builds a snapshot, trying twice: on a loaded machine a
 * parent VM can miss its agent's start-up deadline (`agent init: context
 * deadline exceeded`), and a second boot usually makes it.
 */
export async function buildSnapshot(ctl, req, opts = {}) {
  try {
    return await ctl.buildSnapshot(req, opts)
  } catch (err) {
    if (err.code !== 'deadline_exceeded') throw err
    console.error(`# snapshot ${req.tag}: ${err.message}; trying again`)
    await ctl.deleteSnapshot(req.tag).catch(() => {})
    return await ctl.buildSnapshot(req, opts)
  }
}

/**
 * startDaemon starts forkd serve with extra flags and waits until it
 * answers on its socket.
 */
export async function startDaemon({ bin = forkdBinary(), args = [] } = {}) {
  if (!bin) throw new Error('no forkd binary: set FORKD_BIN or run make build')
  const data = mkdtempSync(join(tmpdir(), 'forkd-ts-data-'))
  // A short path: a socket's path is at most 107 bytes.
  const sockDir = mkdtempSync('/tmp/fts-')
  const socket = join(sockDir, 's')
  const port = await freePort()
  const log = join(data, 'serve.log')
  const fd = openSync(log, 'a')
  const env = { ...process.env, FORKD_DATA: data, FORKD_CACHE: imageCache() }
  delete env.FORKD_URL
  delete env.FORKD_TOKEN
  const proc = spawn(bin, ['serve', '--socket', socket, '--listen', `127.0.0.1:${port}`, ...args], {
    env,
    stdio: ['ignore', fd, fd],
  })
  closeSync(fd)
  let exited = null
  proc.on('exit', (code, sig) => (exited = { code, sig }))
  const unix = new Controller({ url: 'unix://' + socket, retry: { maxRetries: 0 } })
  const deadline = Date.now() + 60_000
  for (;;) {
    try {
      await unix.health()
      break
    } catch (err) {
      if (exited || Date.now() > deadline) {
        proc.kill('SIGKILL')
        throw new Error(`forkd serve did not come up (${JSON.stringify(exited)}): ${err.message}\n${readFileSync(log, 'utf8')}`)
      }
      await new Promise((r) => setTimeout(r, 100))
    }
  }
  unix.close()
  const token = readFileSync(join(data, 'token'), 'utf8').trim()
  const d = {
    bin,
    data,
    socket,
    socketUrl: 'unix://' + socket,
    tcpUrl: `http://127.0.0.1:${port}`,
    token,
    log: () => readFileSync(log, 'utf8'),
    /** stop kills every sandbox, stops the daemon and removes its files. */
    async stop() {
      if (!exited) {
        const c = new Controller({ url: 'unix://' + socket, retry: { maxRetries: 0 } })
        try {
          for (const s of await c.listSandboxes()) {
            await c.deleteSandbox(s.id).catch(() => {})
          }
        } catch {
          // the daemon may be gone
        }
        c.close()
        proc.kill('SIGTERM')
        const t = setTimeout(() => proc.kill('SIGKILL'), 15_000)
        await new Promise((r) => (exited ? r() : proc.once('exit', r)))
        clearTimeout(t)
      }
      // Sandboxes outlive their daemon: whatever is left, the CLI kills
      // over the data dir itself.
      await new Promise((r) => {
        const k = spawn(bin, ['kill', '--all'], { env, stdio: 'ignore' })
        k.on('exit', r)
        k.on('error', r)
      })
      rmSync(data, { recursive: true, force: true })
      rmSync(sockDir, { recursive: true, force: true })
    },
  }
  return d
}
