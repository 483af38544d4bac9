"""The SDK against a real `forkd serve` and real children.

One daemon, one snapshot of the `minimal` image (most tests) and one of
`python` (run_code), shared by every test here; a second short-lived
daemon with --max-sandboxes 1 for the 429 test.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import tempfile
import threading
import time
import unittest
from typing import List, Optional

from daemon_fixture import Daemon, log, require_vm, unavailable

from forkd import (
    AlreadyExistsError,
    AsyncSandbox,
    CommandExitException,
    CommandTimeoutError,
    Controller,
    FailedPreconditionError,
    FileType,
    ForkdError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    Sandbox,
    UnauthenticatedError,
    UnimplementedError,
)

D: Optional[Daemon] = None
MIN = "pysdk-min"
PY = "pysdk-py"
PY_ERROR: Optional[str] = None  # why there is no python snapshot
PROGRESS: List[str] = []


def _wait_build(c: Controller, tag: str, image: str, op: str, progress: Optional[List[str]] = None) -> None:
    """Waits for a snapshot build; one that failed is built again once. A
    parent VM on a machine loaded far past its cores can miss its boot
    deadline: that is the daemon's limit, not what these tests test."""
    assert D is not None
    try:
        c.wait_operation(op, progress=progress.append if progress is not None else None, timeout=900)
        return
    except ForkdError as e:
        log(f"snapshot {tag} failed ({e}); building it once more")
    try:
        c.delete_snapshot(tag)
    except ForkdError:
        pass
    if progress is not None:
        progress.clear()
    c.wait_operation(D.build(tag, image), progress=progress.append if progress is not None else None, timeout=900)


def setUpModule() -> None:
    global D, PY_ERROR
    require_vm()
    t0 = time.monotonic()
    D = Daemon("--pool", "1")
    c = D.controller()
    try:
        op_min = D.build(MIN, "minimal")
        op_py = None
        if os.geteuid() == 0:
            op_py = D.build(PY, "python")  # debootstrap: root only
        else:
            PY_ERROR = "the python image is built with debootstrap, as root"
        _wait_build(c, MIN, "minimal", op_min, PROGRESS)
        log(f"snapshot {MIN} ready after {time.monotonic() - t0:.1f}s")
        if op_py is not None:
            try:
                _wait_build(c, PY, "python", op_py)
                log(f"snapshot {PY} ready after {time.monotonic() - t0:.1f}s")
            except ForkdError as e:
                PY_ERROR = f"python snapshot: {e}"
    except BaseException:
        log("daemon output:\n" + D.output())
        D.stop()
        raise
    finally:
        c.close()


def tearDownModule() -> None:
    if D is not None:
        D.stop()


def need_python() -> None:
    if PY_ERROR:
        unavailable(PY_ERROR)


