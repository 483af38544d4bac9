"""The SDK without a daemon: errors, types, discovery and token rules,
the transport's retries, against small fake servers."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import unittest
from typing import Any, Dict, List, Tuple
from unittest import mock

import daemon_fixture  # noqa: F401  (puts the SDK on sys.path)
from daemon_fixture import SDK, unavailable

import forkd
from forkd import (
    Controller,
    ForkdError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
    UnimplementedError,
)
from forkd import _discover
from forkd._http import retry_after
from forkd.errors import error_for
from forkd.types import ExecResult, Sandbox, SnapshotInfo, StreamEvent, parse_time


class ErrorsTest(unittest.TestCase):
    def test_codes_and_statuses(self) -> None:
        table = {
            "not_found": (forkd.NotFoundError, 404),
            "already_exists": (forkd.AlreadyExistsError, 409),
            "invalid_argument": (forkd.InvalidArgumentError, 400),
            "failed_precondition": (forkd.FailedPreconditionError, 409),
            "resource_exhausted": (forkd.ResourceExhaustedError, 429),
            "unavailable": (forkd.UnavailableError, 503),
            "not_implemented": (forkd.UnimplementedError, 501),
            "unauthenticated": (forkd.UnauthenticatedError, 401),
            "deadline_exceeded": (forkd.DeadlineExceededError, 504),
            "internal": (forkd.InternalError, 500),
        }
        for code, (cls, status) in table.items():
            e = error_for(code, "m", status)
            self.assertIs(type(e), cls)
            self.assertEqual((e.code, e.status, e.message, str(e)), (code, status, "m", "m"))
            self.assertIsInstance(e, ForkdError)
            self.assertEqual(cls.default_status, status)
        self.assertEqual(error_for("invalid_argument", "big", 413).status, 413)
        # No code: the status decides; an unknown code keeps its name.
        self.assertIs(type(error_for(None, "x", 404)), NotFoundError)
        self.assertIs(type(error_for(None, "x", 502)), UnavailableError)
        e = error_for("brand_new", "x", 418)
        self.assertEqual((type(e), e.code), (ForkdError, "brand_new"))
        self.assertIsInstance(error_for("not_implemented", "x"), NotImplementedError)
        self.assertIs(forkd.TimeoutException, forkd.DeadlineExceededError)


class TypesTest(unittest.TestCase):
    def test_parse_time(self) -> None:
        t = parse_time("2026-12-01T13:48:44.165030872Z")
        assert t is not None
        self.assertEqual((t.year, t.microsecond, t.utcoffset().total_seconds()), (2026, 165030, 0))  # type: ignore[union-attr]
        t = parse_time("2026-12-01T13:48:44+02:00")
        assert t is not None
        self.assertEqual(t.utcoffset().total_seconds(), 7200)  # type: ignore[union-attr]
        self.assertIsNone(parse_time("0001-01-01T00:00:00Z"))
        self.assertIsNone(parse_time(""))

    def test_decode(self) -> None:
        s = Sandbox.from_dict(
            {"id": "sb-1", "created": "2026-12-01T00:00:00Z", "metadata": {"a": "b"}, "cpus": 1, "future_field": 1,
             "network": {"address": "10.0.0.2", "egress": "allow", "ports": [{"proto": "tcp", "guest_port": 80, "host_port": 9}]}}
        )
        self.assertEqual((s.id, s.metadata, s.cpus), ("sb-1", {"a": "b"}, 1.0))
        assert s.network is not None
        self.assertEqual(s.network.ports[0].host_port, 9)
        r = ExecResult.from_dict({"exit_code": 1, "stdout_b64": "//4=", "stderr": "e"})
        self.assertEqual((r.stdout_bytes, r.stderr_bytes), (b"\xff\xfe", b"e"))
        ev = StreamEvent.from_dict({"type": "exit", "exec": {"exit_code": 0, "duration_ms": 3}})
        assert ev.exec is not None
        self.assertEqual(ev.exec.duration_ms, 3)
        info = SnapshotInfo.from_dict({"tag": "t", "ancestors": ["a"], "logical_bytes": 5})
        self.assertEqual((info.tag, info.ancestors, info.logical_bytes), ("t", ["a"], 5))
        self.assertEqual(forkd.NetworkSpec(egress="deny", allow=[forkd.NetworkRule(cidr="1.1.1.1/32")]).to_dict(),
                         {"egress": "deny", "allow": [{"cidr": "1.1.1.1/32"}]})


class Recorder(http.server.BaseHTTPRequestHandler):
    """Answers from a script: a list of (status, headers, body) consumed in
    order (the last repeats); records each request."""

    protocol_version = "HTTP/1.1"
    script: List[Tuple[int, Dict[str, str], bytes]] = []
    seen: List[Dict[str, Any]] = []

    def _answer(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        if self.headers.get("Transfer-Encoding") == "chunked":
            body = b""
            while True:
                size = int(self.rfile.readline().strip(), 16)
                chunk = self.rfile.read(size + 2)[:size]
                if size == 0:
                    break
                body += chunk
        else:
            body = self.rfile.read(n)
        type(self).seen.append({"method": self.command, "path": self.path, "headers": dict(self.headers), "body": body})
        script = type(self).script
        status, headers, out = script.pop(0) if len(script) > 1 else script[0]
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = do_PUT = do_DELETE = _answer

    def log_message(self, *a: Any) -> None:
        pass


class UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self):  # type: ignore[no-untyped-def]
        conn, _ = self.socket.accept()
        return conn, ("local", 0)


def err(code: str, msg: str = "m") -> bytes:
    return json.dumps({"error": {"code": code, "message": msg}}).encode()


class FakeDaemonTest(unittest.TestCase):
    def setUp(self) -> None:
        Recorder.script, Recorder.seen = [], []
        self.tcp = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
        threading.Thread(target=self.tcp.serve_forever, daemon=True).start()
        self.dir = tempfile.mkdtemp(prefix="fpy-")
        self.sock = os.path.join(self.dir, "s")
        self.unix = UnixServer(self.sock, Recorder)
        threading.Thread(target=self.unix.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.tcp.server_address[1]}"

    def tearDown(self) -> None:
        self.tcp.shutdown()
        self.tcp.server_close()
        self.unix.shutdown()
        self.unix.server_close()
        shutil.rmtree(self.dir)

    def test_unix_socket_json_and_headers(self) -> None:
        Recorder.script = [(201, {}, json.dumps({"sandboxes": [{"id": "sb-x"}], "wall_ms": 1.5}).encode())]
        with Controller(socket=self.sock, token="") as c:
            sb = c.create_sandbox("base", metadata={"k": "v"}, limits=forkd.Limits(memory_limit_mib=512))
        self.assertEqual(sb.id, "sb-x")
        req = Recorder.seen[0]
        self.assertEqual((req["method"], req["path"]), ("POST", "/v1/sandboxes"))
        self.assertEqual(req["headers"]["Content-Type"], "application/json")
        self.assertNotIn("Authorization", req["headers"])
        self.assertEqual(json.loads(req["body"]), {"snapshot_tag": "base", "metadata": {"k": "v"}, "memory_limit_mib": 512})

    def test_disk_and_idle_freeze(self) -> None:
        answer = json.dumps({"sandboxes": [{"id": "sb-x", "status": "frozen", "disk_mib": 256, "idle_freeze_secs": -1}], "wall_ms": 1.5}).encode()
        Recorder.script = [(201, {}, answer), (201, {}, answer)]
        with Controller(socket=self.sock, token="") as c:
            sb = c.create_sandbox("base", disk_mib=256, idle_freeze_secs=-1)
            self.assertEqual((sb.status, sb.disk_mib, sb.idle_freeze_secs), ("frozen", 256, -1))
            c.fork_from("sb-x", 2, idle_freeze_secs=30)
            for bad in (True, 1.5, "30"):
                with self.assertRaises(TypeError):
                    c.create_sandbox("base", idle_freeze_secs=bad)
                with self.assertRaises(TypeError):
                    c.create_sandbox("base", disk_mib=bad)
        self.assertEqual(len(Recorder.seen), 2)  # nothing sent for bad arguments
        self.assertEqual(json.loads(Recorder.seen[0]["body"]), {"snapshot_tag": "base", "disk_mib": 256, "idle_freeze_secs": -1})
        self.assertEqual((Recorder.seen[1]["path"], json.loads(Recorder.seen[1]["body"])), ("/v1/sandboxes/sb-x/fork", {"count": 2, "idle_freeze_secs": 30}))

    def test_token_query_and_keepalive(self) -> None:
        Recorder.script = [(200, {}, b'{"sandboxes": []}')]
        with Controller(url=self.url, token="t0k") as c:
            c.list_sandboxes(snapshot="a b", status="running", metadata={"k": "v=1"})
            c.list_sandboxes()
        self.assertEqual(Recorder.seen[0]["headers"]["Authorization"], "Bearer t0k")
        self.assertEqual(Recorder.seen[0]["path"], "/v1/sandboxes?snapshot=a+b&status=running&metadata=k%3Dv%3D1")
        self.assertEqual(Recorder.seen[1]["path"], "/v1/sandboxes")

    def test_error_classes(self) -> None:
        Recorder.script = [(404, {}, err("not_found", "sandbox gone"))]
        with Controller(url=self.url, token="t") as c:
            with self.assertRaises(NotFoundError) as cm:
                c.get_sandbox("sb-1")
            self.assertEqual((cm.exception.status, cm.exception.message), (404, "sandbox gone"))
            Recorder.script = [(501, {}, err("not_implemented"))]
            with self.assertRaises(UnimplementedError):
                c.eval("sb-1", "1")
            Recorder.script = [(502, {}, b"bad gateway")]
            with self.assertRaises(UnavailableError) as cm2:
                c.ping("sb-1")
            self.assertEqual((cm2.exception.status, cm2.exception.message), (502, "bad gateway"))

    def test_retries_429_with_retry_after(self) -> None:
        Recorder.script = [(429, {"Retry-After": "0"}, err("resource_exhausted")), (503, {"Retry-After": "0"}, err("unavailable")), (201, {}, b'{"sandboxes":[{"id":"sb-y"}]}')]
        delays: List[float] = []
        with Controller(url=self.url, token="t", max_retries=3) as c:
            c.transport.backoff = 0.01
            c.transport.on_retry = lambda n, d, e: delays.append(d)
            self.assertEqual(c.create_sandbox("base").id, "sb-y")
        self.assertEqual(len(Recorder.seen), 3)
        self.assertEqual(len(delays), 2)
        self.assertTrue(all(s["body"] == Recorder.seen[0]["body"] for s in Recorder.seen))

    def test_503_retried_only_when_safe(self) -> None:
        # A POST that met a 503 without Retry-After may have acted (a guest
        # lost mid-call): not sent again. A GET is.
        Recorder.script = [(503, {}, err("unavailable")), (200, {}, b'{"exit_code": 0}')]
        with Controller(url=self.url, token="t") as c:
            c.transport.backoff = 0.01
            with self.assertRaises(UnavailableError):
                c.exec("sb-1", ["true"])
            self.assertEqual(len(Recorder.seen), 1)
            Recorder.script = [(503, {}, err("unavailable")), (200, {}, b'{"sandboxes": []}')]
            self.assertEqual(c.list_sandboxes(), [])
            self.assertEqual(len(Recorder.seen), 3)

    def test_retries_are_bounded(self) -> None:
        Recorder.script = [(429, {"Retry-After": "0"}, err("resource_exhausted"))]
        with Controller(url=self.url, token="t", max_retries=2) as c:
            c.transport.backoff = 0.01
            with self.assertRaises(ResourceExhaustedError):
                c.list_sandboxes()
        self.assertEqual(len(Recorder.seen), 3)
        # A Retry-After far longer than the SDK would wait is not waited for.
        Recorder.seen.clear()
        Recorder.script = [(503, {"Retry-After": "3600"}, err("unavailable"))]
        with Controller(url=self.url, token="t") as c:
            with self.assertRaises(UnavailableError):
                c.list_sandboxes()
        self.assertEqual(len(Recorder.seen), 1)

    def test_no_retry_of_other_errors_or_streamed_bodies(self) -> None:
        Recorder.script = [(409, {}, err("failed_precondition"))]
        with Controller(url=self.url, token="t") as c:
            c.transport.backoff = 0.01
            with self.assertRaises(forkd.FailedPreconditionError):
                c.delete_snapshot("x")
            self.assertEqual(len(Recorder.seen), 1)
            Recorder.script = [(429, {"Retry-After": "0"}, err("resource_exhausted"))]
            with self.assertRaises(ResourceExhaustedError):
                c.write_file("sb-1", "/f", iter([b"a", b"b"]))  # a stream cannot be sent twice
            self.assertEqual(len(Recorder.seen), 2)
            self.assertEqual(Recorder.seen[1]["body"], b"ab")

    def test_stream_events(self) -> None:
        lines = [{"type": "stdout", "data": "a"}, {"type": "stderr", "data_b64": "/w=="}, {"type": "exit", "exec": {"exit_code": 3}}]
        Recorder.script = [(200, {"Content-Type": "application/x-ndjson"}, b"".join(json.dumps(x).encode() + b"\n" for x in lines))]
        out: List[bytes] = []
        errs: List[bytes] = []
        with Controller(url=self.url, token="t") as c:
            r = c.exec_stream("sb-1", ["x"], on_stdout=out.append, on_stderr=errs.append)
            self.assertEqual((r.exit_code, out, errs), (3, [b"a"], [b"\xff"]))
            Recorder.script = [(200, {}, json.dumps({"type": "error", "error": {"code": "deadline_exceeded", "message": "late"}}).encode() + b"\n")]
            with self.assertRaises(forkd.DeadlineExceededError):
                c.exec_stream("sb-1", ["x"])
            Recorder.script = [(200, {}, b'{"type":"stdout","data":"a"}\n')]
            with self.assertRaises(UnavailableError):
                c.exec_stream("sb-1", ["x"])

    def test_sandbox_command_shapes(self) -> None:
        Recorder.script = [(200, {}, json.dumps({"exit_code": 2, "stdout": "o", "stderr": "e"}).encode())]
        with Controller(url=self.url, token="t") as c:
            sbx = forkd.Sandbox("sb-1", c, envs={"A": "1", "B": "2"})
            with self.assertRaises(forkd.CommandExitException) as cm:
                sbx.commands.run("false", envs={"B": "3"}, cwd="/w", timeout=5)
            e = cm.exception
            self.assertEqual((e.stdout, e.stderr, e.exit_code, e.error), ("o", "e", 2, "exit status 2"))
            body = json.loads(Recorder.seen[0]["body"])
            self.assertEqual(body, {"shell": "false", "env": {"A": "1", "B": "3"}, "cwd": "/w", "timeout_secs": 5.0})
            Recorder.script = [(200, {}, json.dumps({"value": "42", "stdout": "p\n"}).encode())]
            ex = sbx.run_code("x+1")
            self.assertEqual((ex.text, ex.logs.stdout, ex.error), ("42", ["p\n"], None))
            Recorder.script = [(200, {}, json.dumps({"error": {"name": "ValueError", "message": "v", "traceback": "tb"}}).encode())]
            ex = sbx.run_code("raise ValueError('v')")
            self.assertEqual((ex.results, ex.error), ([], forkd.ExecutionError("ValueError", "v", "tb")))


class DiscoveryTest(unittest.TestCase):
    def setUp(self) -> None:
        self.data = tempfile.mkdtemp(prefix="fpy-data-")
        with open(os.path.join(self.data, "token"), "w") as f:
            f.write("filetoken\n")
        self.env = mock.patch.dict(os.environ, {"FORKD_DATA": self.data}, clear=False)
        self.env.start()
        for k in ("FORKD_URL", "FORKD_TOKEN", "FORKD_INSECURE"):
            os.environ.pop(k, None)

    def tearDown(self) -> None:
        self.env.stop()
        shutil.rmtree(self.data)

    def test_token_rules(self) -> None:
        r = _discover.resolve
        self.assertEqual(r("http://127.0.0.1:8889"), ("http://127.0.0.1:8889", "filetoken"))
        self.assertEqual(r("http://localhost:8889")[1], "filetoken")
        self.assertEqual(r("http://[::1]:8889")[1], "filetoken")
        self.assertEqual(r("http://127.0.0.1:8889", token="given")[1], "given")
        os.environ["FORKD_TOKEN"] = "envtoken"
        self.assertEqual(r("http://127.0.0.1:8889")[1], "envtoken")
        self.assertEqual(r("https://forkd.example:8889")[1], "envtoken")
        del os.environ["FORKD_TOKEN"]
        # The token file never goes to another host; plain http there is refused.
        self.assertEqual(r("https://forkd.example:8889")[1], "")
        with self.assertRaises(InvalidArgumentError):
            r("http://forkd.example:8889")
        os.environ["FORKD_INSECURE"] = "1"
        self.assertEqual(r("http://forkd.example:8889")[1], "")
        self.assertEqual(r("http://forkd.example:8889", insecure=True)[1], "")
        self.assertEqual(r("unix:///x.sock"), ("unix:///x.sock", ""))
        self.assertEqual(r(socket_path="/y.sock"), ("unix:///y.sock", ""))

    def test_env_url(self) -> None:
        os.environ["FORKD_URL"] = "http://127.0.0.1:1"
        os.environ["FORKD_TOKEN"] = "tok"
        c = Controller()
        self.assertEqual((c.url, c.transport.token), ("http://127.0.0.1:1", "tok"))
        with self.assertRaises(UnavailableError):  # nothing listens there
            c.list_sandboxes()

    def test_local_daemon_from_controller_file(self) -> None:
        d = tempfile.mkdtemp(prefix="fpy-")
        sock = os.path.join(d, "s")
        srv = UnixServer(sock, Recorder)
        Recorder.script, Recorder.seen = [(200, {}, b'{"status":"ok"}')], []
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        try:
            with mock.patch.object(_discover, "default_socket", return_value=os.path.join(d, "none")):
                with self.assertRaises(UnavailableError):
                    Controller()
                with open(os.path.join(self.data, "controller.json"), "w") as f:
                    json.dump({"socket": sock, "url": "http://127.0.0.1:9", "pid": 1}, f)
                self.assertEqual(Controller().url, "unix://" + sock)
                srv.shutdown()
                srv.server_close()
                os.unlink(sock)
                # No socket answers: the recorded TCP URL, with the token file.
                c = Controller()
                self.assertEqual((c.url, c.transport.token), ("http://127.0.0.1:9", "filetoken"))
        finally:
            shutil.rmtree(d)

    def test_default_socket(self) -> None:
        with mock.patch("os.geteuid", return_value=1000), mock.patch.dict(os.environ, {"XDG_RUNTIME_DIR": "/run/user/1000"}):
            self.assertEqual(_discover.default_socket(), "/run/user/1000/forkd/forkd.sock")
        with mock.patch("os.geteuid", return_value=0):
            self.assertEqual(_discover.default_socket(), "/run/forkd/forkd.sock")

    def test_retry_after(self) -> None:
        self.assertEqual(retry_after("2"), 2.0)
        self.assertIsNone(retry_after(None))
        self.assertIsNone(retry_after("soon"))
        self.assertEqual(retry_after("Wed, 21 Oct 2015 07:28:00 GMT"), 0.0)


class InstallTest(unittest.TestCase):
    """pip installs the package offline with the distro's setuptools, and
    the installed copy has its type marker."""

    def test_pip_install_offline(self) -> None:
        probe = "import setuptools, pip, sys; v = tuple(int(x) for x in setuptools.__version__.split('.')[:2]); v >= (70, 1) or __import__('wheel')"
        if subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode != 0:
            unavailable(f"{sys.executable} lacks pip, setuptools or wheel (Debian: python3-pip python3-setuptools python3-wheel)")
        target = tempfile.mkdtemp(prefix="fpy-install-")
        build = tempfile.mkdtemp(prefix="fpy-src-")
        try:
            src = os.path.join(build, "python")
            shutil.copytree(SDK, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests"))
            r = subprocess.run(
                [sys.executable, "-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-index", "--no-deps", "--target", target, src],
                capture_output=True, text=True, timeout=300,
            )
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertTrue(os.path.exists(os.path.join(target, "forkd", "py.typed")))
            r = subprocess.run([sys.executable, "-c", "import forkd; print(forkd.__file__)"], capture_output=True, text=True, cwd=target, env={**os.environ, "PYTHONPATH": target})
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertTrue(r.stdout.startswith(target))
        finally:
            shutil.rmtree(target, ignore_errors=True)
            shutil.rmtree(build, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
