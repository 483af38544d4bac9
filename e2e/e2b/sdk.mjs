// The official E2B SDKs, unmodified, against forkd's E2B listener. Run by
// e2e/e2b_test.go, configured through the environment only:
//
//   E2B_API_KEY, E2B_API_URL, and E2B_SANDBOX_URL or E2B_DOMAIN  the SDKs' own
//   FORKD_E2B_SCHEME   http or https, for the URLs of Sandbox.getHost
//   FORKD_E2B_RUN      a label: sandboxes carry it as metadata
//   FORKD_E2B_ONLY     a comma list of scenarios to run (default: all)
//   FORKD_E2B_MEASURE  a number N: also time N creates and the round trips
//   FORKD_NATIVE_SDK   sdk/typescript/dist/index.js: time forkd's own SDK too,
//                      at FORKD_NATIVE_URL with FORKD_NATIVE_TOKEN
//
// Each scenario prints "ok NAME (ms)" or "FAIL NAME: error"; measurements
// print one "measure {json}" line. The exit status is 1 if any failed.
import crypto from 'node:crypto'
import { Sandbox, CommandExitError, TimeoutError, SandboxNotFoundError, FileNotFoundError } from 'e2b'
import { Sandbox as CodeInterpreter } from '@e2b/code-interpreter'

const scheme = process.env.FORKD_E2B_SCHEME || 'http'
const run = process.env.FORKD_E2B_RUN || String(Date.now())
const only = (process.env.FORKD_E2B_ONLY || '').split(',').filter(Boolean)
let failed = 0

// slow is for the calls that write or map a sandbox's memory (fork, pause,
// connect): on a shared machine under TCG they can outlast the SDK's 60 s
// request timeout.
const slow = { requestTimeoutMs: 300_000 }

function assert(cond, msg) {
  if (!cond) throw new Error('assertion failed: ' + msg)
}

function eq(got, want, what) {
  if (got !== want) throw new Error(`${what}: got ${JSON.stringify(got)}, want ${JSON.stringify(want)}`)
}

async function rejects(p, cls, what) {
  try {
    await p
  } catch (e) {
    if (cls && !(e instanceof cls)) throw new Error(`${what}: threw ${e?.constructor?.name}: ${e?.message}, want ${cls.name}`)
    return e
  }
  throw new Error(`${what}: did not throw`)
}

async function until(what, fn, ms = 20000) {
  const end = Date.now() + ms
  let last
  for (;;) {
    try {
      const v = await fn()
      if (v) return v
    } catch (e) {
      last = e
    }
    if (Date.now() > end) throw new Error(`${what}: not within ${ms} ms` + (last ? ` (last error: ${last.message})` : ''))
    await new Promise((r) => setTimeout(r, 200))
  }
}

async function scenario(name, fn) {
  if (only.length && !only.includes(name)) return
  const t0 = Date.now()
  try {
    await fn()
    console.log(`ok ${name} (${Date.now() - t0} ms)`)
  } catch (e) {
    failed++
    console.log(`FAIL ${name}: ${e?.constructor?.name}: ${e?.stack || e}`)
  }
}

function sha(buf) {
  return crypto.createHash('sha256').update(buf).digest('hex')
}

function percentile(xs, p) {
  const s = [...xs].sort((a, b) => a - b)
  return s[Math.min(s.length - 1, Math.ceil((p / 100) * s.length) - 1)]
}

let sbx
await scenario('create', async () => {
  sbx = await Sandbox.create({ metadata: { run, role: 'main', odd: 'a b&c=d' }, envs: { FOO: 'bar' }, timeoutMs: 600_000 })
  assert(/^[a-z0-9]+$/.test(sbx.sandboxId), 'sandbox id ' + sbx.sandboxId)
  assert(await sbx.isRunning(), 'isRunning')
})
if (!sbx) {
  console.log('FAIL: no sandbox, nothing more to run')
  process.exit(1)
}

await scenario('commands.run', async () => {
  const r = await sbx.commands.run('echo hello; echo oops >&2')
  eq(r.stdout, 'hello\n', 'stdout')
  eq(r.stderr, 'oops\n', 'stderr')
  eq(r.exitCode, 0, 'exit code')
})

