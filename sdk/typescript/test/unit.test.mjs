// Unit tests: no daemon. A local HTTP server (TCP and unix socket) stands
// in for it where the wire matters: retries, error classes, streams.

import assert from 'node:assert/strict'
import { mkdtempSync, rmSync, writeFileSync, mkdirSync } from 'node:fs'
import { createServer } from 'node:http'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { after, before, describe, test } from 'node:test'

import {
  AlreadyExistsError,
  CommandExitError,
  Controller,
  DeadlineExceededError,
  FailedPreconditionError,
  ForkdError,
  InternalError,
  InvalidArgumentError,
  NotFoundError,
  NotImplementedError,
  RateLimitError,
  ResourceExhaustedError,
  Sandbox,
  SandboxError,
  TimeoutError,
  UnauthenticatedError,
  UnavailableError,
  fromCode,
  fromResponse,
  isLoopback,
  resolveConnection,
  retryAfterMs,
} from '../dist/index.js'

describe('errors', () => {
  test('one class per code, with code and status', () => {
    const cases = [
      ['not_found', NotFoundError, 404],
      ['already_exists', AlreadyExistsError, 409],
      ['invalid_argument', InvalidArgumentError, 400],
      ['failed_precondition', FailedPreconditionError, 409],
      ['resource_exhausted', ResourceExhaustedError, 429],
      ['unavailable', UnavailableError, 503],
      ['not_implemented', NotImplementedError, 501],
      ['unauthenticated', UnauthenticatedError, 401],
      ['deadline_exceeded', DeadlineExceededError, 504],
      ['internal', InternalError, 500],
    ]
    for (const [code, cls, status] of cases) {
      const e = fromCode(code, 'msg')
      assert.ok(e instanceof cls, code)
      assert.ok(e instanceof ForkdError)
      assert.ok(e instanceof Error)
      assert.equal(e.code, code)
      assert.equal(e.status, status)
      assert.equal(e.message, 'msg')
      assert.equal(e.name, cls.name)
    }
    const odd = fromCode('brand_new', 'x', 418)
    assert.equal(odd.constructor, ForkdError)
    assert.equal(odd.code, 'brand_new')
    assert.equal(odd.status, 418)
  })

  test('E2B names are the same classes', () => {
    assert.equal(SandboxError, ForkdError)
    assert.equal(TimeoutError, DeadlineExceededError)
    assert.equal(RateLimitError, ResourceExhaustedError)
    assert.ok(new CommandExitError({ exitCode: 2, stdout: '', stderr: 'e', error: 'exit status 2' }) instanceof SandboxError)
  })

  test('fromResponse reads the body, else the status', () => {
    const e = fromResponse(413, 'Request Entity Too Large', '{"error":{"code":"invalid_argument","message":"too big"}}')
    assert.ok(e instanceof InvalidArgumentError)
    assert.equal(e.status, 413)
    assert.equal(e.message, 'too big')
    const p = fromResponse(502, 'Bad Gateway', '<html>proxy</html>')
    assert.equal(p.constructor, ForkdError)
    assert.equal(p.status, 502)
    assert.match(p.message, /502 Bad Gateway: <html>proxy/)
    assert.ok(fromResponse(404, 'Not Found', '') instanceof NotFoundError)
  })
})

describe('retryAfterMs', () => {
  test('seconds, dates, junk', () => {
    assert.equal(retryAfterMs(null), null)
    assert.equal(retryAfterMs(''), null)
    assert.equal(retryAfterMs('1'), 1000)
    assert.equal(retryAfterMs('0.5'), 500)
    const now = Date.parse('2026-01-01T00:00:00Z')
    assert.equal(retryAfterMs('Thu, 01 Jan 2026 00:00:02 GMT', now), 2000)
    assert.equal(retryAfterMs('soon'), null)
  })
})