class ControllerTest(unittest.TestCase):
    """The REST operations, typed, with the error classes."""

    c: Controller
    sid: str

    @classmethod
    def setUpClass(cls) -> None:
        assert D is not None
        cls.c = D.controller()
        cls.sid = cls.c.create_sandbox(MIN, metadata={"suite": "controller"}).id

    @classmethod
    def tearDownClass(cls) -> None:
        try:
            cls.c.delete_sandbox(cls.sid)
        except NotFoundError:
            pass
        cls.c.close()

    def test_version_snapshots_operations(self) -> None:
        assert D is not None
        v = self.c.version()
        self.assertEqual(os.path.realpath(v.data_dir), os.path.realpath(D.data))
        self.assertEqual(v.api_version, "v1")
        s = self.c.get_snapshot(MIN)
        self.assertEqual((s.status, s.image, s.kind), ("ready", "minimal", "boot"))
        self.assertIsNotNone(s.created)
        self.assertIn(MIN, [x.tag for x in self.c.list_snapshots()])
        info = self.c.snapshot_info(MIN)
        self.assertEqual(info.logical_bytes, s.memory_mib << 20)
        ops = [o for o in self.c.list_operations() if o.snapshot == MIN and o.status == "succeeded"]
        self.assertEqual(len(ops), 1)
        self.assertEqual(self.c.get_operation(ops[0].id).id, ops[0].id)
        self.assertTrue(PROGRESS, "wait_operation passed no progress line")
        self.assertEqual(len(PROGRESS), ops[0].progress_lines)
        self.assertIn("openapi", self.c.openapi())
        self.assertIn("forkd_", self.c.metrics())

    def test_errors_by_class(self) -> None:
        assert D is not None
        # 400
        with self.assertRaises(InvalidArgumentError) as cm:
            self.c.exec(self.sid)  # neither args nor shell
        self.assertEqual((cm.exception.status, cm.exception.code), (400, "invalid_argument"))
        with self.assertRaises(InvalidArgumentError):
            self.c.create_snapshot("bad tag!")
        # 415: a JSON route with another Content-Type
        with self.assertRaises(InvalidArgumentError) as cm:
            self.c.transport.send("POST", "/v1/sandboxes", body=b"{}", content_type="text/plain")
        self.assertEqual(cm.exception.status, 415)
        # 401: TCP with a wrong token, then the right one (the data dir's
        # token file is sent to a loopback URL)
        with Controller(url=D.url, token="0123456789abcdef" * 2) as bad:
            with self.assertRaises(UnauthenticatedError) as cm:
                bad.list_sandboxes()
        self.assertEqual(cm.exception.status, 401)
        with Controller(url=D.url, token=D.token) as good:
            self.assertTrue(good.list_sandboxes())
        with Controller(url=D.url, data_dir=D.data) as found:
            self.assertEqual(found.transport.token, D.token)
            self.assertTrue(found.list_sandboxes())
        # 404
        with self.assertRaises(NotFoundError) as cm:
            self.c.get_sandbox("sb-aaaaaaaaaa")
        self.assertEqual((cm.exception.status, cm.exception.code), (404, "not_found"))
        with self.assertRaises(NotFoundError):
            self.c.stat(self.sid, "/no/such/file")
        # 409: in use / already exists
        with self.assertRaises(FailedPreconditionError) as cm:
            self.c.delete_snapshot(MIN)
        self.assertEqual(cm.exception.status, 409)
        with self.assertRaises(AlreadyExistsError) as cm:
            self.c.create_snapshot(MIN)
        self.assertEqual(cm.exception.status, 409)
        # 501: eval without Python
        with self.assertRaises(UnimplementedError) as cm:
            self.c.eval(self.sid, "1+1")
        self.assertEqual(cm.exception.status, 501)
        self.assertIsInstance(cm.exception, NotImplementedError)

    def test_sandbox_records(self) -> None:
        s = self.c.get_sandbox(self.sid)
        self.assertEqual((s.status, s.snapshot_tag, s.metadata), ("running", MIN, {"suite": "controller"}))
        self.assertIn(self.sid, [x.id for x in self.c.list_sandboxes(metadata={"suite": "controller"})])
        self.assertEqual(self.c.list_sandboxes(metadata={"suite": "none"}), [])
        self.assertIn(self.sid, [x.id for x in self.c.list_sandboxes(snapshot=MIN, status="running")])
        s = self.c.set_timeout(self.sid, 3600)
        self.assertIsNotNone(s.expires_at)
        s = self.c.set_timeout(self.sid, 0)
        self.assertIsNone(s.expires_at)
        p = self.c.ping(self.sid)
        self.assertEqual(p.hostname, self.sid)
        self.assertIn("processes", p.features)

    def test_exec_buffered_and_streamed(self) -> None:
        r = self.c.exec(self.sid, ["sh", "-c", "echo out; echo err >&2; exit 7"], env={"A": "1"})
        self.assertEqual((r.exit_code, r.stdout, r.stderr), (7, "out\n", "err\n"))
        r = self.c.exec(self.sid, "printf '\\377\\376'")
        self.assertEqual(r.stdout_bytes, b"\xff\xfe")
        out: List[bytes] = []
        r = self.c.exec_stream(self.sid, "echo $A; cat", env={"A": "x"}, stdin=b"in\n", on_stdout=out.append)
        self.assertEqual((r.exit_code, b"".join(out)), (0, b"x\nin\n"))
        events = list(self.c.exec_events(self.sid, ["sh", "-c", "echo a; echo b >&2"]))
        self.assertEqual(events[-1].type, "exit")
        self.assertEqual({e.type for e in events[:-1]}, {"stdout", "stderr"})

    def test_exec_stdin_full_duplex(self) -> None:
        # Each line goes in only after the previous one came back out: the
        # body is still being sent while the output streams.
        echoed = threading.Event()

        def stdin():
            for i in range(3):
                echoed.clear()
                yield f"line {i}\n".encode()
                if not echoed.wait(30):
                    raise AssertionError("no echo while stdin was still open")

        out: List[bytes] = []

        def on_out(b: bytes) -> None:
            out.append(b)
            echoed.set()

        r = self.c.exec_stream(self.sid, "cat", stdin=stdin(), on_stdout=on_out, timeout=60)
        self.assertEqual(r.exit_code, 0)
        self.assertEqual(b"".join(out), b"line 0\nline 1\nline 2\n")

    def test_files(self) -> None:
        self.assertTrue(self.c.make_dir(self.sid, "/root/ctl/a"))
        self.assertFalse(self.c.make_dir(self.sid, "/root/ctl/a"))
        w = self.c.write_file(self.sid, "/root/ctl/a/f.sh", "#!/bin/sh\necho run\n", mode=0o755)
        self.assertEqual(w.bytes, 19)
        st = self.c.stat(self.sid, "/root/ctl/a/f.sh")
        self.assertEqual((st.type, st.mode & 0o777, st.size), ("file", 0o755, 19))
        self.assertEqual(self.c.exec(self.sid, ["/root/ctl/a/f.sh"]).stdout, "run\n")
        self.c.write_file(self.sid, "/root/ctl/g", iter([b"a", b"b", b"c"]))  # chunked
        self.assertEqual(self.c.read_file(self.sid, "/root/ctl/g"), b"abc")
        self.c.rename(self.sid, "/root/ctl/g", "/root/ctl/h")
        names = sorted(e.path for e in self.c.list_dir(self.sid, "/root/ctl", depth=3))
        self.assertEqual(names, ["/root/ctl/a", "/root/ctl/a/f.sh", "/root/ctl/h"])
        with self.assertRaises(ForkdError):
            self.c.remove(self.sid, "/root/ctl")  # not empty
        self.c.remove(self.sid, "/root/ctl", recursive=True)
        with self.assertRaises(NotFoundError):
            self.c.stat(self.sid, "/root/ctl")

    def test_processes(self) -> None:
        p = self.c.start_process(self.sid, "read x; echo got $x; sleep 30", stdin_open=True, tag="t1")
        self.assertTrue(p.running)
        self.assertIn(p.pid, [x.pid for x in self.c.list_processes(self.sid)])
        self.assertEqual(self.c.get_process(self.sid, p.pid).tag, "t1")
        self.c.send_stdin(self.sid, p.pid, "hello\n", eof=True)
        seen: List[bytes] = []
        ev = self.c.process_events(self.sid, p.pid)
        for e in ev:
            seen.append(e.payload)
            if b"got hello" in b"".join(seen):
                break
        ev.close()  # type: ignore[attr-defined]
        self.c.signal_process(self.sid, p.pid, "TERM")
        r = self.c.wait_process(self.sid, p.pid, timeout=30)
        self.assertEqual(r.signal, "SIGTERM")
        q = self.c.start_process(self.sid, ["sleep", "60"])
        self.c.kill_process(self.sid, q.pid)
        r = self.c.stream_process(self.sid, q.pid)
        self.assertEqual((r.exit_code, r.signal), (-1, "SIGKILL"))
        with self.assertRaises(NotFoundError):
            self.c.get_process(self.sid, 999999)

    def test_network_and_ports(self) -> None:
        s = self.c.get_sandbox(self.sid)
        if s.network is None:
            unavailable("the snapshot has no network (the daemon does not run as root)")
        s = self.c.set_network(self.sid, "deny")
        self.assertEqual(s.network.egress if s.network else None, "deny")
        s = self.c.set_network(self.sid, "allow")
        pp = self.c.publish(self.sid, 8080)
        self.assertEqual(pp.guest_port, 8080)
        self.assertGreater(pp.host_port, 0)

    def test_workspaces(self) -> None:
        w = self.c.create_workspace("pyws", MIN)
        try:
            self.assertEqual((w.name, w.status, w.snapshot), ("pyws", "running", MIN))
            self.assertIn("pyws", [x.name for x in self.c.list_workspaces()])
            self.assertEqual(self.c.get_workspace("pyws").sandbox, w.sandbox)
            try:
                w = self.c.suspend_workspace("pyws")
            except UnimplementedError:
                log("suspend: the daemon cannot branch yet (501)")
            else:
                self.assertEqual(w.status, "suspended")
                w = self.c.resume_workspace("pyws")
                self.assertEqual(w.status, "running")
        finally:
            self.c.delete_workspace("pyws")
        with self.assertRaises(NotFoundError):
            self.c.get_workspace("pyws")