await scenario('background+wait', async () => {
  const h = await sbx.commands.run('sleep 1; echo done', { background: true })
  assert(h.pid > 0, 'pid')
  const listed = await sbx.commands.list()
  assert(listed.some((p) => p.pid === h.pid), 'listed ' + JSON.stringify(listed))
  const r = await h.wait()
  eq(r.stdout, 'done\n', 'stdout')
  const k = await sbx.commands.run('sleep 60', { background: true })
  eq(await k.kill(), true, 'kill')
  const e = await rejects(k.wait(), CommandExitError, 'wait after kill')
  eq(e.exitCode, -1, 'killed exit code')
})

await scenario('onStdout', async () => {
  const chunks = []
  const t0 = Date.now()
  const r = await sbx.commands.run('for i in 1 2 3; do echo line$i; sleep 1; done', {
    onStdout: (d) => chunks.push([Date.now() - t0, d]),
  })
  eq(r.stdout, 'line1\nline2\nline3\n', 'stdout')
  assert(chunks.length >= 2, 'chunks ' + JSON.stringify(chunks))
  assert(chunks[0][1].startsWith('line1') && chunks[0][0] < Date.now() - t0 - 1500, 'first line streamed early: ' + JSON.stringify(chunks))
})

await scenario('stdin', async () => {
  const h = await sbx.commands.run('cat; echo end', { background: true, stdin: true })
  await sbx.commands.sendStdin(h.pid, 'abc\n')
  await sbx.commands.closeStdin(h.pid)
  const r = await h.wait()
  eq(r.stdout, 'abc\nend\n', 'stdout')
})

await scenario('envs+cwd+user', async () => {
  eq((await sbx.commands.run('echo $FOO $BAR', { envs: { BAR: 'baz' } })).stdout, 'bar baz\n', 'envs')
  eq((await sbx.commands.run('pwd', { cwd: '/tmp' })).stdout, '/tmp\n', 'cwd')
  eq((await sbx.commands.run('whoami; pwd')).stdout, 'user\n/home/user\n', 'default user')
  eq((await sbx.commands.run('whoami', { user: 'root' })).stdout, 'root\n', 'root')
})

await scenario('timeout', async () => {
  const t0 = Date.now()
  await rejects(sbx.commands.run('sleep 30', { timeoutMs: 2000 }), TimeoutError, 'sleep 30 with a 2 s timeout')
  assert(Date.now() - t0 < 15000, 'timed out late')
})

await scenario('exit-code', async () => {
  const e = await rejects(sbx.commands.run('echo partial; exit 3'), CommandExitError, 'exit 3')
  eq(e.exitCode, 3, 'exit code')
  eq(e.stdout, 'partial\n', 'stdout')
})

await scenario('files', async () => {
  await sbx.files.write('/home/user/hello.txt', 'hello there')
  eq(await sbx.files.read('/home/user/hello.txt'), 'hello there', 'text read back')
  await sbx.files.write('rel.txt', 'relative')
  eq((await sbx.commands.run('cat ~/rel.txt; echo; stat -c %U ~/rel.txt')).stdout, 'relative\nuser\n', 'relative path, owner')
  await sbx.files.write([
    { path: '/tmp/multi/a.txt', data: 'A' },
    { path: '/tmp/multi/b.txt', data: 'B' },
  ])
  eq((await sbx.commands.run('cat /tmp/multi/a.txt /tmp/multi/b.txt')).stdout, 'AB', 'several files per request')
  const big = crypto.randomBytes(20 << 20)
  const t0 = Date.now()
  await sbx.files.write('/home/user/big.bin', big)
  const t1 = Date.now()
  const back = Buffer.from(await sbx.files.read('/home/user/big.bin', { format: 'bytes' }))
  console.log(`  20 MiB: write ${t1 - t0} ms, read ${Date.now() - t1} ms`)
  eq(back.length, big.length, '20 MiB length')
  eq(sha(back), sha(big), '20 MiB sha256')
  eq((await sbx.commands.run('sha256sum /home/user/big.bin | cut -d" " -f1')).stdout.trim(), sha(big), 'sha256 in the guest')
  await rejects(sbx.files.read('/home/user/nope.txt'), FileNotFoundError, 'read of a missing file')
})

