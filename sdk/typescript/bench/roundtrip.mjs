// Round trips through the SDK: sbx.commands.run('true') in a minimal
// sandbox and sbx.runCode('1+1') in a python one, N calls each after a
// warm-up, over the unix socket and over TCP. Prints JSON (milliseconds).
//
//   npm run build && node bench/roundtrip.mjs            # starts its own daemon (FORKD_BIN or bin/forkd)
//   FORKD_URL=… BENCH_MINIMAL=tag BENCH_PYTHON=tag node bench/roundtrip.mjs   # an existing daemon and snapshots
//
// BENCH_N (default 30) calls per measure, BENCH_WARMUP (default 3);
// BENCH_SDK_ONLY=1 runs sdk_only alone. BENCH_SANDBOX=id and
// BENCH_PYTHON_SANDBOX=id (with FORKD_URL) time those running sandboxes
// alone, one transport, and print every call's time (samples_ms): what
// e2e's TestSDKBench interleaves with the Go client and the Python SDK.
// sdk_only is the same calls against a fake daemon in this process that
// answers at once: what the SDK and Node's HTTP stacks cost.

import { mkdtempSync, rmSync } from 'node:fs'
import { createServer } from 'node:http'
import { cpus, loadavg } from 'node:os'
import { join } from 'node:path'

import { Controller, Sandbox } from '../dist/index.js'
import { buildSnapshot, startDaemon } from '../test/daemon.mjs'

const N = Number(process.env.BENCH_N || 30)
const WARMUP = Number(process.env.BENCH_WARMUP || 3)

function stats(ms) {
  const s = [...ms].sort((a, b) => a - b)
  const q = (p) => s[Math.min(s.length - 1, Math.ceil(p * s.length) - 1)]
  const r = (x) => Math.round(x * 100) / 100
  return { n: s.length, p50: r(q(0.5)), p90: r(q(0.9)), min: r(s[0]), max: r(s.at(-1)), mean: r(s.reduce((a, b) => a + b, 0) / s.length) }
}

async function measure(fn, samples = false) {
  for (let i = 0; i < WARMUP; i++) await fn()
  const ms = []
  for (let i = 0; i < N; i++) {
    const t = performance.now()
    await fn()
    ms.push(performance.now() - t)
  }
  return samples ? { ...stats(ms), samples_ms: ms.map((x) => Math.round(x * 1000) / 1000) } : stats(ms)
}

if (process.env.BENCH_SDK_ONLY === '1') {
  console.log(JSON.stringify({ n: N, warmup: WARMUP, node: process.version, sdk_only: await sdkOnly() }, null, 2))
  process.exit(0)
}

if (process.env.BENCH_SANDBOX) {
  const ctl = new Controller({})
  try {
    const results = {}
    const s = await Sandbox.connect(process.env.BENCH_SANDBOX, { controller: ctl })
    results["commands.run('true')"] = await measure(() => s.commands.run('true'), true)
    if (process.env.BENCH_PYTHON_SANDBOX) {
      const p = await Sandbox.connect(process.env.BENCH_PYTHON_SANDBOX, { controller: ctl })
      results["runCode('1+1')"] = await measure(async () => {
        const x = await p.runCode('1+1')
        if (x.text !== '2') throw new Error(`runCode('1+1') = ${x.text}`)
      }, true)
    }
    console.log(JSON.stringify({ n: N, warmup: WARMUP, node: process.version, results }, null, 2))
  } finally {
    ctl.close()
  }
  process.exit(0)
}

// measureTurns times fns taking turns: warm-up calls, then N rounds of
// one call each.
async function measureTurns(fns) {
  for (let i = 0; i < WARMUP; i++) for (const fn of fns) await fn()
  const ms = fns.map(() => [])
  for (let i = 0; i < N; i++) {
    for (const [j, fn] of fns.entries()) {
      const t = performance.now()
      await fn()
      ms[j].push(performance.now() - t)
    }
  }
  return ms.map(stats)
}

const own = !process.env.FORKD_URL && !process.env.BENCH_MINIMAL
let daemon
const targets = [] // [name, controller options]
let minTag = process.env.BENCH_MINIMAL
let pyTag = process.env.BENCH_PYTHON
if (own) {
  daemon = await startDaemon({ args: ['--pool', '0'] })
  targets.push(['unix', { url: daemon.socketUrl }], ['tcp', { url: daemon.tcpUrl, dataDir: daemon.data }])
} else {
  targets.push([process.env.FORKD_URL?.startsWith('unix:') ? 'unix' : 'default', {}])
}