describe('connection', () => {
  let dir
  before(() => {
    dir = mkdtempSync(join(tmpdir(), 'forkd-ts-unit-'))
    writeFileSync(join(dir, 'token'), 'file-token-0123456789abcdef\n', { mode: 0o600 })
  })
  after(() => rmSync(dir, { recursive: true, force: true }))

  test('isLoopback', () => {
    for (const h of ['localhost', 'LOCALHOST', '127.0.0.1', '127.1.2.3', '::1', '[::1]', '[::ffff:7f00:1]', '::ffff:127.0.0.1']) {
      assert.ok(isLoopback(h), h)
    }
    for (const h of ['example.com', '10.0.0.1', '128.0.0.1', '[::2]', 'localhost.evil.com', '0.0.0.0']) {
      assert.ok(!isLoopback(h), h)
    }
  })

  test('options win over the environment', () => {
    const c = resolveConnection({ url: 'http://127.0.0.1:1', token: 'opt', env: { FORKD_URL: 'http://127.0.0.1:2', FORKD_TOKEN: 'env' } })
    assert.deepEqual([c.kind, c.base, c.token], ['tcp', 'http://127.0.0.1:1', 'opt'])
  })

  test('FORKD_URL and FORKD_TOKEN', () => {
    const c = resolveConnection({ env: { FORKD_URL: 'https://forkd.example:8889', FORKD_TOKEN: 'tok', FORKD_DATA: dir } })
    assert.deepEqual([c.kind, c.base, c.token], ['tcp', 'https://forkd.example:8889', 'tok'])
  })

  test('the token file goes to loopback only', () => {
    const local = resolveConnection({ env: { FORKD_URL: 'http://localhost:8889', FORKD_DATA: dir } })
    assert.equal(local.token, 'file-token-0123456789abcdef')
    const remote = resolveConnection({ env: { FORKD_URL: 'https://forkd.example', FORKD_DATA: dir } })
    assert.equal(remote.token, '')
  })

  test('plain http to another host is refused unless insecure', () => {
    assert.throws(() => resolveConnection({ env: { FORKD_URL: 'http://10.1.2.3:8889', FORKD_DATA: dir } }), InvalidArgumentError)
    const c = resolveConnection({ env: { FORKD_URL: 'http://10.1.2.3:8889', FORKD_INSECURE: '1', FORKD_TOKEN: 't', FORKD_DATA: dir } })
    assert.equal(c.token, 't')
    assert.ok(resolveConnection({ url: 'http://10.1.2.3:8889', insecure: true, env: {} }))
  })

  test('bad URLs', () => {
    for (const u of ['ftp://x', 'unix://', 'http://', 'not a url']) {
      assert.throws(() => resolveConnection({ url: u, env: {} }), InvalidArgumentError, u)
    }
  })

  test('the socket recorded in controller.json, else the default socket', () => {
    const sock = join(dir, 'sock')
    writeFileSync(sock, '')
    writeFileSync(join(dir, 'controller.json'), JSON.stringify({ socket: sock, pid: 1 }))
    const c = resolveConnection({ env: { FORKD_DATA: dir } })
    assert.deepEqual([c.kind, c.socketPath, c.token], ['unix', sock, ''])
    rmSync(join(dir, 'controller.json'))
    if (process.geteuid?.() !== 0) {
      const xdg = join(dir, 'xdg')
      mkdirSync(join(xdg, 'forkd'), { recursive: true })
      writeFileSync(join(xdg, 'forkd', 'forkd.sock'), '')
      assert.equal(resolveConnection({ env: { FORKD_DATA: dir, XDG_RUNTIME_DIR: xdg } }).socketPath, join(xdg, 'forkd', 'forkd.sock'))
    }
  })

  test('no daemon anywhere', () => {
    const empty = mkdtempSync(join(tmpdir(), 'forkd-ts-empty-'))
    try {
      if (process.geteuid?.() === 0) return // /run/forkd/forkd.sock may exist on this host
      assert.throws(() => resolveConnection({ env: { FORKD_DATA: empty } }), UnavailableError)
    } finally {
      rmSync(empty, { recursive: true, force: true })
    }
  })
})

// A fake daemon: handler(req, body) answers; every request is recorded.
function fakeDaemon(handler) {
  const seen = []
  const srv = createServer(async (req, res) => {
    const chunks = []
    for await (const c of req) chunks.push(c)
    const body = Buffer.concat(chunks)
    seen.push({ method: req.method, url: req.url, headers: req.headers, body })
    handler(req, res, body, seen.length)
  })
  return { srv, seen }
}

