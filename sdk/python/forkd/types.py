"""Typed results of the forkd REST API v1: dataclasses mirroring api/v1.

Field names are the JSON names. Times are timezone-aware datetimes (None
when the daemon omits them), ``*_b64`` fields are bytes. Decoding ignores
fields it does not know, since responses only gain fields.
"""

from __future__ import annotations

import base64
import dataclasses
import re
import sys
import typing
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Dict, List, Optional, Type, TypeVar, Union

__all__ = [
    "VersionInfo",
    "ErrorInfo",
    "Snapshot",
    "SnapshotInfo",
    "OCISource",
    "Operation",
    "NetworkRule",
    "NetworkSpec",
    "PublishedPort",
    "SandboxNetwork",
    "Limits",
    "Sandbox",
    "ChildFailure",
    "CreateSandboxesResponse",
    "ExecResult",
    "StreamEvent",
    "EvalError",
    "EvalResult",
    "PingResult",
    "FileInfo",
    "WriteFileResult",
    "Workspace",
    "Process",
    "parse_time",
]

T = TypeVar("T", bound="Model")

_TIME = re.compile(r"^(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$")


def parse_time(s: Optional[str]) -> Optional[datetime]:
    """An RFC 3339 time as Go writes it (nanoseconds, ``Z``) as an aware
    datetime; None for an empty or zero time."""
    if not s:
        return None
    m = _TIME.match(s)
    if not m:
        raise ValueError(f"bad time {s!r}")
    y, mo, d, h, mi, sec, frac, tz = m.groups()
    if y == "0001" and mo == "01" and d == "01":
        return None
    micro = int((frac or ".0")[1:7].ljust(6, "0"))
    if tz == "Z":
        tzinfo = timezone.utc
    else:
        off = timedelta(hours=int(tz[1:3]), minutes=int(tz[4:6]))
        tzinfo = timezone(off if tz[0] == "+" else -off)
    return datetime(int(y), int(mo), int(d), int(h), int(mi), int(sec), micro, tzinfo=tzinfo)


Decoder = Callable[[Any], Any]


