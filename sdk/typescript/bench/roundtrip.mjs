// Round trips through the SDK: sbx.commands.run('true') in a minimal
// sandbox and sbx.runCode('1+1') in a python one, N calls each after a
// warm-up, over the unix socket and over TCP. Prints JSON (milliseconds).
//
//   npm run build && node bench/roundtrip.mjs            # starts its own daemon (FORKD_BIN or bin/forkd)
//   FORKD_URL=… BENCH_MINIMAL=tag BENCH_PYTHON=tag node bench/roundtrip.mjs   # an existing daemon and snapshots
//
// BENCH_N (default 30) calls per measure, BENCH_WARMUP (default 3).

import { cpus, loadavg } from 'node:os'

import { Controller, Sandbox } from '../dist/index.js'
import { startDaemon } from '../test/daemon.mjs'

const N = Number(process.env.BENCH_N || 30)
const WARMUP = Number(process.env.BENCH_WARMUP || 3)

function stats(ms) {
  const s = [...ms].sort((a, b) => a - b)
  const q = (p) => s[Math.min(s.length - 1, Math.ceil(p * s.length) - 1)]
  const r = (x) => Math.round(x * 100) / 100
  return { n: s.length, p50: r(q(0.5)), p90: r(q(0.9)), min: r(s[0]), max: r(s.at(-1)), mean: r(s.reduce((a, b) => a + b, 0) / s.length) }
}

async function measure(fn) {
  for (let i = 0; i < WARMUP; i++) await fn()
  const ms = []
  for (let i = 0; i < N; i++) {
    const t = performance.now()
    await fn()
    ms.push(performance.now() - t)
  }
  return stats(ms)
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
    await Promise.all([
      first.buildSnapshot({ tag: minTag, image: 'minimal' }),
      first.buildSnapshot({ tag: pyTag, image: 'python' }),
    ])
  }
  const sbx = await Sandbox.create(minTag, { controller: first, timeoutMs: 0 })
  made.push(sbx)
  const py = await Sandbox.create(pyTag, { controller: first, timeoutMs: 0 })
  made.push(py)
  for (const [name, opts] of targets) {
    const ctl = new Controller(opts)
    const s = await Sandbox.connect(sbx.sandboxId, { controller: ctl })
    const p = await Sandbox.connect(py.sandboxId, { controller: ctl })
    out.transports[name] = {
      commands_run_true: await measure(() => s.commands.run('true')),
      run_code_1_plus_1: await measure(async () => {
        const e = await p.runCode('1+1')
        if (e.text !== '2') throw new Error(`runCode('1+1') = ${e.text}`)
      }),
      ping: await measure(() => s.ping()),
    }
    ctl.close()
  }
} finally {
  for (const s of made) await s.kill().catch(() => {})
  first.close()
  await daemon?.stop()
}
out.loadavg_after = loadavg().map((x) => Math.round(x * 100) / 100)
console.log(JSON.stringify(out, null, 2))