class SandboxTest(unittest.TestCase):
    """The E2B-shaped Sandbox."""

    sbx: Sandbox

    @classmethod
    def setUpClass(cls) -> None:
        assert D is not None
        cls.c = D.controller()
        cls.sbx = Sandbox.create(template=MIN, timeout=600, metadata={"suite": "e2b"}, envs={"GREETING": "hi", "WHO": "all"}, controller=cls.c)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.sbx.kill()
        cls.c.close()

    def test_info(self) -> None:
        info = self.sbx.get_info()
        self.assertEqual((info.sandbox_id, info.template_id, info.state), (self.sbx.sandbox_id, MIN, "running"))
        self.assertEqual(info.metadata, {"suite": "e2b"})
        self.assertIsNotNone(info.end_at)
        self.assertTrue(self.sbx.is_running())
        same = Sandbox.connect(self.sbx.sandbox_id, controller=self.c)
        self.assertEqual(same.commands.run("hostname").stdout.strip(), self.sbx.sandbox_id)
        self.assertIn(self.sbx.sandbox_id, [s.sandbox_id for s in Sandbox.list(metadata={"suite": "e2b"}, controller=self.c)])

    def test_run_foreground(self) -> None:
        r = self.sbx.commands.run("echo $GREETING $WHO; echo e >&2")
        self.assertEqual((r.stdout, r.stderr, r.exit_code, r.error), ("hi all\n", "e\n", 0, None))
        r = self.sbx.commands.run("echo $GREETING $WHO", envs={"WHO": "you"})
        self.assertEqual(r.stdout, "hi you\n")
        self.assertEqual(self.sbx.commands.run("pwd", cwd="/tmp").stdout, "/tmp\n")
        self.assertEqual(self.sbx.commands.run("id -u", user="root").stdout, "0\n")
        self.assertEqual(self.sbx.commands.run("cat", stdin="from stdin").stdout, "from stdin")
        self.assertEqual(self.sbx.commands.run("wc -c", stdin=io.BytesIO(b"x" * 100000)).stdout.strip(), "100000")
        got: List[str] = []
        r = self.sbx.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=got.append)
        self.assertEqual(("".join(got), r.stdout), ("1\n2\n3\n", "1\n2\n3\n"))

    def test_run_failures(self) -> None:
        with self.assertRaises(CommandExitException) as cm:
            self.sbx.commands.run("echo partial; echo bad >&2; exit 3")
        e = cm.exception
        self.assertEqual((e.exit_code, e.stdout, e.stderr, e.error), (3, "partial\n", "bad\n", "exit status 3"))
        t0 = time.monotonic()
        with self.assertRaises(CommandTimeoutError) as tm:
            self.sbx.commands.run("echo started; sleep 60", timeout=2)
        self.assertLess(time.monotonic() - t0, 30)
        self.assertEqual(tm.exception.result.stdout, "started\n")

    def test_run_background(self) -> None:
        h = self.sbx.commands.run("read a; echo got $a; echo warn >&2; exit 0", background=True)
        self.assertGreater(h.pid, 0)
        self.assertIn(h.pid, [p.pid for p in self.sbx.commands.list()])
        h.send_stdin("ping\n")
        r = h.wait()
        self.assertEqual((r.stdout, r.stderr, r.exit_code), ("got ping\n", "warn\n", 0))
        h = self.sbx.commands.run("for i in 1 2 3; do echo $i; sleep 0.1; done; exit 5", background=True, stdin=False)
        parts = [out for out, _, _ in h if out]
        self.assertEqual("".join(parts), "1\n2\n3\n")
        with self.assertRaises(CommandExitException) as cm:
            h.wait()
        self.assertEqual(cm.exception.exit_code, 5)
        got: List[str] = []
        h = self.sbx.commands.run("echo cb", background=True, on_stdout=got.append, stdin=False)
        self.assertEqual(h.wait().stdout, "cb\n")
        self.assertEqual(got, ["cb\n"])
        h = self.sbx.commands.run("sleep 120", background=True)
        self.assertTrue(h.kill())
        with self.assertRaises(CommandExitException) as cm:
            h.wait()
        self.assertIn("SIGKILL", cm.exception.error or "")

    def test_files_20mib_round_trip(self) -> None:
        data = os.urandom(20 << 20)
        with tempfile.TemporaryFile() as src:
            src.write(data)
            src.seek(0)
            t0 = time.monotonic()
            info = self.sbx.files.write("/root/big.bin", src)
            up = time.monotonic() - t0
        self.assertEqual((info.path, info.name, info.type), ("/root/big.bin", "big.bin", FileType.FILE))
        sha = self.sbx.commands.run("sha256sum /root/big.bin").stdout.split()[0]
        self.assertEqual(sha, hashlib.sha256(data).hexdigest())
        with tempfile.TemporaryFile() as dst:
            t0 = time.monotonic()
            n = self.sbx.files.read_to("/root/big.bin", dst)
            down = time.monotonic() - t0
            dst.seek(0)
            self.assertEqual(n, len(data))
            self.assertEqual(hashlib.sha256(dst.read()).hexdigest(), hashlib.sha256(data).hexdigest())
        log(f"20 MiB: write {up:.2f}s, read {down:.2f}s")
        self.sbx.commands.run("head -c 1000000 /root/big.bin > /root/head.bin && rm /root/big.bin")
        self.assertEqual(self.sbx.files.read("/root/head.bin", format="bytes"), data[:1000000])
        chunks = list(self.sbx.files.read("/root/head.bin", format="stream"))
        self.assertEqual(b"".join(chunks), data[:1000000])
        self.sbx.files.remove("/root/head.bin")

    def test_files_e2b_calls(self) -> None:
        f = self.sbx.files
        self.assertTrue(f.make_dir("/root/e2b/sub"))
        f.write("/root/e2b/t.txt", "héllo wörld")
        self.assertEqual(f.read("/root/e2b/t.txt"), "héllo wörld")
        self.assertEqual(f.read("/root/e2b/t.txt", format="bytes"), "héllo wörld".encode())
        self.assertTrue(f.exists("/root/e2b/t.txt"))
        self.assertFalse(f.exists("/root/e2b/none"))
        e = f.rename("/root/e2b/t.txt", "/root/e2b/sub/u.txt")
        self.assertEqual((e.name, e.type, e.permissions), ("u.txt", FileType.FILE, "rw-r--r--"))
        self.assertEqual({x.name: x.type for x in f.list("/root/e2b")}, {"sub": FileType.DIR})
        self.assertEqual(len(f.list("/root/e2b", depth=2)), 2)
        f.write_files([{"path": "/root/e2b/a", "data": b"1"}, {"path": "/root/e2b/b", "data": "2"}])
        self.assertEqual(f.read("/root/e2b/b"), "2")
        f.remove("/root/e2b")
        self.assertFalse(f.exists("/root/e2b"))
        with self.assertRaises(NotFoundError):
            f.read("/root/e2b/a")

    def test_branch_and_fork(self) -> None:
        self.sbx.files.write("/root/state.txt", "before branch")
        try:
            snap = self.sbx.branch(mode="full")
        except UnimplementedError as e:
            # A capability of the daemon's backend, not of the SDK.
            self.skipTest(f"branch: the daemon answers 501 not_implemented ({e.message})")
        assert D is not None
        D.tags.append(snap.tag)
        self.assertEqual((snap.status, snap.kind, snap.source), ("ready", "branch", self.sbx.sandbox_id))
        with Sandbox.create(template=snap.tag, controller=self.c, timeout=120) as child:
            self.assertEqual(child.files.read("/root/state.txt"), "before branch")
        kids = self.sbx.fork(2)
        try:
            self.assertEqual(len(kids), 2)
            for k in kids:
                self.assertEqual(k.envs, self.sbx.envs)
                self.assertEqual(k.files.read("/root/state.txt"), "before branch")
                self.assertEqual(k.commands.run("echo $GREETING").stdout, "hi\n")
        finally:
            for k in kids:
                k.kill()

    def test_set_timeout_and_kill(self) -> None:
        s = Sandbox.create(template=MIN, controller=self.c, timeout=0)
        self.assertIsNone(s.get_info().end_at)
        s.set_timeout(120)
        self.assertIsNotNone(s.get_info().end_at)
        self.assertTrue(s.kill())
        self.assertFalse(s.kill())
        with self.assertRaises(NotFoundError):
            Sandbox.connect(s.sandbox_id, controller=self.c)

    def test_async(self) -> None:
        async def main() -> None:
            sbx = await AsyncSandbox.connect(self.sbx.sandbox_id, controller=self.c, envs={"N": "x"})
            rs = await asyncio.gather(*[sbx.commands.run(f"echo {i}$N") for i in range(6)])
            self.assertEqual([r.stdout for r in rs], [f"{i}x\n" for i in range(6)])
            got: List[str] = []

            async def on_out(s: str) -> None:
                got.append(s)

            await sbx.commands.run("echo one; echo two", on_stdout=on_out)
            self.assertEqual("".join(got), "one\ntwo\n")
            h = await sbx.commands.run("cat", background=True)
            await h.send_stdin("async\n")
            await h.close_stdin()
            parts = [o async for o, _, _ in h if o]
            self.assertEqual("".join(parts), "async\n")
            self.assertEqual((await h.wait()).stdout, "async\n")
            await sbx.files.write("/root/async.txt", "a")
            self.assertEqual(await sbx.files.read("/root/async.txt"), "a")
            chunks = [c async for c in await sbx.files.read("/root/async.txt", format="stream")]
            self.assertEqual(chunks, [b"a"])
            with self.assertRaises(CommandExitException):
                await sbx.commands.run("exit 2")

        asyncio.run(main())


