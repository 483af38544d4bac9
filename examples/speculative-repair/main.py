"""Speculative repair: set up once, branch, try three fixes at once, keep
the one whose tests pass.

A sandbox gets a small project with a failing test and some warm state in
its interpreter (the expensive part of an agent's setup). It is branched
into a snapshot; three sandboxes fork from that snapshot, each with the
project and the interpreter state as they were, and each tries a different
fix. The fix whose tests pass is applied to the first sandbox; the others
are thrown away. The example checks that the forks saw the setup, that
exactly the right fix passed, and that no fix leaked into another sandbox.
Usage: run [--keep]
"""

import argparse
import concurrent.futures as cf
import secrets
import time
from typing import Dict, List, Tuple

from example import check, say, snapshot
from forkd import CommandExitException, Controller, Sandbox

STATS = """\
def median(xs):
    xs = list(xs)
    return xs[len(xs) // 2]
"""

TESTS = """\
import unittest
from stats import median

class MedianTest(unittest.TestCase):
    def test_odd(self):
        self.assertEqual(median([3, 1, 2]), 2)

    def test_even(self):
        self.assertEqual(median([4, 1, 3, 2]), 2.5)

    def test_one(self):
        self.assertEqual(median([7]), 7)

if __name__ == "__main__":
    unittest.main()
"""

# Three candidate fixes, as three attempts of an agent would produce them.
FIXES = {
    "sort": """\
def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]
""",
    "sort-and-average": """\
def median(xs):
    xs = sorted(xs)
    mid = len(xs) // 2
    if len(xs) % 2:
        return xs[mid]
    return (xs[mid - 1] + xs[mid]) / 2
""",
    "average-unsorted": """\
def median(xs):
    xs = list(xs)
    mid = len(xs) // 2
    return (xs[mid - 1] + xs[mid]) / 2 if len(xs) % 2 == 0 else xs[mid]
""",
}
RIGHT = "sort-and-average"
TEST_CMD = "cd /root/proj && python3 -m unittest -q test_stats"
# A fresh python3 is quick with KVM; under TCG on a busy host it can take
# minutes, so the commands here get a generous timeout.


def tests_pass(sbx: Sandbox) -> Tuple[bool, str]:
    try:
        r = sbx.commands.run(TEST_CMD, timeout=600)
        return True, r.stderr
    except CommandExitException as e:
        return False, e.stderr


def attempt(sbx: Sandbox, name: str, token: str) -> Dict[str, object]:
    seen = sbx.run_code("SETUP_TOKEN").text
    before = sbx.files.read("/root/proj/stats.py")
    sbx.files.write("/root/proj/stats.py", FIXES[name])
    ok, log = tests_pass(sbx)
    return {"fix": name, "id": sbx.id, "passed": ok, "setup_seen": seen == repr(token),
            "started_buggy": before == STATS, "log": log.strip().splitlines()[-1:] if log else []}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", action="store_true", help="leave the repaired sandbox running")
    args = ap.parse_args()

    c = Controller()
    tag = snapshot(c, "example-py", "python")
    token = secrets.token_hex(8)
    parent = Sandbox.create(template=tag, timeout=900, metadata={"example": "speculative-repair"})
    kids: List[Sandbox] = []
    branch_tag = ""
    try:
        say(f"setting up {parent.id}")
        parent.files.write("/root/proj/stats.py", STATS)
        parent.files.write("/root/proj/test_stats.py", TESTS)
        ok, log = tests_pass(parent)
        check(not ok, "the tests pass before any fix")
        say(f"  tests fail as expected: {log.strip().splitlines()[-1]}")
        setup = parent.run_code(f"import sys\nsys.path.insert(0, '/root/proj')\nimport stats\nSETUP_TOKEN = {token!r}")
        check(setup.error is None, f"setup in the interpreter: {setup.error}")

        start = time.monotonic()
        snap = parent.branch(tag=f"repair-{parent.id}")
        branch_tag = snap.tag
        say(f"branched into {snap.tag} in {(time.monotonic() - start) * 1000:.0f} ms")
        res = c.create_sandboxes(snap.tag, len(FIXES), timeout_secs=900, metadata={"example": "speculative-repair"})
        kids = [Sandbox(s.id, c, record=s) for s in res.sandboxes]
        check(len(kids) == len(FIXES) and not res.failed, f"forked {len(kids)} of {len(FIXES)}: {res.failed}")

        with cf.ThreadPoolExecutor(max_workers=len(kids)) as pool:
            results = list(pool.map(attempt, kids, FIXES, [token] * len(kids)))
        for r in results:
            say(f"  {r['fix']:<18} {'PASS' if r['passed'] else 'fail'}  {r['id']}  {' '.join(r['log'])}")
            check(r["setup_seen"], f"{r['id']} did not see the interpreter state set before the branch")
            check(r["started_buggy"], f"{r['id']} did not start from the project as set up")
        passed = [r for r in results if r["passed"]]
        check([r["fix"] for r in passed] == [RIGHT], f"fixes that passed: {[r['fix'] for r in passed]}, want [{RIGHT}]")

        # The attempts ran in their own sandboxes: the first is untouched.
        check(parent.files.read("/root/proj/stats.py") == STATS, "a fix leaked into the first sandbox")
        winner = next(k for k in kids if k.id == passed[0]["id"])
        parent.files.write("/root/proj/stats.py", winner.files.read("/root/proj/stats.py"))
        ok, log = tests_pass(parent)
        check(ok, f"the winning fix fails in the first sandbox: {log}")
        say(f"ok: kept {RIGHT}; {parent.id} passes its tests")
    finally:
        for k in kids:
            k.kill()
        if branch_tag:
            try:
                c.delete_snapshot(branch_tag)
            except Exception as e:  # do not hide the error that got us here
                say(f"could not remove {branch_tag}: {e}")
        if args.keep:
            say(f"left {parent.id} running (forkd kill {parent.id})")
        else:
            parent.kill()


if __name__ == "__main__":
    main()
