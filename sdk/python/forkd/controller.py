"""Controller: every operation of forkd's REST API v1, typed.

    from forkd import Controller
    c = Controller()                       # FORKD_URL, else the local daemon
    sb = c.create_sandbox("py")
    print(c.exec(sb.id, ["uname", "-a"]).stdout)

The Go client (client/client.go) is the reference for how each call is
made; method names are its names in snake_case.
"""

from __future__ import annotations

import io
import json
import os
import ssl
import time
import urllib.parse
from typing import IO, Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Union

from . import _discover
from ._http import DEFAULT, Response, Transport
from .errors import DeadlineExceededError, ForkdError, UnavailableError, error_for
from .types import (
    CreateSandboxesResponse,
    EvalResult,
    ExecResult,
    FileInfo,
    Limits,
    NetworkRule,
    NetworkSpec,
    OCISource,
    Operation,
    PingResult,
    Process,
    PublishedPort,
    Sandbox,
    Snapshot,
    SnapshotInfo,
    StreamEvent,
    VersionInfo,
    Workspace,
    WriteFileResult,
)

__all__ = ["Controller", "OperationFailed"]

#: Content-Type of an exec/stream body that goes on with the process's stdin.
EXEC_STDIN_STREAM = "application/vnd.forkd.exec-stdin"

# Slack over an exec's or eval's own timeout: the daemon gives up on the
# guest 10 s after it.
_CALL_SLACK = 15.0

Args = Union[str, Sequence[str], None]
OutputCallback = Callable[[bytes], Any]
StdinSource = Union[bytes, bytearray, str, IO[bytes], Iterable[bytes], None]


class OperationFailed(ForkdError):
    """Kept for isinstance checks: wait_operation raises the error class of
    the failed operation's code, with the operation in ``.operation``."""


def _sb(id: str, rest: str = "") -> str:
    return "/v1/sandboxes/" + urllib.parse.quote(id, safe="") + rest


def _tag(tag: str) -> str:
    return urllib.parse.quote(tag, safe="")


def _drop_empty(d: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in d.items() if v not in (None, "", [], {}, False, 0) or (isinstance(v, bool) and v)}


