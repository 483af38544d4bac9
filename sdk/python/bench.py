#!/usr/bin/env python3
"""Round trips through the Python SDK, printed as JSON: commands.run('true')
and run_code('1+1') (and the Controller calls under them, and a
get_sandbox that does not reach the guest), p50/p90 over n calls after a
warm-up.

    python3 sdk/python/bench.py --sandbox SB --python-sandbox SB2 [--socket S | --url U] [-n 30]
    python3 sdk/python/bench.py --start-daemon     # its own forkd serve and snapshots (root)

The Go client's numbers for the same calls come from e2e's
TestPythonSDKBench (FORKD_SDK_BENCH=1), which runs this script beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from forkd import Controller, Sandbox  # noqa: E402


def quantile(xs: List[float], q: float) -> float:
    s = sorted(xs)
    i = min(len(s) - 1, max(0, int(q * (len(s) - 1) + 0.5)))  # nearest rank, halves up (as the Go side)
    return s[i]


def measure(fn: Callable[[], Any], n: int, warmup: int = 3, samples: bool = False) -> Dict[str, Any]:
    for _ in range(warmup):
        fn()
    ms: List[float] = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t0) * 1000)
    out: Dict[str, Any] = {
        "p50_ms": round(quantile(ms, 0.5), 2),
        "p90_ms": round(quantile(ms, 0.9), 2),
        "mean_ms": round(statistics.mean(ms), 2),
        "min_ms": round(min(ms), 2),
        "max_ms": round(max(ms), 2),
    }
    if samples:
        out["samples_ms"] = [round(x, 3) for x in ms]
    return out


def run(c: Controller, sandbox: Optional[str], py_sandbox: Optional[str], n: int, warmup: int = 3, samples: bool = False) -> Dict[str, Any]:
    out: Dict[str, Any] = {"n": n, "url": c.url, "python": platform.python_version(), "results": {}}
    res = out["results"]
    if sandbox:
        sbx = Sandbox.connect(sandbox, controller=c)
        out["sandbox"] = sandbox
        res["commands.run('true')"] = measure(lambda: sbx.commands.run("true"), n, warmup, samples)
        res["controller.exec(['true'])"] = measure(lambda: c.exec(sandbox, ["true"]), n, warmup, samples)
        res["controller.get_sandbox (no guest)"] = measure(lambda: c.get_sandbox(sandbox), n, warmup, samples)
    if py_sandbox:
        pyx = Sandbox.connect(py_sandbox, controller=c)
        out["python_sandbox"] = py_sandbox
        res["run_code('1+1')"] = measure(lambda: pyx.run_code("1+1"), n, warmup, samples)
        res["controller.eval('1+1')"] = measure(lambda: c.eval(py_sandbox, "1+1"), n, warmup, samples)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url")
    ap.add_argument("--socket")
    ap.add_argument("--sandbox", help="sandbox for commands.run")
    ap.add_argument("--python-sandbox", help="sandbox of a python snapshot for run_code")
    ap.add_argument("-n", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3, help="calls before timing")
    ap.add_argument("--samples", action="store_true", help="also print every call's time")
    ap.add_argument("--start-daemon", action="store_true", help="start forkd serve (bin/forkd) with minimal and python snapshots")
    a = ap.parse_args()
    if a.start_daemon:
        sys.path.insert(0, os.path.join(HERE, "tests"))
        from daemon_fixture import Daemon

        d = Daemon("--pool", "1")
        try:
            with d.controller() as c:
                ops = [d.build("bench-min", "minimal"), d.build("bench-py", "python")]
                for op in ops:
                    c.wait_operation(op, timeout=900)
                sb = c.create_sandbox("bench-min").id
                py = c.create_sandbox("bench-py").id
                print(json.dumps(run(c, sb, py, a.n, a.warmup, a.samples), indent=2))
        finally:
            d.stop()
        return 0
    if not a.sandbox and not a.python_sandbox:
        ap.error("give --sandbox and/or --python-sandbox, or --start-daemon")
    with Controller(url=a.url, socket=a.socket) as c:
        print(json.dumps(run(c, a.sandbox, a.python_sandbox, a.n, a.warmup, a.samples), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
