"""Parallel evaluation: one candidate solution, ten inputs, ten sandboxes.

Forks N sandboxes (default 10) from a warm Python snapshot in one call, gives
each its own input, runs the solution in each at once, and gathers the
results. Every answer is checked twice, against a second method run in the
sandbox's warm interpreter and against this host's own computation, so the
example fails loudly when anything is off. Usage: run [N]
"""

import argparse
import concurrent.futures as cf
import json
import time
from typing import Dict, List

from example import check, say, snapshot
from forkd import Controller, Sandbox

# The program under evaluation, as an agent would have written it.
SOLUTION = """\
import json, sys

def count_primes(n):
    if n < 3:
        return 0
    sieve = bytearray([1]) * n
    sieve[0] = sieve[1] = 0
    for i in range(2, int(n ** 0.5) + 1):
        if sieve[i]:
            sieve[i * i::i] = bytearray(len(range(i * i, n, i)))
    return sum(sieve)

n = json.load(open(sys.argv[1]))["n"]
print(json.dumps({"n": n, "primes": count_primes(n)}))
"""

# A slower, independent method, run in the sandbox's warm interpreter.
TRIAL_DIVISION = "import math\nsum(1 for k in range(2, {n}) if all(k % d for d in range(2, math.isqrt(k) + 1)))"


def primes_below(n: int) -> int:
    return sum(1 for k in range(2, n) if all(k % d for d in range(2, int(k ** 0.5) + 1)))


def evaluate(sbx: Sandbox, n: int) -> Dict[str, object]:
    start = time.monotonic()
    sbx.files.write("/root/solution.py", SOLUTION)
    sbx.files.write("/root/input.json", json.dumps({"n": n}))
    out = json.loads(sbx.commands.run("python3 /root/solution.py /root/input.json", timeout=600).stdout)
    second = sbx.run_code(TRIAL_DIVISION.format(n=n), timeout=600)
    if second.error is not None:
        raise RuntimeError(f"run_code in {sbx.id}: {second.error.name}: {second.error.value}")
    host = sbx.commands.run("hostname").stdout.strip()
    return {"n": n, "primes": out["primes"], "check": int(second.text or "-1"),
            "host": host, "id": sbx.id, "ms": round((time.monotonic() - start) * 1000)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("n", nargs="?", type=int, default=10, help="sandboxes to fan out to (1-100)")
    args = ap.parse_args()
    if not 1 <= args.n <= 100:
        ap.error(f"N = {args.n}: want 1 to 100")

    c = Controller()
    tag = snapshot(c, "example-py", "python")
    inputs = [500 * (i + 1) for i in range(args.n)]

    say(f"forking {args.n} sandboxes of {tag}")
    res = c.create_sandboxes(tag, args.n, timeout_secs=900, metadata={"example": "parallel-eval"})
    kids: List[Sandbox] = [Sandbox(s.id, c, record=s) for s in res.sandboxes]
    try:
        check(len(kids) == args.n and not res.failed, f"forked {len(kids)} of {args.n}: {res.failed}")
        say(f"{len(kids)} ready in {res.wall_ms:.0f} ms; evaluating")
        with cf.ThreadPoolExecutor(max_workers=len(kids)) as pool:
            results = list(pool.map(evaluate, kids, inputs))
        say(f"{'n':>6} {'primes':>7} {'check':>6} {'ms':>6}  sandbox")
        for r in results:
            say(f"{r['n']:>6} {r['primes']:>7} {r['check']:>6} {r['ms']:>6}  {r['id']}")
            want = primes_below(int(r["n"]))
            check(r["primes"] == want, f"n={r['n']}: solution says {r['primes']}, want {want}")
            check(r["check"] == want, f"n={r['n']}: trial division in the sandbox says {r['check']}, want {want}")
            check(r["host"] == r["id"], f"{r['id']} calls itself {r['host']}")
        check(len({r["id"] for r in results}) == args.n, "two inputs ran in one sandbox")
        say(f"ok: {args.n} inputs evaluated in {args.n} sandboxes, every answer right")
    finally:
        for k in kids:
            k.kill()


if __name__ == "__main__":
    main()