class CodeTest(unittest.TestCase):
    """run_code on the python image's warm interpreter."""

    sbx: Sandbox

    @classmethod
    def setUpClass(cls) -> None:
        need_python()
        assert D is not None
        cls.sbx = Sandbox.create(template=PY, controller=D.controller(), timeout=600)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.sbx.kill()
        cls.sbx.controller.close()

    def test_state_kept_across_calls(self) -> None:
        ex = self.sbx.run_code("x = 41")
        self.assertEqual((ex.results, ex.error), ([], None))
        ex = self.sbx.run_code("x + 1")
        self.assertEqual(ex.text, "42")
        self.assertEqual(ex.results[0].text, "42")
        ex = self.sbx.run_code("print('hello'); import sys; print('oops', file=sys.stderr); 'v'")
        self.assertEqual(("".join(ex.logs.stdout), "".join(ex.logs.stderr), ex.text), ("hello\n", "oops\n", "'v'"))
        ex = self.sbx.run_code("import numpy; float(numpy.zeros(5).sum())")
        self.assertEqual(ex.text, "0.0")
        self.assertEqual(self.sbx.eval("x * 2").value, "82")

    def test_error_traceback(self) -> None:
        ex = self.sbx.run_code("def f():\n    return 1 / 0\nf()")
        self.assertIsNotNone(ex.error)
        assert ex.error is not None
        self.assertEqual(ex.error.name, "ZeroDivisionError")
        self.assertIn("division by zero", ex.error.value)
        self.assertIn("ZeroDivisionError", ex.error.traceback)
        self.assertIn("in f", ex.error.traceback)
        self.assertEqual(self.sbx.run_code("x = 1; x").text, "1")  # still usable

    def test_streamed(self) -> None:
        got: List[str] = []
        ex = self.sbx.run_code("import time\nfor i in range(3):\n    print(i, flush=True)\n    time.sleep(0.05)\n'done'", on_stdout=got.append)
        self.assertEqual("".join(got), "0\n1\n2\n")
        self.assertEqual(ex.text, "'done'")
        self.assertEqual(ex.logs.stdout, got)


class LimitTest(unittest.TestCase):
    """429 from a daemon that admits one sandbox; the SDK retries it, then
    raises ResourceExhaustedError."""

    def test_429(self) -> None:
        d = Daemon("--max-sandboxes", "1", "--pool", "0")
        c = d.controller(max_retries=2)
        try:
            c.wait_operation(d.build("one", "minimal"), timeout=600)
            c.create_sandbox("one")
            retries: List[float] = []
            c.transport.on_retry = lambda n, delay, err: retries.append(delay)
            with self.assertRaises(ResourceExhaustedError) as cm:
                c.create_sandbox("one")
            self.assertEqual((cm.exception.status, cm.exception.code), (429, "resource_exhausted"))
            self.assertEqual(len(retries), 2)
            with self.assertRaises(InvalidArgumentError):  # n alone over the limit: 400, not retried
                c.create_sandboxes("one", 2)
        finally:
            c.close()
            d.stop()


if __name__ == "__main__":
    unittest.main()