def _model(v: Any) -> Any:
    if v is None:
        return None
    if hasattr(v, "to_dict"):
        return v.to_dict()
    if isinstance(v, Mapping):
        return {k: _model(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_model(x) for x in v]
    return v


def _exec_body(
    args: Args,
    shell: Optional[str],
    env: Optional[Mapping[str, str]],
    cwd: Optional[str],
    user: Optional[str],
    timeout: Optional[float],
) -> Dict[str, Any]:
    if isinstance(args, str):
        if shell is not None:
            raise TypeError("give args or shell, not both")
        shell, args = args, None
    body: Dict[str, Any] = {}
    if args:
        body["args"] = list(args)
    if shell:
        body["shell"] = shell
    if env:
        body["env"] = dict(env)
    if cwd:
        body["cwd"] = cwd
    if user:
        body["user"] = user
    if timeout:
        body["timeout_secs"] = float(timeout)
    return body


def _call_wait(timeout: Optional[float]) -> Optional[float]:
    """How long to wait for an answer to a call bounded by timeout."""
    return float(timeout) + _CALL_SLACK if timeout else None


def _b64(b: Union[bytes, bytearray, str]) -> str:
    import base64

    if isinstance(b, str):
        b = b.encode()
    return base64.b64encode(bytes(b)).decode("ascii")


def _chunks(src: Union[IO[bytes], Iterable[bytes]], size: int = 64 << 10) -> Iterator[bytes]:
    read = getattr(src, "read", None)
    if read is not None:
        while True:
            b = read(size)
            if not b:
                return
            yield b.encode() if isinstance(b, str) else b
    else:
        for b in src:  # type: ignore[union-attr]
            yield b.encode() if isinstance(b, str) else b


def _whole(name: str, v: Any) -> int:
    """v, which must be an int (not a bool); the daemon checks its range."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, not {type(v).__name__}")
    return v


def _create_body(
    snapshot_tag: str,
    n: int,
    timeout_secs: int,
    metadata: Optional[Mapping[str, str]],
    limits: Optional[Limits],
    network: Union[NetworkSpec, Mapping[str, Any], None],
    guest_pids_limit: int,
    keep_partial: bool,
    on_unresponsive: str,
    disk_mib: int = 0,
    idle_freeze_secs: int = 0,
) -> Dict[str, Any]:
    body: Dict[str, Any] = {"snapshot_tag": snapshot_tag}
    body.update(
        _drop_empty(
            {
                "n": n if n != 1 else 0,
                "timeout_secs": int(timeout_secs or 0),
                "metadata": dict(metadata or {}),
                "network": _model(network),
                "guest_pids_limit": guest_pids_limit,
                "keep_partial": keep_partial,
                "on_unresponsive": on_unresponsive,
                "disk_mib": _whole("disk_mib", disk_mib),
                "idle_freeze_secs": _whole("idle_freeze_secs", idle_freeze_secs),
            }
        )
    )
    if limits is not None:
        body.update(_model(limits))
    return body


class Controller:
    """A client of one forkd daemon (``forkd serve``). Safe for concurrent
    use from threads.

    Where it connects: ``socket`` (a unix socket path) or ``url``
    (``unix:///path``, ``http://host:port``, ``https://host:port``) when
    given; else ``$FORKD_URL`` (token ``$FORKD_TOKEN``); else the local
    daemon: the socket recorded in ``<data dir>/controller.json``, then the
    default socket. A loopback URL without a token gets the data dir's
    token file; plain http to another host is refused unless
    ``insecure`` (or ``$FORKD_INSECURE=1``).

    ``timeout`` bounds each wait for the daemon on ordinary calls (None:
    none); calls that last as long as their work (create, exec, eval,
    waits, streams) wait as long as it takes, or their own timeout plus a
    margin. ``max_retries`` bounds the retries of answers 429 and 503.
    """

    def __init__(
        self,
        url: Optional[str] = None,
        token: Optional[str] = None,
        socket: Optional[str] = None,
        *,
        data_dir: Optional[str] = None,
        timeout: Optional[float] = 60.0,
        max_retries: int = 4,
        insecure: Optional[bool] = None,
        ssl_context: Optional[ssl.SSLContext] = None,
    ) -> None:
        u, tok = _discover.resolve(url, token, socket, data_dir, insecure)
        self._t = Transport(u, tok, timeout=timeout, max_retries=max_retries, ssl_context=ssl_context)

    @property
    def url(self) -> str:
        """The daemon's URL."""
        return self._t.url

    @property
    def transport(self) -> Transport:
        return self._t

    def close(self) -> None:
        """Closes idle connections; the controller stays usable."""
        self._t.close()

    def __enter__(self) -> "Controller":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Controller({self.url!r})"

    # -- plumbing -----------------------------------------------------------

    def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: Any = None,
        timeout: Any = DEFAULT,
    ) -> Any:
        data, ct = None, None
        if body is not None:
            data, ct = json.dumps(body).encode(), "application/json"
        resp = self._t.send(method, path, query=query, body=data, content_type=ct, timeout=timeout)
        b = resp.read()
        return json.loads(b) if b else None

    def _events(self, resp: Response, what: str) -> Iterator[StreamEvent]:
        """The NDJSON events of a stream; an error event raises its class;
        the stream ends with its last event (exit or result)."""
        try:
            for line in resp.iter_lines():
                if not line.strip():
                    continue
                try:
                    ev = StreamEvent.from_dict(json.loads(line))
                except ValueError as e:
                    raise UnavailableError(f"{what}: bad event {line[:80]!r}: {e}", status=0) from e
                if ev.type == "error":
                    e = ev.error
                    raise error_for(e.code if e else None, e.message if e else "error event without error")
                if ev.type not in ("stdout", "stderr"):
                    resp.drain()
                    yield ev
                    return
                yield ev
        except OSError as e:
            if isinstance(e, TimeoutError) or type(e).__name__ == "timeout":
                raise DeadlineExceededError(f"{what}: no event within the wait", status=0) from e
            raise UnavailableError(f"{what}: stream cut: {e}", status=0) from e
        finally:
            resp.close()
        raise UnavailableError(f"{what}: stream ended without a result", status=0)

    @staticmethod
    def _drain(events: Iterator[StreamEvent], on_stdout: Optional[OutputCallback], on_stderr: Optional[OutputCallback]) -> StreamEvent:
        last: Optional[StreamEvent] = None
        for ev in events:
            if ev.type == "stdout":
                if on_stdout is not None:
                    on_stdout(ev.payload)
            elif ev.type == "stderr":
                if on_stderr is not None:
                    on_stderr(ev.payload)
            else:
                last = ev
        assert last is not None
        return last

    # -- daemon -------------------------------------------------------------

    def health(self) -> bool:
        """True when the daemon answers /healthz (no authentication)."""
        doc = self._call("GET", "/healthz", timeout=10.0)
        return isinstance(doc, dict) and doc.get("status") == "ok"

    def version(self) -> VersionInfo:
        """The daemon's versions, backend, accelerator and data dir."""
        return VersionInfo.from_dict(self._call("GET", "/version"))

    def openapi(self) -> Dict[str, Any]:
        """The API as an OpenAPI 3.1 document."""
        return self._call("GET", "/v1/openapi.json")  # type: ignore[no-any-return]

    def metrics(self) -> str:
        """Prometheus metrics, as text."""
        return self._t.send("GET", "/metrics").read().decode()

    # -- snapshots ----------------------------------------------------------

    def list_snapshots(self) -> List[Snapshot]:
        return [Snapshot.from_dict(s) for s in self._call("GET", "/v1/snapshots")["snapshots"] or []]

    def get_snapshot(self, tag: str) -> Snapshot:
        """One snapshot (status writing while built); FailedPreconditionError
        for a corrupt tag."""
        return Snapshot.from_dict(self._call("GET", "/v1/snapshots/" + _tag(tag)))

    def snapshot_info(self, tag: str) -> SnapshotInfo:
        """A snapshot's chain (parent, ancestors, dependents) and sizes."""
        return SnapshotInfo.from_dict(self._call("GET", "/v1/snapshots/" + _tag(tag) + "/info"))

    def create_snapshot(
        self,
        tag: str,
        image: Optional[str] = None,
        *,
        memory_mib: int = 0,
        vcpus: int = 0,
        warmup: Optional[Sequence[str]] = None,
        network: Optional[bool] = None,
        oci: Union[OCISource, Mapping[str, Any], None] = None,
        wait: bool = True,
        progress: Optional[Callable[[str], Any]] = None,
        timeout: Optional[float] = None,
    ) -> Operation:
        """Builds snapshot ``tag`` from ``image`` (default "minimal") or an OCI
        image. With ``wait`` it polls the operation until it ends, passing
        each new progress line to ``progress``, and raises the operation's
        error if it failed; without, it returns the running operation."""
        body = _drop_empty({"tag": tag, "image": image, "memory_mib": memory_mib, "vcpus": vcpus, "warmup": list(warmup or [])})
        if network is not None:
            body["network"] = bool(network)
        if oci is not None:
            body["oci"] = _model(oci)
        op = Operation.from_dict(self._call("POST", "/v1/snapshots", body))
        if not wait:
            return op
        return self.wait_operation(op.id, progress=progress, timeout=timeout)

    def delete_snapshot(self, tag: str, *, cascade: bool = False, force: bool = False) -> None:
        """Removes a snapshot. FailedPreconditionError while sandboxes use it
        or snapshots made from it remain, unless ``cascade`` (remove those
        too) or ``force`` (leave them)."""
        q = _drop_empty({"cascade": cascade, "force": force})
        self._call("DELETE", "/v1/snapshots/" + _tag(tag), query=q or None)

    def compact_snapshot(self, tag: str, to: str) -> Snapshot:
        """Makes snapshot ``to``, standing alone, from ``tag`` and its chain."""
        return Snapshot.from_dict(self._call("POST", "/v1/snapshots/" + _tag(tag) + "/compact", {"to": to}, timeout=None))

    # -- operations ---------------------------------------------------------

    def list_operations(self) -> List[Operation]:
        return [Operation.from_dict(o) for o in self._call("GET", "/v1/operations")["operations"] or []]

    def get_operation(self, id: str) -> Operation:
        return Operation.from_dict(self._call("GET", "/v1/operations/" + _tag(id)))

    def wait_operation(self, id: str, *, progress: Optional[Callable[[str], Any]] = None, timeout: Optional[float] = None) -> Operation:
        """Polls an operation until it ends (or ``timeout`` seconds pass:
        DeadlineExceededError). Each progress line goes to ``progress``
        once, in order. A failed operation raises the error class of its
        code, with the operation in ``.operation``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay, seen = 0.1, 0
        while True:
            op = self.get_operation(id)
            if progress is not None and op.progress_lines > seen:
                fresh = min(op.progress_lines - seen, len(op.progress))
                for line in op.progress[len(op.progress) - fresh :]:
                    progress(line)
                seen = op.progress_lines
                delay = 0.1
            if op.status == "succeeded":
                return op
            if op.status == "failed":
                e = op.error
                err = error_for(e.code if e else "internal", e.message if e else "operation failed")
                err.operation = op  # type: ignore[attr-defined]
                raise err
            if deadline is not None and time.monotonic() + delay > deadline:
                raise DeadlineExceededError(f"operation {id} still running after {timeout}s", status=0)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    # -- sandboxes ----------------------------------------------------------

    def create_sandboxes(
        self,
        snapshot_tag: str,
        n: int = 1,
        *,
        timeout_secs: int = 0,
        metadata: Optional[Mapping[str, str]] = None,
        limits: Optional[Limits] = None,
        network: Union[NetworkSpec, Mapping[str, Any], None] = None,
        guest_pids_limit: int = 0,
        keep_partial: bool = False,
        on_unresponsive: str = "",
        disk_mib: int = 0,
        idle_freeze_secs: int = 0,
    ) -> CreateSandboxesResponse:
        """Forks ``n`` sandboxes of a snapshot; returns once all are ready. The
        batch is all or nothing unless ``keep_partial``. ``timeout_secs`` > 0
        kills each that long after it became ready. ``disk_mib`` (64 to
        1048576) gives each a writable disk for its root file system;
        ``idle_freeze_secs`` (1 to 86400, -1 never, 0 the daemon's) is how
        long each may sit idle before the daemon freezes it (any call wakes
        it)."""
        body = _create_body(
            snapshot_tag, n, timeout_secs, metadata, limits, network, guest_pids_limit, keep_partial, on_unresponsive,
            disk_mib, idle_freeze_secs,
        )
        return CreateSandboxesResponse.from_dict(self._call("POST", "/v1/sandboxes", body, timeout=None))

    def create_sandbox(self, snapshot_tag: str, **kw: Any) -> Sandbox:
        """One sandbox of a snapshot (create_sandboxes with n=1)."""
        return self.create_sandboxes(snapshot_tag, 1, **kw).sandboxes[0]

    def list_sandboxes(
        self,
        *,
        snapshot: Optional[str] = None,
        status: Optional[str] = None,
        metadata: Optional[Mapping[str, str]] = None,
    ) -> List[Sandbox]:
        """Sandboxes, filtered by snapshot, status (starting, running,
        unresponsive, building, dead, oom) and metadata (all must match)."""
        q: List[Any] = []
        if snapshot:
            q.append(("snapshot", snapshot))
        if status:
            q.append(("status", status))
        for k, v in (metadata or {}).items():
            q.append(("metadata", f"{k}={v}"))
        return [Sandbox.from_dict(s) for s in self._call("GET", "/v1/sandboxes", query=q)["sandboxes"] or []]

    def get_sandbox(self, id: str) -> Sandbox:
        return Sandbox.from_dict(self._call("GET", _sb(id)))

    def delete_sandbox(self, id: str) -> None:
        """Kills a sandbox (FailedPreconditionError while it is starting)."""
        self._call("DELETE", _sb(id))

    kill_sandbox = delete_sandbox

    def set_timeout(self, id: str, timeout_secs: float) -> Sandbox:
        """Kills the sandbox ``timeout_secs`` from now; 0 removes the deadline."""
        return Sandbox.from_dict(self._call("POST", _sb(id, "/timeout"), {"timeout_secs": int(timeout_secs)}))

    def ping(self, id: str) -> PingResult:
        """A round trip to the sandbox's agent."""
        return PingResult.from_dict(self._call("POST", _sb(id, "/ping")))

    def set_network(self, id: str, egress: str, allow: Optional[Sequence[Union[NetworkRule, Mapping[str, Any]]]] = None) -> Sandbox:
        """Replaces the sandbox's egress policy (allow, deny, allowlist)."""
        body = _drop_empty({"egress": egress, "allow": [_model(r) for r in allow or []]})
        return Sandbox.from_dict(self._call("PUT", _sb(id, "/network"), body))

    def publish(self, id: str, guest_port: int) -> PublishedPort:
        """Publishes a guest TCP port on a host port."""
        return PublishedPort.from_dict(self._call("POST", _sb(id, "/ports"), {"guest_port": guest_port}))

    def branch(self, id: str, tag: Optional[str] = None, *, mode: Optional[str] = None, wait: bool = True) -> Snapshot:
        """Snapshots the running sandbox into a new snapshot (``tag``, or one
        made up). ``mode``: full, diff (default) or live. Without ``wait`` it
        returns at once with the snapshot writing (poll get_snapshot)."""
        body = _drop_empty({"tag": tag, "mode": mode})
        if not wait:
            body["wait"] = False
        return Snapshot.from_dict(self._call("POST", _sb(id, "/branch"), body, timeout=None))

    def fork_from(
        self,
        id: str,
        count: int = 1,
        *,
        mode: Optional[str] = None,
        timeout_secs: int = 0,
        metadata: Optional[Mapping[str, str]] = None,
        limits: Optional[Limits] = None,
        network: Union[NetworkSpec, Mapping[str, Any], None] = None,
        keep_partial: bool = False,
        on_unresponsive: str = "",
        idle_freeze_secs: int = 0,
    ) -> CreateSandboxesResponse:
        """Forks ``count`` sandboxes from the running sandbox's current state
        (a snapshot of their own, gone with the last of them). They get the
        source's disk, if it has one; ``idle_freeze_secs`` as in
        create_sandboxes."""
        body = _drop_empty(
            {
                "count": count,
                "mode": mode,
                "timeout_secs": int(timeout_secs or 0),
                "metadata": dict(metadata or {}),
                "network": _model(network),
                "keep_partial": keep_partial,
                "on_unresponsive": on_unresponsive,
                "idle_freeze_secs": _whole("idle_freeze_secs", idle_freeze_secs),
            }
        )
        if limits is not None:
            body.update(_model(limits))
        return CreateSandboxesResponse.from_dict(self._call("POST", _sb(id, "/fork"), body, timeout=None))

    # -- exec and eval ------------------------------------------------------

    def exec(
        self,
        id: str,
        args: Args = None,
        *,
        shell: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        stdin: Union[bytes, bytearray, str, None] = None,
        timeout: Optional[float] = None,
    ) -> ExecResult:
        """Runs a process and returns its buffered output and exit. ``args``
        is an argv list, or a string run under /bin/sh -c (as ``shell``).
        ``timeout`` (seconds) kills it: the result says ``timed_out``."""
        body = _exec_body(args, shell, env, cwd, user, timeout)
        if stdin is not None:
            body["stdin"] = _b64(stdin)
        return ExecResult.from_dict(self._call("POST", _sb(id, "/exec"), body, timeout=_call_wait(timeout)))

    def exec_events(
        self,
        id: str,
        args: Args = None,
        *,
        shell: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        stdin: StdinSource = None,
        timeout: Optional[float] = None,
    ) -> Iterator[StreamEvent]:
        """Runs a process and yields its output events as produced, the last
        one of type "exit" (``.exec`` set). ``stdin`` as bytes or str is the
        whole input; a file or an iterable of bytes is streamed while the
        output streams, its end closing the process's stdin."""
        body = _exec_body(args, shell, env, cwd, user, timeout)
        path = _sb(id, "/exec/stream")
        if stdin is None or isinstance(stdin, (bytes, bytearray, str)):
            if stdin is not None:
                body["stdin"] = _b64(stdin)
            resp = self._t.send("POST", path, body=json.dumps(body).encode(), content_type="application/json", timeout=_call_wait(timeout))
        else:
            body["stdin_stream"] = True
            head = json.dumps(body).encode() + b"\n"
            resp = self._t.open_duplex("POST", path, head, _chunks(stdin), EXEC_STDIN_STREAM, timeout=_call_wait(timeout))
        return self._events(resp, "exec")

    def exec_stream(
        self,
        id: str,
        args: Args = None,
        *,
        on_stdout: Optional[OutputCallback] = None,
        on_stderr: Optional[OutputCallback] = None,
        **kw: Any,
    ) -> ExecResult:
        """exec_events that passes output (bytes) to the callbacks as it
        comes and returns how the process ended."""
        ev = self._drain(self.exec_events(id, args, **kw), on_stdout, on_stderr)
        if ev.type != "exit" or ev.exec is None:
            raise UnavailableError(f"exec stream ended with a {ev.type!r} event", status=0)
        return ev.exec

    def eval(self, id: str, code: str, *, timeout: Optional[float] = None) -> EvalResult:
        """Runs Python in the sandbox's warm interpreter (its state is kept
        between calls). An exception of the code is in ``.error``, not
        raised; UnimplementedError in an image without Python."""
        body = _drop_empty({"code": code, "timeout_secs": float(timeout or 0)})
        return EvalResult.from_dict(self._call("POST", _sb(id, "/eval"), body, timeout=_call_wait(timeout)))

    def eval_events(self, id: str, code: str, *, timeout: Optional[float] = None) -> Iterator[StreamEvent]:
        """eval whose output events come as produced, the last of type
        "result" (``.eval`` set)."""
        body = _drop_empty({"code": code, "timeout_secs": float(timeout or 0)})
        resp = self._t.send("POST", _sb(id, "/eval/stream"), body=json.dumps(body).encode(), content_type="application/json", timeout=_call_wait(timeout))
        return self._events(resp, "eval")

    def eval_stream(
        self,
        id: str,
        code: str,
        *,
        on_stdout: Optional[OutputCallback] = None,
        on_stderr: Optional[OutputCallback] = None,
        timeout: Optional[float] = None,
    ) -> EvalResult:
        """eval that passes the code's output (bytes) to the callbacks as it
        comes."""
        ev = self._drain(self.eval_events(id, code, timeout=timeout), on_stdout, on_stderr)
        if ev.type != "result" or ev.eval is None:
            raise UnavailableError(f"eval stream ended with a {ev.type!r} event", status=0)
        return ev.eval

    # -- files --------------------------------------------------------------

    def iter_file(self, id: str, path: str, chunk_size: int = 256 << 10) -> Iterator[bytes]:
        """The guest file at path, streamed in chunks."""
        resp = self._t.send("GET", _sb(id, "/files"), query={"path": path})
        return resp.iter_chunks(chunk_size)

    def read_file(self, id: str, path: str, out: Optional[IO[bytes]] = None) -> Union[bytes, int]:
        """The guest file at path: its bytes, or, with ``out`` (a binary
        file), streamed into it and its length returned."""
        if out is None:
            return b"".join(self.iter_file(id, path))
        n = 0
        for b in self.iter_file(id, path):
            out.write(b)
            n += len(b)
        return n

    def write_file(
        self,
        id: str,
        path: str,
        data: Union[bytes, bytearray, str, IO[bytes], Iterable[bytes]],
        *,
        mode: Optional[int] = None,
    ) -> WriteFileResult:
        """Replaces the guest file at path, atomically, with data: bytes, str
        (UTF-8), a binary file (streamed) or an iterable of bytes (streamed,
        chunked). ``mode`` (e.g. 0o755) sets its permissions; by default an
        existing file keeps its own, a new one gets 0644."""
        q: Dict[str, Any] = {"path": path}
        if mode is not None:
            q["mode"] = "0" + format(mode, "o")
        headers: Dict[str, str] = {}
        body: Any = data
        if isinstance(data, str):
            body = data.encode()
        elif hasattr(data, "read"):
            size = _size(data)
            if size is not None:
                headers["Content-Length"] = str(size)
        elif not isinstance(data, (bytes, bytearray, memoryview)):
            body = _chunks(data)  # type: ignore[arg-type]
        resp = self._t.send("PUT", _sb(id, "/files"), query=q, body=body, content_type="application/octet-stream", headers=headers)
        return WriteFileResult.from_dict(resp.json())

    def list_dir(self, id: str, path: str, depth: int = 1) -> List[FileInfo]:
        """A guest directory's entries, ``depth`` levels down."""
        q: Dict[str, Any] = {"path": path}
        if depth > 1:
            q["depth"] = depth
        return [FileInfo.from_dict(e) for e in self._call("GET", _sb(id, "/files/list"), query=q)["entries"] or []]

    def stat(self, id: str, path: str) -> FileInfo:
        """Describes a guest path (a final symlink is not followed)."""
        return FileInfo.from_dict(self._call("GET", _sb(id, "/files/stat"), query={"path": path}))

    def make_dir(self, id: str, path: str) -> bool:
        """Makes a guest directory and its parents; False when it existed."""
        return bool(self._call("POST", _sb(id, "/files/mkdir"), {"path": path}).get("created"))

    def remove(self, id: str, path: str, *, recursive: bool = False) -> None:
        """Removes a guest path; a non-empty directory needs ``recursive``."""
        q: Dict[str, Any] = {"path": path}
        if recursive:
            q["recursive"] = True
        self._call("DELETE", _sb(id, "/files"), query=q)

    def rename(self, id: str, src: str, dst: str) -> None:
        """Renames a guest path."""
        self._call("POST", _sb(id, "/files/rename"), {"from": src, "to": dst})

    # -- background processes -----------------------------------------------

    def start_process(
        self,
        id: str,
        args: Args = None,
        *,
        shell: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Optional[str] = None,
        stdin: Union[bytes, bytearray, str, None] = None,
        stdin_open: bool = False,
        tag: str = "",
        timeout: Optional[float] = None,
    ) -> Process:
        """Starts a background process and returns at once with its pid.
        ``stdin`` is its whole input; with ``stdin_open`` instead its stdin
        stays open for send_stdin."""
        body = _exec_body(args, shell, env, cwd, user, timeout)
        if stdin is not None:
            body["stdin"] = _b64(stdin)
        if stdin_open:
            body["stdin_open"] = True
        if tag:
            body["tag"] = tag
        return Process.from_dict(self._call("POST", _sb(id, "/processes"), body))

    def list_processes(self, id: str) -> List[Process]:
        """Background processes, running and recently ended."""
        return [Process.from_dict(p) for p in self._call("GET", _sb(id, "/processes"))["processes"] or []]

    def get_process(self, id: str, pid: int) -> Process:
        return Process.from_dict(self._call("GET", _sb(id, f"/processes/{int(pid)}")))

    def wait_process(self, id: str, pid: int, *, timeout: Optional[float] = None) -> ExecResult:
        """Waits for a background process to end (its output is not in the
        result: see stream_process)."""
        return ExecResult.from_dict(self._call("POST", _sb(id, f"/processes/{int(pid)}/wait"), timeout=timeout))

    def process_events(self, id: str, pid: int, *, timeout: Optional[float] = None) -> Iterator[StreamEvent]:
        """Attaches to a background process: its recent output (the last 64
        KiB of each stream), then live output, ending with an "exit" event."""
        resp = self._t.send("GET", _sb(id, f"/processes/{int(pid)}/stream"), timeout=timeout)
        return self._events(resp, "process")

    def stream_process(
        self,
        id: str,
        pid: int,
        *,
        on_stdout: Optional[OutputCallback] = None,
        on_stderr: Optional[OutputCallback] = None,
        timeout: Optional[float] = None,
    ) -> ExecResult:
        """process_events that passes output to the callbacks and returns how
        the process ended."""
        ev = self._drain(self.process_events(id, pid, timeout=timeout), on_stdout, on_stderr)
        if ev.type != "exit" or ev.exec is None:
            raise UnavailableError(f"process stream ended with a {ev.type!r} event", status=0)
        return ev.exec

    def send_stdin(self, id: str, pid: int, data: Union[bytes, str], *, eof: bool = False) -> None:
        """Writes data to a background process's stdin (started with
        stdin_open); ``eof`` closes it after."""
        if isinstance(data, str):
            data = data.encode()
        q = {"eof": True} if eof else None
        self._t.send("POST", _sb(id, f"/processes/{int(pid)}/stdin"), query=q, body=bytes(data), content_type="application/octet-stream").read()

    def close_stdin(self, id: str, pid: int) -> None:
        """Closes a background process's stdin."""
        self.send_stdin(id, pid, b"", eof=True)

    def signal_process(self, id: str, pid: int, signal: Union[str, int]) -> None:
        """Sends a signal (name like "SIGTERM"/"TERM", or number) to a
        background process's group."""
        self._call("POST", _sb(id, f"/processes/{int(pid)}/signal"), {"signal": str(signal)})

    def kill_process(self, id: str, pid: int) -> None:
        """Kills a background process's group (SIGKILL)."""
        self._call("DELETE", _sb(id, f"/processes/{int(pid)}"))

    # -- workspaces ---------------------------------------------------------

    def create_workspace(
        self,
        name: str,
        snapshot_tag: str,
        *,
        timeout_secs: int = 0,
        metadata: Optional[Mapping[str, str]] = None,
        limits: Optional[Limits] = None,
        network: Union[NetworkSpec, Mapping[str, Any], None] = None,
        guest_pids_limit: int = 0,
        on_unresponsive: str = "",
    ) -> Workspace:
        """A named, long-lived sandbox forked from a snapshot."""
        body = {"name": name}
        body.update(_create_body(snapshot_tag, 1, timeout_secs, metadata, limits, network, guest_pids_limit, False, on_unresponsive))
        return Workspace.from_dict(self._call("POST", "/v1/workspaces", body, timeout=None))

    def list_workspaces(self) -> List[Workspace]:
        return [Workspace.from_dict(w) for w in self._call("GET", "/v1/workspaces")["workspaces"] or []]

    def get_workspace(self, name: str) -> Workspace:
        return Workspace.from_dict(self._call("GET", "/v1/workspaces/" + _tag(name)))

    def suspend_workspace(self, name: str) -> Workspace:
        """Saves a workspace's state into a snapshot and stops its sandbox."""
        return Workspace.from_dict(self._call("POST", "/v1/workspaces/" + _tag(name) + "/suspend", timeout=None))

    def resume_workspace(self, name: str) -> Workspace:
        """Starts a workspace's sandbox again from its latest state (a new id)."""
        return Workspace.from_dict(self._call("POST", "/v1/workspaces/" + _tag(name) + "/resume", timeout=None))

    def delete_workspace(self, name: str) -> None:
        """Removes a workspace, its sandbox and its state snapshots."""
        self._call("DELETE", "/v1/workspaces/" + _tag(name), timeout=None)


def _size(f: Any) -> Optional[int]:
    """Bytes left in a file object, when it can tell."""
    try:
        if isinstance(f, io.BytesIO):
            return len(f.getbuffer()) - f.tell()
        fd = f.fileno()
        st = os.fstat(fd)
        import stat as _stat

        if _stat.S_ISREG(st.st_mode):
            return st.st_size - f.tell()
    except (OSError, AttributeError, ValueError, io.UnsupportedOperation):
        return None
    return None