await scenario('files-ops', async () => {
  eq(await sbx.files.makeDir('/home/user/d/e'), true, 'makeDir')
  eq(await sbx.files.makeDir('/home/user/d/e'), false, 'makeDir again')
  await sbx.files.write('/home/user/d/a.txt', 'a')
  const names = (await sbx.files.list('/home/user/d')).map((e) => `${e.name}:${e.type}`).sort()
  eq(JSON.stringify(names), JSON.stringify(['a.txt:file', 'e:dir']), 'list')
  const deep = (await sbx.files.list('/home/user/d', { depth: 2 })).map((e) => e.path).sort()
  eq(JSON.stringify(deep), JSON.stringify(['/home/user/d/a.txt', '/home/user/d/e']), 'list depth 2')
  eq(await sbx.files.exists('/home/user/d/a.txt'), true, 'exists')
  const info = await sbx.files.rename('/home/user/d/a.txt', '/home/user/d/e/b.txt')
  eq(info.path, '/home/user/d/e/b.txt', 'rename answer')
  eq(await sbx.files.exists('/home/user/d/a.txt'), false, 'exists after rename')
  const st = await sbx.files.getInfo('/home/user/d/e/b.txt')
  eq(st.size, 1, 'size')
  eq(st.owner, 'user', 'owner')
  await sbx.files.remove('/home/user/d')
  eq(await sbx.files.exists('/home/user/d'), false, 'exists after remove')
})

await scenario('watchDir', async () => {
  await sbx.files.makeDir('/home/user/w')
  const events = []
  const h = await sbx.files.watchDir('/home/user/w', (ev) => events.push(ev), { timeoutMs: 60000 })
  await sbx.files.write('/home/user/w/new.txt', 'x')
  await until('a create event', () => events.some((e) => e.name === 'new.txt' && e.type === 'create'))
  await h.stop()
})

await scenario('getHost', async () => {
  await sbx.files.write('/home/user/www/hello.html', 'served from the sandbox')
  await sbx.commands.run('python3 -m http.server 8000 --directory /home/user/www', { background: true, timeoutMs: 0 })
  const url = `${scheme}://${sbx.getHost(8000)}/hello.html`
  const text = await until('the sandbox server', async () => {
    const r = await fetch(url)
    return r.ok ? r.text() : undefined
  }, 180_000)
  eq(text, 'served from the sandbox', 'body from ' + url)
})

let forks = []
await scenario('fork', async () => {
  await sbx.files.write('/home/user/state.txt', 'before fork')
  const res = await sbx.fork({ count: 3, timeoutMs: 600_000, ...slow })
  eq(res.length, 3, 'forks')
  for (const f of res) {
    if (f instanceof Error) throw f
    forks.push(f)
  }
  await sbx.files.write('/home/user/state.txt', 'source moved on')
  for (const [i, f] of forks.entries()) {
    assert(f.sandboxId !== sbx.sandboxId, 'a new id')
    eq(await f.files.read('/home/user/state.txt'), 'before fork', `fork ${i} state`)
    await f.files.write('/home/user/mine.txt', String(i))
  }
  for (const [i, f] of forks.entries()) {
    eq(await f.files.read('/home/user/mine.txt'), String(i), `fork ${i} own file`)
  }
  eq(await sbx.files.exists('/home/user/mine.txt'), false, 'the source untouched')
})