const out = { n: N, warmup: WARMUP, node: process.version, cpus: cpus().length, loadavg_before: loadavg().map((x) => Math.round(x * 100) / 100), transports: {} }
const first = new Controller(targets[0][1])
const made = []
try {
  const v = await first.version()
  out.daemon = { version: v.version, backend: v.backend, accelerator: v.accelerator }
  if (!minTag || !pyTag) {
    minTag = 'bench-min'
    pyTag = 'bench-py'
    // One after the other: two parents booting at once on a loaded
    // machine can miss the agent's start-up deadline.
    await buildSnapshot(first, { tag: minTag, image: 'minimal' })
    await buildSnapshot(first, { tag: pyTag, image: 'python' })
  }
  const sbx = await Sandbox.create(minTag, { controller: first, timeoutMs: 0 })
  made.push(sbx)
  const py = await Sandbox.create(pyTag, { controller: first, timeoutMs: 0 })
  made.push(py)
  // The transports take turns call by call, so that a load that drifts
  // (a shared machine) weighs on each alike.
  const ends = []
  for (const [name, opts] of targets) {
    const ctl = new Controller(opts)
    ends.push({
      name,
      ctl,
      s: await Sandbox.connect(sbx.sandboxId, { controller: ctl }),
      p: await Sandbox.connect(py.sandboxId, { controller: ctl }),
    })
  }
  const measures = {
    commands_run_true: (e) => e.s.commands.run('true'),
    run_code_1_plus_1: async (e) => {
      const x = await e.p.runCode('1+1')
      if (x.text !== '2') throw new Error(`runCode('1+1') = ${x.text}`)
    },
    ping: (e) => e.s.ping(),
  }
  for (const e of ends) out.transports[e.name] = {}
  for (const [m, fn] of Object.entries(measures)) {
    const got = await measureTurns(ends.map((e) => () => fn(e)))
    ends.forEach((e, i) => (out.transports[e.name][m] = got[i]))
  }
  for (const e of ends) e.ctl.close()
} finally {
  for (const s of made) await s.kill().catch(() => {})
  first.close()
  await daemon?.stop()
}
out.sdk_only = await sdkOnly()
out.loadavg_after = loadavg().map((x) => Math.round(x * 100) / 100)
console.log(JSON.stringify(out, null, 2))

// sdkOnly times the calls against a fake daemon answering at once, over
// TCP (fetch) and a unix socket (node:http).
async function sdkOnly() {
  const srv = createServer((req, res) => {
    req.resume()
    req.on('end', () => {
      res.writeHead(200, { 'content-type': 'application/json' })
      if (req.url.endsWith('/exec')) res.end('{"exit_code":0,"duration_ms":1}')
      else if (req.url.endsWith('/eval')) res.end('{"value":"2","duration_ms":1}')
      else res.end('{"id":"sb-aaaaaaaaaa","snapshot_tag":"x","status":"running","pid":1,"created":"2026-01-01T00:00:00Z","ready_ms":1}')
    })
  })
  const dir = mkdtempSync('/tmp/fts-bench-')
  const res = {}
  try {
    await new Promise((r) => srv.listen(0, '127.0.0.1', r))
    const tcp = `http://127.0.0.1:${srv.address().port}`
    const unix = join(dir, 's')
    const srv2 = createServer(srv.listeners('request')[0])
    await new Promise((r) => srv2.listen(unix, r))
    for (const [name, url] of [
      ['unix', 'unix://' + unix],
      ['tcp', tcp],
    ]) {
      const ctl = new Controller({ url, token: 'bench-token-0123456789', env: {} })
      const s = await Sandbox.connect('sb-aaaaaaaaaa', { controller: ctl })
      res[name] = {
        commands_run_true: await measure(() => s.commands.run('true')),
        run_code_1_plus_1: await measure(() => s.runCode('1+1')),
      }
      ctl.close()
    }
    await new Promise((r) => srv2.close(r))
  } finally {
    await new Promise((r) => srv.close(r))
    rmSync(dir, { recursive: true, force: true })
  }
  return res
}