for (const kind of ['tcp', 'unix']) {
  describe(`wire over ${kind}`, () => {
    let fake
    let url
    let dir
    let handler = () => {}
    before(async () => {
      fake = fakeDaemon((...a) => handler(...a))
      if (kind === 'tcp') {
        await new Promise((r) => fake.srv.listen(0, '127.0.0.1', r))
        url = `http://127.0.0.1:${fake.srv.address().port}`
      } else {
        dir = mkdtempSync('/tmp/fts-unit-')
        await new Promise((r) => fake.srv.listen(join(dir, 's'), r))
        url = 'unix://' + join(dir, 's')
      }
    })
    after(async () => {
      await new Promise((r) => fake.srv.close(r))
      if (dir) rmSync(dir, { recursive: true, force: true })
    })
    const ctl = (o = {}) => new Controller({ url, token: kind === 'tcp' ? 'secret-token-123456' : undefined, env: {}, ...o })
    const json = (res, status, v, headers = {}) => {
      res.writeHead(status, { 'content-type': 'application/json', ...headers })
      res.end(JSON.stringify(v))
    }

    test('JSON bodies carry Content-Type application/json, and the token', async () => {
      fake.seen.length = 0
      handler = (req, res) => json(res, 200, { exit_code: 0, duration_ms: 1, stdout: 'hi' })
      const c = ctl()
      const r = await c.exec('sb-aaaaaaaaaa', { shell: 'echo hi' })
      assert.equal(r.stdout, 'hi')
      const s = fake.seen[0]
      assert.equal(s.method, 'POST')
      assert.equal(s.url, '/v1/sandboxes/sb-aaaaaaaaaa/exec')
      assert.equal(s.headers['content-type'], 'application/json')
      assert.deepEqual(JSON.parse(s.body), { shell: 'echo hi' })
      assert.equal(s.headers.authorization, kind === 'tcp' ? 'Bearer secret-token-123456' : undefined)
      c.close()
    })

    test('429 is retried after Retry-After, then succeeds', async () => {
      fake.seen.length = 0
      handler = (req, res, body, n) =>
        n < 3 ? json(res, 429, { error: { code: 'resource_exhausted', message: 'busy' } }, { 'retry-after': '0' }) : json(res, 201, { sandboxes: [], wall_ms: 1 })
      const retries = []
      const c = ctl({ retry: { onRetry: (i) => retries.push(i) } })
      await c.createSandboxes({ snapshot_tag: 'x' })
      assert.equal(fake.seen.length, 3)
      assert.deepEqual(
        retries.map((r) => [r.attempt, r.status, r.delayMs]),
        [
          [1, 429, 0],
          [2, 429, 0],
        ],
      )
      // The body is sent again, whole.
      assert.deepEqual(JSON.parse(fake.seen[2].body), { snapshot_tag: 'x' })
      c.close()
    })

    test('retries give up after maxRetries with the classed error', async () => {
      fake.seen.length = 0
      handler = (req, res) => json(res, 429, { error: { code: 'resource_exhausted', message: 'full' } })
      const c = ctl({ retry: { maxRetries: 2, baseDelayMs: 1 } })
      await assert.rejects(c.createSandboxes({ snapshot_tag: 'x' }), (e) => e instanceof ResourceExhaustedError && e.status === 429 && e.message === 'full')
      assert.equal(fake.seen.length, 3)
      c.close()
    })

    test('a Retry-After beyond maxDelayMs is not waited for', async () => {
      fake.seen.length = 0
      handler = (req, res) => json(res, 429, { error: { code: 'resource_exhausted', message: 'later' } }, { 'retry-after': '3600' })
      const c = ctl({ retry: { maxDelayMs: 1000 } })
      await assert.rejects(c.listSandboxes(), ResourceExhaustedError)
      assert.equal(fake.seen.length, 1)
      c.close()
    })

    test('503 is retried for GET, not for a POST without Retry-After', async () => {
      fake.seen.length = 0
      handler = (req, res, body, n) => (n === 1 ? json(res, 503, { error: { code: 'unavailable', message: 'agent lost' } }) : json(res, 200, { sandboxes: [] }))
      const c = ctl({ retry: { baseDelayMs: 1 } })
      assert.deepEqual(await c.listSandboxes(), [])
      assert.equal(fake.seen.length, 2)
      fake.seen.length = 0
      handler = (req, res) => json(res, 503, { error: { code: 'unavailable', message: 'agent lost' } })
      await assert.rejects(c.exec('sb-aaaaaaaaaa', { shell: 'true' }), (e) => e instanceof UnavailableError && e.status === 503)
      assert.equal(fake.seen.length, 1, 'an exec is not run twice')
      fake.seen.length = 0
      handler = (req, res, body, n) =>
        n === 1 ? json(res, 503, { error: { code: 'unavailable', message: 'x' } }, { 'retry-after': '0' }) : json(res, 200, { exit_code: 0, duration_ms: 1 })
      await c.exec('sb-aaaaaaaaaa', { shell: 'true' })
      assert.equal(fake.seen.length, 2, 'Retry-After says it was not run')
      c.close()
    })

    test('error answers become classes; a body that is not JSON keeps its status', async () => {
      const c = ctl({ retry: { maxRetries: 0 } })
      for (const [status, code, cls] of [
        [400, 'invalid_argument', InvalidArgumentError],
        [401, 'unauthenticated', UnauthenticatedError],
        [404, 'not_found', NotFoundError],
        [409, 'failed_precondition', FailedPreconditionError],
        [409, 'already_exists', AlreadyExistsError],
        [415, 'invalid_argument', InvalidArgumentError],
        [501, 'not_implemented', NotImplementedError],
        [504, 'deadline_exceeded', DeadlineExceededError],
      ]) {
        handler = (req, res) => json(res, status, { error: { code, message: `m${status}` } })
        await assert.rejects(c.getSandbox('sb-aaaaaaaaaa'), (e) => e instanceof cls && e.status === status && e.code === code && e.message === `m${status}`)
      }
      handler = (req, res) => {
        res.writeHead(502)
        res.end('bad gateway')
      }
      await assert.rejects(c.getSandbox('sb-aaaaaaaaaa'), (e) => e.constructor === ForkdError && e.status === 502)
      c.close()
    })

    test('NDJSON split anywhere, an error event thrown as its class', async () => {
      handler = (req, res) => {
        res.writeHead(200, { 'content-type': 'application/x-ndjson' })
        const text =
          '{"type":"stdout","data":"h\u00e9llo "}\n{"type":"stdout","data_b64":"/w=="}\n{"type":"stderr","data":"e"}\n{"type":"exit","exec":{"exit_code":3,"duration_ms":5}}\n'
        const b = Buffer.from(text)
        let i = 0
        const step = () => {
          if (i >= b.length) return res.end()
          res.write(b.subarray(i, i + 7))
          i += 7
          setImmediate(step)
        }
        step()
      }
      const c = ctl()
      const evs = []
      for await (const ev of c.execStream('sb-aaaaaaaaaa', { shell: 'x' })) evs.push(ev)
      assert.deepEqual(
        evs.map((e) => e.type),
        ['stdout', 'stdout', 'stderr', 'exit'],
      )
      assert.equal(evs[0].data, 'h\u00e9llo ')
      assert.equal(evs[1].data_b64, '/w==')
      assert.equal(evs[3].exec.exit_code, 3)
      handler = (req, res) => {
        res.writeHead(200, { 'content-type': 'application/x-ndjson' })
        res.end('{"type":"stdout","data":"a"}\n{"type":"error","error":{"code":"deadline_exceeded","message":"too slow"}}\n')
      }
      const got = []
      await assert.rejects(
        (async () => {
          for await (const ev of c.execStream('sb-aaaaaaaaaa', { shell: 'x' })) got.push(ev.type)
        })(),
        (e) => e instanceof DeadlineExceededError && e.message === 'too slow',
      )
      assert.deepEqual(got, ['stdout'])
      handler = (req, res) => {
        res.writeHead(200, { 'content-type': 'application/x-ndjson' })
        res.end('{"type":"stdout","data":"a"}\n')
      }
      await assert.rejects(
        (async () => {
          for await (const _ of c.execStream('sb-aaaaaaaaaa', { shell: 'x' }));
        })(),
        UnavailableError,
      )
      c.close()
    })

    test('a daemon that is not there is unavailable (status 0)', async () => {
      const c = new Controller({ url: kind === 'tcp' ? 'http://127.0.0.1:1' : 'unix:///nonexistent/forkd.sock', env: {}, retry: { maxRetries: 0 } })
      await assert.rejects(c.health(), (e) => e instanceof UnavailableError && e.status === 0)
      c.close()
    })

    test('disk and idle-freeze options reach the create and fork bodies; non-integers are refused unsent', async () => {
      fake.seen.length = 0
      handler = (req, res) =>
        json(res, 201, { sandboxes: [{ id: 'sb-aaaaaaaaaa', status: 'frozen', disk_mib: 256, idle_freeze_secs: -1 }], wall_ms: 1 })
      const c = ctl()
      const sb = await Sandbox.create('base', { controller: c, timeoutMs: 0, diskMiB: 256, idleFreezeSecs: -1 })
      await sb.fork({ count: 2, timeoutMs: 0, idleFreezeSecs: 30 })
      for (const bad of [1.5, '30', true, NaN]) {
        await assert.rejects(Sandbox.create('base', { controller: c, idleFreezeSecs: bad }), TypeError)
        await assert.rejects(Sandbox.create('base', { controller: c, diskMiB: bad }), TypeError)
        await assert.rejects(sb.fork({ idleFreezeSecs: bad }), TypeError)
      }
      assert.equal(fake.seen.length, 2)
      assert.deepEqual(JSON.parse(fake.seen[0].body), { snapshot_tag: 'base', n: 1, disk_mib: 256, idle_freeze_secs: -1 })
      assert.equal(fake.seen[1].url, '/v1/sandboxes/sb-aaaaaaaaaa/fork')
      assert.deepEqual(JSON.parse(fake.seen[1].body), { count: 2, idle_freeze_secs: 30 })
      c.close()
    })

    test('an aborted call rejects with the abort reason', async () => {
      handler = () => {} // never answers
      const c = ctl()
      const ac = new AbortController()
      const p = c.listSandboxes({ signal: ac.signal })
      setTimeout(() => ac.abort(new Error('gave up')), 50)
      await assert.rejects(p, /gave up/)
      c.close()
    })
  })
}