await scenario('list', async () => {
  const mine = await Sandbox.list({ query: { metadata: { run } } }).nextItems()
  const ids = mine.map((s) => s.sandboxId)
  assert(ids.includes(sbx.sandboxId), 'main listed: ' + ids)
  for (const f of forks) assert(ids.includes(f.sandboxId), 'fork listed')
  // Forks carry their source's metadata: all four have run and odd.
  const odd = await Sandbox.list({ query: { metadata: { run, odd: 'a b&c=d' } } }).nextItems()
  eq(JSON.stringify(odd.map((s) => s.sandboxId).sort()), JSON.stringify([...ids].sort()), 'metadata with & and = and spaces')
  const near = await Sandbox.list({ query: { metadata: { run, odd: 'a b&c=e' } } }).nextItems()
  eq(near.length, 0, 'a value that differs in its last character')
  const none = await Sandbox.list({ query: { metadata: { run, role: 'nope' } } }).nextItems()
  eq(none.length, 0, 'no match')
  if (ids.length >= 2) {
    const p = Sandbox.list({ query: { metadata: { run } }, limit: 1 })
    const first = await p.nextItems()
    eq(first.length, 1, 'page of one')
    assert(p.hasNext, 'a next page')
    const second = await p.nextItems()
    eq(second.length, 1, 'second page')
    assert(second[0].sandboxId !== first[0].sandboxId, 'pages differ')
  }
})

await scenario('setTimeout', async () => {
  const f = forks.pop()
  assert(f, 'a fork to expire')
  await f.setTimeout(3000)
  await until('expiry', async () => !(await f.isRunning()), 30000)
  await rejects(Sandbox.getInfo(f.sandboxId), SandboxNotFoundError, 'getInfo after expiry')
  eq(await Sandbox.kill(f.sandboxId), false, 'kill after expiry')
})

await scenario('pause+connect', async () => {
  await sbx.files.write('/home/user/paused.txt', 'kept')
  const h = await sbx.commands.run('sleep 1000', { background: true, timeoutMs: 0 })
  eq(await sbx.pause(slow), true, 'pause')
  eq(await sbx.pause(slow), false, 'pause again')
  eq((await Sandbox.getInfo(sbx.sandboxId)).state, 'paused', 'state')
  eq(await sbx.isRunning(), false, 'isRunning while paused')
  const again = await Sandbox.connect(sbx.sandboxId, slow)
  eq(again.sandboxId, sbx.sandboxId, 'the same id')
  eq(await again.files.read('/home/user/paused.txt'), 'kept', 'file kept')
  const ps = await again.commands.list()
  assert(ps.some((p) => p.pid === h.pid), 'process kept: ' + JSON.stringify(ps))
  // The instance's own tokens still work.
  eq((await sbx.commands.run('cat /home/user/paused.txt')).stdout, 'kept', 'old instance')
  eq((await Sandbox.getInfo(sbx.sandboxId)).state, 'running', 'state after connect')
})

await scenario('kill', async () => {
  for (const f of forks) eq(await f.kill(), true, 'kill fork')
  eq(await sbx.kill(), true, 'kill')
  eq(await Sandbox.kill(sbx.sandboxId), false, 'kill again')
  await rejects(sbx.commands.run('true'), SandboxNotFoundError, 'run in a killed sandbox')
})

let ci
await scenario('runCode', async () => {
  ci = await CodeInterpreter.create({ metadata: { run, role: 'ci' }, timeoutMs: 600_000 })
  await ci.runCode('x = 41')
  const r = await ci.runCode('x + 1')
  eq(r.text, '42', 'state kept')
  const out = []
  const p = await ci.runCode('print("hi")', { onStdout: (m) => out.push(m.line) })
  eq(p.logs.stdout.join(''), 'hi\n', 'stdout')
  eq(out.join(''), 'hi\n', 'onStdout')
  const ctx = await ci.createCodeContext()
  await ci.runCode('x = 1', { context: ctx })
  eq((await ci.runCode('x', { context: ctx })).text, '1', 'a context of its own')
  eq((await ci.runCode('x')).text, '41', 'the default context')
})

await scenario('runCode-error', async () => {
  const r = await ci.runCode('def f():\n    return 1 / 0\nf()')
  assert(r.error, 'an error')
  eq(r.error.name, 'ZeroDivisionError', 'name')
  eq(r.error.value, 'division by zero', 'value')
  assert(r.error.traceback.includes('ZeroDivisionError') && r.error.traceback.includes('return 1 / 0'), 'traceback ' + r.error.traceback)
})