def _decoder(tp: Any) -> Decoder:
    """How to turn a JSON value into a value of type tp (compiled once per
    field)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Union:
        inner = [a for a in args if a is not type(None)]
        return _decoder(inner[0])
    if origin in (list, List):
        item = _decoder(args[0])
        return lambda v: [item(x) for x in v]
    if origin in (dict, Dict):
        val = _decoder(args[1])
        return lambda v: {k: val(x) for k, x in v.items()}
    if tp is datetime:
        return parse_time
    if tp is bytes:
        return base64.b64decode
    if tp is float:
        return float
    if isinstance(tp, type) and issubclass(tp, Model):
        return lambda v: tp.from_dict(v)
    return lambda v: v


_decoders: Dict[type, Dict[str, Decoder]] = {}


class Model:
    """Base of the API's dataclasses: decoding from and encoding to JSON."""

    @classmethod
    def from_dict(cls: Type[T], d: Dict[str, Any]) -> T:
        decs = _decoders.get(cls)
        if decs is None:
            mod = sys.modules[cls.__module__].__dict__
            hints = typing.get_type_hints(cls, globalns=mod, localns=mod)
            decs = {f.name: _decoder(hints[f.name]) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
            _decoders[cls] = decs
        return cls(**{k: (None if v is None else decs[k](v)) for k, v in d.items() if k in decs})

    def to_dict(self) -> Dict[str, Any]:
        """The JSON object of this value, without its empty fields (the
        daemon's omitempty), bytes as base64."""
        out: Dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = _encode(getattr(self, f.name))
            if v is None or v == "" or v == [] or v == {} or v is False or (v == 0 and not isinstance(v, bool)):
                continue
            out[f.name] = v
        return out


def _encode(v: Any) -> Any:
    if isinstance(v, Model):
        return v.to_dict()
    if isinstance(v, (bytes, bytearray)):
        return base64.b64encode(bytes(v)).decode("ascii")
    if isinstance(v, datetime):
        return v.isoformat()
    if isinstance(v, list):
        return [_encode(x) for x in v]
    if isinstance(v, dict):
        return {k: _encode(x) for k, x in v.items()}
    return v


@dataclasses.dataclass
class VersionInfo(Model):
    """GET /version."""

    version: str = ""
    api_version: str = ""
    backend: str = ""
    accelerator: str = ""
    data_dir: str = ""


@dataclasses.dataclass
class ErrorInfo(Model):
    """An error as the API writes it: a stable code and a message."""

    code: str = ""
    message: str = ""


@dataclasses.dataclass
class Snapshot(Model):
    """A warm snapshot children are forked from. ``status`` is writing,
    ready, failed or corrupt; ``problem`` says why this daemon cannot fork
    it; ``kind`` is boot or branch."""

    tag: str = ""
    status: str = ""
    image: str = ""
    backend: str = ""
    accelerator: str = ""
    memory_mib: int = 0
    vcpus: int = 0
    size_bytes: int = 0
    refcount: int = 0
    created: Optional[datetime] = None
    parent: str = ""
    error: str = ""
    network: bool = False
    python: str = ""
    problem: str = ""
    kind: str = ""
    mode: str = ""
    source: str = ""
    depth: int = 0
    ephemeral: bool = False


@dataclasses.dataclass
class SnapshotInfo(Snapshot):
    """GET /v1/snapshots/{tag}/info: the snapshot, its chain and sizes."""

    logical_bytes: int = 0
    physical_bytes: int = 0
    layer_bytes: int = 0
    ancestors: List[str] = dataclasses.field(default_factory=list)
    chain_error: str = ""
    dependents: List[str] = dataclasses.field(default_factory=list)
    pause_ms: float = 0.0
    dirty_bytes: int = 0
    total_ms: float = 0.0


@dataclasses.dataclass
class OCISource(Model):
    """An OCI image to import when building a snapshot: a registry
    reference, or a docker-save tarball / OCI layout in the daemon's import
    dir."""

    ref: str = ""
    extra: List[str] = dataclasses.field(default_factory=list)
    preload: List[str] = dataclasses.field(default_factory=list)
    insecure: bool = False


@dataclasses.dataclass
class Operation(Model):
    """Long work (a snapshot build). ``status`` is running, succeeded or
    failed; ``progress`` holds the latest progress lines and
    ``progress_lines`` counts every line ever reported."""

    id: str = ""
    kind: str = ""
    status: str = ""
    snapshot: str = ""
    error: Optional[ErrorInfo] = None
    created: Optional[datetime] = None
    finished: Optional[datetime] = None
    progress: List[str] = dataclasses.field(default_factory=list)
    progress_lines: int = 0


@dataclasses.dataclass
class NetworkRule(Model):
    """Allows connections to ``cidr``, optionally for one protocol (tcp,
    udp, icmp) and some ports ("443", "8000-8100")."""

    cidr: str = ""
    proto: str = ""
    ports: List[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class NetworkSpec(Model):
    """A sandbox's egress policy (allow, deny, allowlist) and, at create,
    the guest ports to publish."""

    egress: str = ""
    allow: List[NetworkRule] = dataclasses.field(default_factory=list)
    publish: List[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class PublishedPort(Model):
    """A guest port reachable on a host port."""

    proto: str = ""
    guest_port: int = 0
    host_port: int = 0


@dataclasses.dataclass
class SandboxNetwork(Model):
    """A sandbox's own network as it stands."""

    address: str = ""
    egress: str = ""
    allow: List[NetworkRule] = dataclasses.field(default_factory=list)
    ports: List[PublishedPort] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Limits(Model):
    """Resource limits of a sandbox; zero fields set none. Each needs the
    daemon to run as root."""

    memory_limit_mib: int = 0
    cpus: float = 0.0
    pids_limit: int = 0
    io_weight: int = 0
    io_read_bps: int = 0
    io_write_bps: int = 0


@dataclasses.dataclass
class Sandbox(Model):
    """One child VM. ``status``: starting, running, unresponsive, frozen
    (idle, its VMM stopped until the next call), dead, oom. The limits in
    force sit in the sandbox itself; ``disk_mib`` is its writable disk (0:
    none), ``idle_freeze_secs`` its own idle time before a freeze (0: the
    daemon's, -1 never)."""

    id: str = ""
    snapshot_tag: str = ""
    status: str = ""
    pid: int = 0
    created: Optional[datetime] = None
    ready_ms: int = 0
    expires_at: Optional[datetime] = None
    metadata: Dict[str, str] = dataclasses.field(default_factory=dict)
    memory_limit_mib: int = 0
    cpus: float = 0.0
    pids_limit: int = 0
    io_weight: int = 0
    io_read_bps: int = 0
    io_write_bps: int = 0
    network: Optional[SandboxNetwork] = None
    on_unresponsive: str = ""
    disk_mib: int = 0
    idle_freeze_secs: int = 0


@dataclasses.dataclass
class ChildFailure(Model):
    """A child of a batch that did not come up (keep_partial)."""

    id: str = ""
    error: Optional[ErrorInfo] = None


@dataclasses.dataclass
class CreateSandboxesResponse(Model):
    """POST /v1/sandboxes and POST /v1/sandboxes/{id}/fork."""

    sandboxes: List[Sandbox] = dataclasses.field(default_factory=list)
    failed: List[ChildFailure] = dataclasses.field(default_factory=list)
    wall_ms: float = 0.0


def _text(s: str, b: Optional[bytes]) -> bytes:
    return b if b is not None else s.encode()


@dataclasses.dataclass
class ExecResult(Model):
    """How a process ended. ``exit_code`` is -1 when a signal ended it.
    Buffered output is in ``stdout``/``stderr`` when valid UTF-8, else in
    ``stdout_b64``/``stderr_b64``; ``stdout_bytes`` gives it either way."""

    exit_code: int = 0
    signal: str = ""
    timed_out: bool = False
    duration_ms: int = 0
    stdout: str = ""
    stderr: str = ""
    stdout_b64: Optional[bytes] = None
    stderr_b64: Optional[bytes] = None
    truncated: bool = False

    @property
    def stdout_bytes(self) -> bytes:
        return _text(self.stdout, self.stdout_b64)

    @property
    def stderr_bytes(self) -> bytes:
        return _text(self.stderr, self.stderr_b64)


@dataclasses.dataclass
class EvalError(Model):
    """An exception raised by evaluated code."""

    name: str = ""
    message: str = ""
    traceback: str = ""


@dataclasses.dataclass
class EvalResult(Model):
    """The outcome of an eval: ``value`` is repr() of the last expression;
    an exception or a timeout of the code is reported here, not raised."""

    value: str = ""
    stdout: str = ""
    stderr: str = ""
    truncated: bool = False
    error: Optional[EvalError] = None
    timed_out: bool = False
    restarted: bool = False
    duration_ms: int = 0


@dataclasses.dataclass
class StreamEvent(Model):
    """One NDJSON line of a streamed exec, eval or process: ``type`` is
    stdout, stderr, exit (``exec`` set), result (``eval`` set) or error."""

    type: str = ""
    data: str = ""
    data_b64: Optional[bytes] = None
    exec: Optional[ExecResult] = None
    eval: Optional[EvalResult] = None
    error: Optional[ErrorInfo] = None

    @property
    def payload(self) -> bytes:
        """The output of a stdout or stderr event, as bytes."""
        return _text(self.data, self.data_b64)


@dataclasses.dataclass
class PingResult(Model):
    """POST /v1/sandboxes/{id}/ping."""

    agent_version: str = ""
    protocol_version: int = 0
    uptime_ms: int = 0
    hostname: str = ""
    features: List[str] = dataclasses.field(default_factory=list)
    python_ready: bool = False
    latency_ms: float = 0.0


@dataclasses.dataclass
class FileInfo(Model):
    """One guest path (a final symlink is not followed). ``type`` is file,
    dir, symlink or other."""

    name: str = ""
    path: str = ""
    type: str = ""
    size: int = 0
    mode: int = 0
    mtime: Optional[datetime] = None
    target: str = ""


@dataclasses.dataclass
class WriteFileResult(Model):
    """PUT /v1/sandboxes/{id}/files."""

    path: str = ""
    bytes: int = 0


@dataclasses.dataclass
class Workspace(Model):
    """A named, long-lived sandbox; ``status`` is running or suspended."""

    name: str = ""
    snapshot: str = ""
    status: str = ""
    sandbox: str = ""
    states: List[str] = dataclasses.field(default_factory=list)
    created: Optional[datetime] = None
    updated: Optional[datetime] = None


@dataclasses.dataclass
class Process(Model):
    """A background process; ``result`` is set once it has ended."""

    pid: int = 0
    tag: str = ""
    args: List[str] = dataclasses.field(default_factory=list)
    cwd: str = ""
    started_at: Optional[datetime] = None
    running: bool = False
    result: Optional[ExecResult] = None
