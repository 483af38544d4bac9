"""A real `forkd serve` for the SDK's tests: the repo's bin/forkd (or
$FORKD_BIN), a temporary data dir, a socket in a temporary directory, a
free loopback port, and the shared image cache ($FORKD_CACHE, default
/var/tmp/forkd-test-cache/image, the cache the Go VM tests use).

Tests that cannot run here (no binary, no QEMU, not root for the python
image) are skipped, or fail when $FORKD_TEST_STRICT=1, as the Go tiers do.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
SDK = os.path.dirname(HERE)
REPO = os.path.dirname(os.path.dirname(SDK))
if SDK not in sys.path:
    sys.path.insert(0, SDK)

from forkd import Controller  # noqa: E402

STRICT = os.environ.get("FORKD_TEST_STRICT") == "1"
CACHE = os.environ.get("FORKD_CACHE") or os.path.join(os.environ.get("FORKD_TEST_CACHE") or "/var/tmp/forkd-test-cache", "image")


def unavailable(reason: str) -> None:
    """Skips, or fails under FORKD_TEST_STRICT=1."""
    if STRICT:
        raise AssertionError(f"{reason} (FORKD_TEST_STRICT=1: a skip is a failure)")
    raise unittest.SkipTest(reason)


def forkd_bin() -> str:
    return os.environ.get("FORKD_BIN") or os.path.join(REPO, "bin", "forkd")


def require_vm() -> None:
    """Skips unless this host can run forkd's VMs."""
    if os.environ.get("FORKD_TEST_TIER", "vm") != "vm":
        raise unittest.SkipTest("VM tier not selected (FORKD_TEST_TIER)")
    b = forkd_bin()
    if not os.access(b, os.X_OK):
        unavailable(f"no forkd binary at {b}: run `make build` (or set FORKD_BIN)")
    if shutil.which("qemu-system-x86_64") is None:
        unavailable("test needs qemu-system-x86_64")
    if not os.path.exists("/bin/busybox"):
        unavailable("test needs /bin/busybox (busybox-static)")


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return int(port)


def log(msg: str) -> None:
    print(f"[forkd-py-test {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Daemon:
    """`forkd serve` in a process of its own, over a data dir of its own."""

    def __init__(self, *extra: str) -> None:
        self.bin = forkd_bin()
        self.data = tempfile.mkdtemp(prefix="forkd-py-data-")
        self.sockdir = tempfile.mkdtemp(prefix="fpy-")
        self.sock = os.path.join(self.sockdir, "s")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = dict(os.environ)
        self.env.update({"FORKD_DATA": self.data, "FORKD_CACHE": CACHE})
        self.env.pop("FORKD_URL", None)
        self.env.pop("FORKD_TOKEN", None)
        agent = os.environ.get("FORKD_AGENT") or os.path.join(os.path.dirname(self.bin), "forkd-agent")
        if os.path.exists(agent):
            self.env["FORKD_AGENT"] = agent
        self.logfile = os.path.join(self.data, "serve.log")
        self.tags: List[str] = []
        self.proc: Optional[subprocess.Popen] = None
        self.args = ["serve", "--socket", self.sock, "--listen", f"127.0.0.1:{self.port}", *extra]
        atexit.register(self.stop)  # also when interrupted before tearDownModule
        self.start()

    def start(self) -> None:
        with open(self.logfile, "ab") as f:
            self.proc = subprocess.Popen([self.bin, *self.args], env=self.env, stdout=f, stderr=f, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        c = Controller(socket=self.sock, timeout=2)
        while True:
            try:
                if c.health():
                    break
            except Exception:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"forkd serve did not come up:\n{self.output()}")
            time.sleep(0.05)
        c.close()
        with open(os.path.join(self.data, "token"), encoding="utf-8") as f:
            self.token = f.read().strip()

    def output(self) -> str:
        try:
            with open(self.logfile, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def controller(self, **kw: object) -> Controller:
        """A controller on the daemon's socket."""
        return Controller(socket=self.sock, **kw)  # type: ignore[arg-type]

    def cli(self, *args: str, check: bool = False) -> subprocess.CompletedProcess:
        """The forkd CLI over this daemon's data dir (it finds the daemon)."""
        return subprocess.run([self.bin, *args], env=self.env, capture_output=True, text=True, timeout=300, check=check)

    def build(self, tag: str, image: str, progress: bool = True) -> str:
        """Starts building snapshot tag; returns the operation id."""
        with self.controller() as c:
            op = c.create_snapshot(tag, image, wait=False)
        self.tags.append(tag)
        return op.id

    def stop(self) -> None:
        """Kills every sandbox, removes the snapshots, stops the daemon and
        removes its data dir."""
        if self.proc is None:
            return
        try:
            r = self.cli("kill", "--all")
            if r.returncode != 0:
                log(f"kill --all: {r.stderr.strip()}")
            for tag in reversed(self.tags):
                self.cli("rmi", tag)
        finally:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
            shutil.rmtree(self.data, ignore_errors=True)
            shutil.rmtree(self.sockdir, ignore_errors=True)