await scenario('runCode-png', async () => {
  const r = await ci.runCode('import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.title("forkd")\nplt.show()', { timeoutMs: 300_000 })
  eq(r.error, undefined, 'error')
  const png = r.results.find((x) => x.png)
  assert(png, 'a png result: ' + JSON.stringify(r.results.map((x) => x.formats())))
  assert(Buffer.from(png.png, 'base64').subarray(0, 4).equals(Buffer.from([0x89, 0x50, 0x4e, 0x47])), 'PNG magic')
})

// measure times, through the E2B SDK and (with FORKD_NATIVE_SDK) through
// forkd's own TypeScript SDK over REST v1 in the same run, taking turns call
// by call so that a shared machine's drifting load weighs on both alike:
// Sandbox.create to the first output of commands.run('echo'), then
// commands.run('true') and runCode('1+1') round trips in one sandbox each.
async function measure(n) {
  const faces = {
    e2b: {
      create: () => Sandbox.create({ metadata: { run, role: 'measure' }, timeoutMs: 600_000 }),
      python: async () => ci,
    },
  }
  let ctl
  if (process.env.FORKD_NATIVE_SDK) {
    const native = await import(process.env.FORKD_NATIVE_SDK)
    ctl = new native.Controller({ url: process.env.FORKD_NATIVE_URL, token: process.env.FORKD_NATIVE_TOKEN, env: {} })
    const opts = { controller: ctl, metadata: { run, role: 'measure' }, timeoutMs: 600_000 }
    faces.forkd = {
      create: () => native.Sandbox.create(process.env.FORKD_NATIVE_BASE || 'base', opts),
      python: () => native.Sandbox.create(process.env.FORKD_NATIVE_PYTHON || 'code-interpreter', opts),
    }
  }
  const m = {}
  const add = (face, what, ms) => ((m[face] ??= {})[what] ??= []).push(ms)
  for (let i = 0; i < n; i++) {
    for (const [face, f] of Object.entries(faces)) {
      const t0 = performance.now()
      const s = await f.create()
      let first = 0
      const r = await s.commands.run('echo hi', { onStdout: () => { first = first || performance.now() } })
      eq(r.stdout, 'hi\n', `${face} echo`)
      add(face, 'create_to_first_output_ms', first - t0)
      await s.kill()
    }
  }
  const sbs = {}
  for (const [face, f] of Object.entries(faces)) sbs[face] = { s: await f.create(), py: await f.python() }
  for (let i = 0; i < 3 * n + 3; i++) {
    for (const [face, { s, py }] of Object.entries(sbs)) {
      let t0 = performance.now()
      await s.commands.run('true')
      const tRun = performance.now() - t0
      t0 = performance.now()
      const r = await py.runCode('1+1')
      const tCode = performance.now() - t0
      eq(r.text, '2', `${face} runCode 1+1`)
      // The E2B SDK runs a command as /bin/bash -l -c CMD, forkd's as
      // /bin/sh -c CMD: the same login shell through forkd's SDK tells
      // the shell's cost from the wire's.
      let tLogin
      if (face !== 'e2b') {
        t0 = performance.now()
        await s.commands.run('/bin/bash -l -c true')
        tLogin = performance.now() - t0
      }
      if (i < 3) continue // warm-up
      add(face, 'run_true_ms', tRun)
      add(face, 'run_code_ms', tCode)
      if (tLogin !== undefined) add(face, 'run_bash_login_true_ms', tLogin)
    }
  }
  for (const { s, py } of Object.values(sbs)) {
    await s.kill()
    if (py !== ci) await py.kill()
  }
  ctl?.close()
  const summary = {}
  for (const [face, ms] of Object.entries(m)) {
    summary[face] = {}
    for (const [k, xs] of Object.entries(ms)) {
      summary[face][k] = { n: xs.length, p50: Math.round(percentile(xs, 50)), p90: Math.round(percentile(xs, 90)) }
    }
  }
  return summary
}

if (process.env.FORKD_E2B_MEASURE && ci) {
  await scenario('measure', async () => {
    console.log('measure ' + JSON.stringify(await measure(Number(process.env.FORKD_E2B_MEASURE))))
  })
}

if (ci) await ci.kill()
process.exit(failed ? 1 : 0)
