"""E2B-shaped sandboxes over the forkd REST API.

    from forkd import Sandbox
    with Sandbox.create(template="py") as sbx:
        print(sbx.commands.run("echo hi").stdout)
        sbx.files.write("/root/a.txt", "data")
        print(sbx.run_code("x = 41; x + 1").text)   # '42'

The shape follows E2B's Python SDK (``e2b`` and ``e2b-code-interpreter``):
``Sandbox.create``/``connect``, ``sbx.commands``, ``sbx.files``,
``sbx.run_code``, plus forkd's own ``branch``, ``fork`` and ``eval``.
"""

from __future__ import annotations

import codecs
import dataclasses
import enum
import stat as _stat
import threading
from datetime import datetime
from typing import IO, Any, Callable, Dict, Iterator, List, Literal, Mapping, Optional, Sequence, Tuple, Union, overload

from .controller import Controller
from .errors import DeadlineExceededError, ForkdError, NotFoundError
from .types import EvalResult, ExecResult, FileInfo, Limits, NetworkSpec, Process, Snapshot, StreamEvent
from .types import Sandbox as SandboxRecord

__all__ = [
    "Sandbox",
    "SandboxInfo",
    "Commands",
    "CommandResult",
    "CommandHandle",
    "CommandExitException",
    "CommandTimeoutError",
    "ProcessInfo",
    "Filesystem",
    "EntryInfo",
    "WriteInfo",
    "FileType",
    "Execution",
    "Result",
    "Logs",
    "ExecutionError",
]

#: Default sandbox lifetime, as E2B's: killed this long after create.
DEFAULT_SANDBOX_TIMEOUT = 300
#: Default command timeout, as E2B's.
DEFAULT_COMMAND_TIMEOUT = 60.0

OutputHandler = Callable[[str], Any]


# -- commands -------------------------------------------------------------


@dataclasses.dataclass
class CommandResult:
    """How a command ended: its output (text) and exit code; ``error``
    says why it failed ("exit status 3", "signal: SIGKILL", ...)."""

    stdout: str
    stderr: str
    exit_code: int
    error: Optional[str] = None


class CommandExitException(ForkdError):
    """A command ended with a non-zero exit code (or a signal). Carries the
    CommandResult's fields."""

    code = "command_exit"

    def __init__(self, result: CommandResult) -> None:
        super().__init__(f"command failed: {result.error or ('exit status %d' % result.exit_code)}", status=0)
        self.result = result
        self.stdout = result.stdout
        self.stderr = result.stderr
        self.exit_code = result.exit_code
        self.error = result.error


class CommandTimeoutError(DeadlineExceededError):
    """A command ran past its timeout and was killed; ``result`` holds what
    it wrote until then."""

    def __init__(self, message: str, result: CommandResult) -> None:
        super().__init__(message, status=0)
        self.result = result


def _failure(r: ExecResult) -> Optional[str]:
    if r.timed_out:
        return "timed out"
    if r.signal:
        return f"signal: {r.signal}"
    if r.exit_code != 0:
        return f"exit status {r.exit_code}"
    return None


def _result(r: ExecResult, stdout: Optional[str] = None, stderr: Optional[str] = None) -> CommandResult:
    out = stdout if stdout is not None else r.stdout_bytes.decode("utf-8", "replace")
    err = stderr if stderr is not None else r.stderr_bytes.decode("utf-8", "replace")
    return CommandResult(stdout=out, stderr=err, exit_code=r.exit_code, error=_failure(r))


def _check(r: ExecResult, cr: CommandResult, timeout: Optional[float]) -> CommandResult:
    if r.timed_out:
        raise CommandTimeoutError(f"command timed out after {timeout}s", cr)
    if cr.exit_code != 0 or cr.error:
        raise CommandExitException(cr)
    return cr


class _Text:
    """Bytes of one stream to text, a multi-byte character split across
    chunks kept whole; each piece goes to a handler and is kept."""

    def __init__(self, handler: Optional[OutputHandler]) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        self._handler = handler
        self.parts: List[str] = []

    def feed(self, b: bytes, final: bool = False) -> str:
        s = self._dec.decode(b, final)
        if s:
            self.parts.append(s)
            if self._handler is not None:
                self._handler(s)
        return s

    def text(self) -> str:
        self.feed(b"", True)
        return "".join(self.parts)


@dataclasses.dataclass
class ProcessInfo:
    """A background command (E2B's ProcessInfo): pid, tag, argv, cwd."""

    pid: int
    tag: Optional[str]
    cmd: str
    args: List[str]
    cwd: Optional[str]
    running: bool = True
    exit_code: Optional[int] = None


class CommandHandle:
    """A command running in the background. ``wait()`` returns its
    CommandResult (raising CommandExitException on a non-zero exit);
    iterating yields ``(stdout, stderr, None)`` tuples, one set, as output
    comes. Output is read through the processes API, which replays the last
    64 KiB of each stream when it attaches."""

    def __init__(
        self,
        sandbox: "Sandbox",
        pid: int,
        on_stdout: Optional[OutputHandler] = None,
        on_stderr: Optional[OutputHandler] = None,
    ) -> None:
        self._sbx = sandbox
        self.pid = pid
        self._out = _Text(on_stdout)
        self._err = _Text(on_stderr)
        self._lock = threading.Lock()  # one reader of the stream at a time
        self._events: Optional[Iterator[StreamEvent]] = None  # guarded by _lock
        self._end: Optional[ExecResult] = None
        self._thread: Optional[threading.Thread] = None
        self._thread_error: Optional[BaseException] = None
        if on_stdout is not None or on_stderr is not None:
            self._thread = threading.Thread(target=self._follow, name=f"forkd-cmd-{pid}", daemon=True)
            self._thread.start()

    @property
    def stdout(self) -> str:
        """Output read so far."""
        return "".join(self._out.parts)

    @property
    def stderr(self) -> str:
        return "".join(self._err.parts)

    @property
    def exit_code(self) -> Optional[int]:
        """The exit code once the command ended (as far as read)."""
        return None if self._end is None else self._end.exit_code

    def _next(self) -> Optional[Tuple[Optional[str], Optional[str], None]]:
        """The next piece of output, None at the end. Caller holds _lock."""
        if self._end is not None:
            return None
        if self._events is None:
            self._events = self._sbx._c.process_events(self._sbx.sandbox_id, self.pid)
        for ev in self._events:
            if ev.type == "stdout":
                s = self._out.feed(ev.payload)
                if s:
                    return (s, None, None)
            elif ev.type == "stderr":
                s = self._err.feed(ev.payload)
                if s:
                    return (None, s, None)
            elif ev.exec is not None:
                self._end = ev.exec
                return None
        return None

    def _follow(self) -> None:
        try:
            with self._lock:
                while self._next() is not None:
                    pass
        except BaseException as e:  # handed to wait()
            self._thread_error = e

    def __iter__(self) -> Iterator[Tuple[Optional[str], Optional[str], None]]:
        if self._thread is not None:
            raise RuntimeError("this handle's output goes to its on_stdout/on_stderr handlers")
        while True:
            with self._lock:
                item = self._next()
            if item is None:
                return
            yield item

    def wait(self, on_stdout: Optional[OutputHandler] = None, on_stderr: Optional[OutputHandler] = None) -> CommandResult:
        """Waits for the command to end; its output not yet read goes to the
        handlers. Raises CommandExitException on a non-zero exit."""
        if self._thread is not None:
            self._thread.join()
            if self._thread_error is not None:
                raise self._thread_error
        else:
            with self._lock:
                while True:
                    item = self._next()
                    if item is None:
                        break
                    if item[0] is not None and on_stdout is not None:
                        on_stdout(item[0])
                    if item[1] is not None and on_stderr is not None:
                        on_stderr(item[1])
        assert self._end is not None
        cr = _result(self._end, self._out.text(), self._err.text())
        return _check(self._end, cr, None)

    def kill(self) -> bool:
        """Kills the command (SIGKILL to its group); False when it is gone."""
        return self._sbx.commands.kill(self.pid)

    def send_stdin(self, data: Union[str, bytes]) -> None:
        """Writes to the command's stdin (open unless run with stdin=False)."""
        self._sbx.commands.send_stdin(self.pid, data)

    def close_stdin(self) -> None:
        self._sbx._c.close_stdin(self._sbx.sandbox_id, self.pid)

    def disconnect(self) -> None:
        """Stops reading output; the command goes on."""
        with self._lock:
            ev, self._events = self._events, None
        if ev is not None:
            ev.close()  # type: ignore[attr-defined]


class Commands:
    """``sbx.commands``: run commands in the sandbox."""

    def __init__(self, sandbox: "Sandbox") -> None:
        self._sbx = sandbox

    @overload
    def run(
        self,
        cmd: str,
        background: Literal[False] = ...,
        envs: Optional[Mapping[str, str]] = ...,
        user: Optional[str] = ...,
        cwd: Optional[str] = ...,
        on_stdout: Optional[OutputHandler] = ...,
        on_stderr: Optional[OutputHandler] = ...,
        stdin: Any = ...,
        timeout: Optional[float] = ...,
        tag: str = ...,
    ) -> CommandResult: ...

    @overload
    def run(
        self,
        cmd: str,
        background: Literal[True],
        envs: Optional[Mapping[str, str]] = ...,
        user: Optional[str] = ...,
        cwd: Optional[str] = ...,
        on_stdout: Optional[OutputHandler] = ...,
        on_stderr: Optional[OutputHandler] = ...,
        stdin: Any = ...,
        timeout: Optional[float] = ...,
        tag: str = ...,
    ) -> CommandHandle: ...

    def run(
        self,
        cmd: str,
        background: bool = False,
        envs: Optional[Mapping[str, str]] = None,
        user: Optional[str] = None,
        cwd: Optional[str] = None,
        on_stdout: Optional[OutputHandler] = None,
        on_stderr: Optional[OutputHandler] = None,
        stdin: Any = None,
        timeout: Optional[float] = DEFAULT_COMMAND_TIMEOUT,
        tag: str = "",
    ) -> Union[CommandResult, CommandHandle]:
        """Runs ``cmd`` under /bin/sh -c with the sandbox's envs (updated by
        ``envs``). In the foreground it returns a CommandResult and raises
        CommandExitException on a non-zero exit, CommandTimeoutError past
        ``timeout`` seconds (default 60; None or 0: none). ``stdin`` is the
        whole input (str or bytes), or a binary file or iterable of bytes
        streamed to it. With ``background=True`` it returns a CommandHandle
        at once; its stdin stays open for send_stdin unless ``stdin`` is
        given (its whole input) or False (none)."""
        sid = self._sbx.sandbox_id
        env = dict(self._sbx.envs)
        env.update(envs or {})
        c = self._sbx._c
        if background:
            data = stdin if isinstance(stdin, (str, bytes, bytearray)) else None
            p = c.start_process(
                sid, shell=cmd, env=env, cwd=cwd, user=user, stdin=data,
                stdin_open=data is None and stdin is not False, tag=tag, timeout=timeout or None,
            )
            return CommandHandle(self._sbx, p.pid, on_stdout, on_stderr)
        streamed = not (stdin is None or isinstance(stdin, (str, bytes, bytearray)))
        if on_stdout is None and on_stderr is None and not streamed:
            r = c.exec(sid, shell=cmd, env=env, cwd=cwd, user=user, stdin=stdin, timeout=timeout or None)
            return _check(r, _result(r), timeout)
        out, err = _Text(on_stdout), _Text(on_stderr)
        r = c.exec_stream(
            sid, shell=cmd, env=env, cwd=cwd, user=user, stdin=stdin, timeout=timeout or None,
            on_stdout=out.feed, on_stderr=err.feed,
        )
        return _check(r, _result(r, out.text(), err.text()), timeout)

    def list(self) -> List[ProcessInfo]:
        """Background commands, running and recently ended."""
        return [_pinfo(p) for p in self._sbx._c.list_processes(self._sbx.sandbox_id)]

    def connect(self, pid: int, on_stdout: Optional[OutputHandler] = None, on_stderr: Optional[OutputHandler] = None) -> CommandHandle:
        """A handle on a background command started earlier."""
        self._sbx._c.get_process(self._sbx.sandbox_id, pid)  # NotFoundError now, not later
        return CommandHandle(self._sbx, pid, on_stdout, on_stderr)

    def kill(self, pid: int) -> bool:
        """Kills a background command; False when there is none."""
        try:
            self._sbx._c.kill_process(self._sbx.sandbox_id, pid)
            return True
        except NotFoundError:
            return False

    def send_stdin(self, pid: int, data: Union[str, bytes]) -> None:
        """Writes to a background command's stdin."""
        self._sbx._c.send_stdin(self._sbx.sandbox_id, pid, data)


def _pinfo(p: Process) -> ProcessInfo:
    cmd = p.args[2] if len(p.args) == 3 and p.args[:2] == ["/bin/sh", "-c"] else " ".join(p.args)
    return ProcessInfo(
        pid=p.pid, tag=p.tag or None, cmd=cmd, args=list(p.args), cwd=p.cwd or None,
        running=p.running, exit_code=None if p.result is None else p.result.exit_code,
    )


# -- files ----------------------------------------------------------------


class FileType(str, enum.Enum):
    """Type of a guest path (compares equal to its string)."""

    FILE = "file"
    DIR = "dir"
    SYMLINK = "symlink"
    OTHER = "other"


@dataclasses.dataclass
class EntryInfo:
    """A guest path, as E2B's EntryInfo."""

    name: str
    type: FileType
    path: str
    size: int
    mode: int
    permissions: str
    modified_time: Optional[datetime]
    symlink_target: Optional[str] = None


@dataclasses.dataclass
class WriteInfo:
    """What a write made."""

    name: str
    type: Optional[FileType]
    path: str


def _entry(fi: FileInfo) -> EntryInfo:
    try:
        t = FileType(fi.type)
    except ValueError:
        t = FileType.OTHER
    return EntryInfo(
        name=fi.name, type=t, path=fi.path, size=fi.size, mode=fi.mode,
        permissions=_stat.filemode(fi.mode)[1:], modified_time=fi.mtime, symlink_target=fi.target or None,
    )


class Filesystem:
    """``sbx.files``: the sandbox's files. Reads and writes stream, so large
    files never sit whole in the daemon."""

    def __init__(self, sandbox: "Sandbox") -> None:
        self._sbx = sandbox

    @overload
    def read(self, path: str, format: Literal['text'] = ...) -> str: ...

    @overload
    def read(self, path: str, format: Literal['bytes']) -> bytes: ...

    @overload
    def read(self, path: str, format: Literal['stream']) -> Iterator[bytes]: ...

    def read(self, path: str, format: str = "text") -> Union[str, bytes, Iterator[bytes]]:
        """The file at path: text (UTF-8) by default, bytes with
        ``format="bytes"``, an iterator of chunks with ``format="stream"``."""
        c, sid = self._sbx._c, self._sbx.sandbox_id
        if format == "stream":
            return c.iter_file(sid, path)
        if format not in ("text", "bytes"):
            raise ValueError(f"format {format!r}: want text, bytes or stream")
        data = c.read_file(sid, path)
        assert isinstance(data, bytes)
        return data if format == "bytes" else data.decode("utf-8")

    def read_to(self, path: str, out: IO[bytes]) -> int:
        """Streams the file at path into a binary file; returns its length."""
        n = self._sbx._c.read_file(self._sbx.sandbox_id, path, out)
        assert isinstance(n, int)
        return n

    def write(self, path: str, data: Union[str, bytes, IO[bytes], Any], mode: Optional[int] = None) -> WriteInfo:
        """Writes (replaces, atomically) the file at path: data is str,
        bytes, a binary file or an iterable of bytes, streamed."""
        r = self._sbx._c.write_file(self._sbx.sandbox_id, path, data, mode=mode)
        return WriteInfo(name=r.path.rsplit("/", 1)[-1], type=FileType.FILE, path=r.path)

    def write_files(self, files: Sequence[Mapping[str, Any]]) -> List[WriteInfo]:
        """Writes several files: each ``{"path": ..., "data": ...}``."""
        return [self.write(f["path"], f["data"]) for f in files]

    def list(self, path: str, depth: int = 1) -> List[EntryInfo]:
        """A directory's entries, ``depth`` levels down."""
        return [_entry(e) for e in self._sbx._c.list_dir(self._sbx.sandbox_id, path, depth)]

    def get_info(self, path: str) -> EntryInfo:
        return _entry(self._sbx._c.stat(self._sbx.sandbox_id, path))

    def exists(self, path: str) -> bool:
        try:
            self._sbx._c.stat(self._sbx.sandbox_id, path)
            return True
        except NotFoundError:
            return False

    def remove(self, path: str) -> None:
        """Removes a file or a directory with what it holds."""
        self._sbx._c.remove(self._sbx.sandbox_id, path, recursive=True)

    def rename(self, old_path: str, new_path: str) -> EntryInfo:
        self._sbx._c.rename(self._sbx.sandbox_id, old_path, new_path)
        return self.get_info(new_path)

    def make_dir(self, path: str) -> bool:
        """Makes a directory and its parents; False when it existed."""
        return self._sbx._c.make_dir(self._sbx.sandbox_id, path)


# -- code -----------------------------------------------------------------


@dataclasses.dataclass
class Result:
    """One result of run_code: ``text`` is repr() of the last expression."""

    text: Optional[str] = None
    is_main_result: bool = True

    def formats(self) -> List[str]:
        return ["text"] if self.text is not None else []

    def __str__(self) -> str:
        return self.text or ""


@dataclasses.dataclass
class Logs:
    """Output of run_code, as the chunks it came in."""

    stdout: List[str] = dataclasses.field(default_factory=list)
    stderr: List[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ExecutionError:
    """An exception raised by the code: its class name, its message
    (``value``) and its traceback."""

    name: str
    value: str
    traceback: str


@dataclasses.dataclass
class Execution:
    """The outcome of run_code, shaped like E2B's code interpreter."""

    results: List[Result] = dataclasses.field(default_factory=list)
    logs: Logs = dataclasses.field(default_factory=Logs)
    error: Optional[ExecutionError] = None
    execution_count: Optional[int] = None
    #: forkd's own result (duration, restarted, timed_out...).
    raw: Optional[EvalResult] = None

    @property
    def text(self) -> Optional[str]:
        """The main result's text."""
        for r in self.results:
            if r.is_main_result:
                return r.text
        return None


def _execution(r: EvalResult, logs: Optional[Logs] = None, timeout: Optional[float] = None) -> Execution:
    if logs is None:
        logs = Logs(stdout=[r.stdout] if r.stdout else [], stderr=[r.stderr] if r.stderr else [])
    err = None
    if r.error is not None:
        err = ExecutionError(name=r.error.name, value=r.error.message, traceback=r.error.traceback)
    elif r.timed_out:
        err = ExecutionError(name="TimeoutError", value=f"execution timed out after {timeout}s", traceback="")
    results = [Result(text=r.value)] if r.value else []
    return Execution(results=results, logs=logs, error=err, raw=r)


# -- sandbox ---------------------------------------------------------------


@dataclasses.dataclass
class SandboxInfo:
    """A sandbox, as E2B's SandboxInfo, with forkd's record in ``record``."""

    sandbox_id: str
    template_id: str
    metadata: Dict[str, str]
    started_at: Optional[datetime]
    end_at: Optional[datetime]
    state: str
    record: SandboxRecord


def _info(s: SandboxRecord) -> SandboxInfo:
    return SandboxInfo(
        sandbox_id=s.id, template_id=s.snapshot_tag, metadata=dict(s.metadata), started_at=s.created,
        end_at=s.expires_at, state=s.status, record=s,
    )


class Sandbox:
    """One forkd sandbox, E2B-shaped. Make one with :meth:`create` or
    :meth:`connect`; as a context manager it is killed on exit."""

    def __init__(self, sandbox_id: str, controller: Controller, envs: Optional[Mapping[str, str]] = None, record: Optional[SandboxRecord] = None) -> None:
        self.sandbox_id = sandbox_id
        self._c = controller
        #: Default environment of commands.
        self.envs: Dict[str, str] = dict(envs or {})
        self.record = record
        self.commands = Commands(self)
        self.files = Filesystem(self)

    @property
    def id(self) -> str:
        return self.sandbox_id

    @property
    def controller(self) -> Controller:
        return self._c

    def __repr__(self) -> str:
        return f"Sandbox({self.sandbox_id!r})"

    @staticmethod
    def _controller(controller: Optional[Controller], url: Optional[str], token: Optional[str], socket: Optional[str]) -> Controller:
        if controller is not None:
            return controller
        return Controller(url=url, token=token, socket=socket)

    @classmethod
    def create(
        cls,
        template: str = "base",
        timeout: Optional[int] = DEFAULT_SANDBOX_TIMEOUT,
        metadata: Optional[Mapping[str, str]] = None,
        envs: Optional[Mapping[str, str]] = None,
        *,
        controller: Optional[Controller] = None,
        url: Optional[str] = None,
        token: Optional[str] = None,
        socket: Optional[str] = None,
        limits: Optional[Limits] = None,
        network: Union[NetworkSpec, Mapping[str, Any], None] = None,
        guest_pids_limit: int = 0,
        on_unresponsive: str = "",
        disk_mib: int = 0,
        idle_freeze_secs: int = 0,
    ) -> "Sandbox":
        """Forks a sandbox of snapshot ``template``. It is killed ``timeout``
        seconds after it is ready (default 300, as E2B; None or 0: never).
        ``envs`` become the default environment of its commands.
        ``disk_mib`` and ``idle_freeze_secs``: see Controller.create_sandboxes."""
        c = cls._controller(controller, url, token, socket)
        s = c.create_sandbox(
            template, timeout_secs=int(timeout or 0), metadata=metadata, limits=limits, network=network,
            guest_pids_limit=guest_pids_limit, on_unresponsive=on_unresponsive,
            disk_mib=disk_mib, idle_freeze_secs=idle_freeze_secs,
        )
        return cls(s.id, c, envs, s)

    @classmethod
    def connect(
        cls,
        sandbox_id: str,
        timeout: Optional[int] = None,
        *,
        envs: Optional[Mapping[str, str]] = None,
        controller: Optional[Controller] = None,
        url: Optional[str] = None,
        token: Optional[str] = None,
        socket: Optional[str] = None,
    ) -> "Sandbox":
        """A running sandbox by id (NotFoundError if there is none). With
        ``timeout`` its deadline becomes that many seconds from now. The
        envs given at create are not kept by the daemon: pass them again."""
        c = cls._controller(controller, url, token, socket)
        s = c.set_timeout(sandbox_id, timeout) if timeout else c.get_sandbox(sandbox_id)
        return cls(s.id, c, envs, s)

    @classmethod
    def list(
        cls,
        *,
        template: Optional[str] = None,
        metadata: Optional[Mapping[str, str]] = None,
        state: Optional[str] = "running",
        controller: Optional[Controller] = None,
        url: Optional[str] = None,
        token: Optional[str] = None,
        socket: Optional[str] = None,
    ) -> List[SandboxInfo]:
        """Sandboxes (running ones by default), filtered."""
        c = cls._controller(controller, url, token, socket)
        return [_info(s) for s in c.list_sandboxes(snapshot=template, status=state, metadata=metadata)]

    # -- lifetime --

    def get_info(self) -> SandboxInfo:
        s = self._c.get_sandbox(self.sandbox_id)
        self.record = s
        return _info(s)

    def is_running(self) -> bool:
        """Whether its agent answers."""
        try:
            self._c.ping(self.sandbox_id)
            return True
        except ForkdError:
            return False

    def set_timeout(self, timeout: float) -> None:
        """Kills the sandbox ``timeout`` seconds from now (0: never)."""
        self.record = self._c.set_timeout(self.sandbox_id, timeout)

    def kill(self) -> bool:
        """Kills the sandbox; False when it was gone already."""
        try:
            self._c.delete_sandbox(self.sandbox_id)
            return True
        except NotFoundError:
            return False

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kill()

    # -- code --

    def run_code(
        self,
        code: str,
        on_stdout: Optional[OutputHandler] = None,
        on_stderr: Optional[OutputHandler] = None,
        timeout: Optional[float] = None,
    ) -> Execution:
        """Runs Python in the sandbox's warm interpreter, whose state is kept
        across calls. ``results[0].text`` is repr() of the last expression;
        an exception is in ``.error`` (name, value, traceback), not raised.
        UnimplementedError in an image without Python."""
        if on_stdout is None and on_stderr is None:
            return _execution(self._c.eval(self.sandbox_id, code, timeout=timeout), timeout=timeout)
        logs = Logs()

        def out(b: bytes) -> None:
            s = b.decode("utf-8", "replace")
            logs.stdout.append(s)
            if on_stdout is not None:
                on_stdout(s)

        def err(b: bytes) -> None:
            s = b.decode("utf-8", "replace")
            logs.stderr.append(s)
            if on_stderr is not None:
                on_stderr(s)

        r = self._c.eval_stream(self.sandbox_id, code, on_stdout=out, on_stderr=err, timeout=timeout)
        return _execution(r, logs, timeout)

    def eval(self, code: str, timeout: Optional[float] = None) -> EvalResult:
        """forkd's own eval: the raw EvalResult (value, stdout, stderr, error,
        timed_out, restarted, duration_ms)."""
        return self._c.eval(self.sandbox_id, code, timeout=timeout)

    # -- branch and fork --

    def branch(self, tag: Optional[str] = None, mode: Optional[str] = None, wait: bool = True) -> Snapshot:
        """Snapshots this running sandbox into a new snapshot that more
        sandboxes fork from (``Sandbox.create(template=snap.tag)``). ``mode``:
        full, diff (default) or live."""
        return self._c.branch(self.sandbox_id, tag, mode=mode, wait=wait)

    def fork(
        self,
        n: int = 1,
        mode: Optional[str] = None,
        timeout: Optional[int] = DEFAULT_SANDBOX_TIMEOUT,
        metadata: Optional[Mapping[str, str]] = None,
        *,
        idle_freeze_secs: int = 0,
    ) -> List["Sandbox"]:
        """``n`` new sandboxes from this one's current state (memory,
        files, processes, disk); they keep this sandbox's envs."""
        res = self._c.fork_from(
            self.sandbox_id, n, mode=mode, timeout_secs=int(timeout or 0), metadata=metadata, idle_freeze_secs=idle_freeze_secs
        )
        return [type(self)(s.id, self._c, self.envs, s) for s in res.sandboxes]

    # -- network --

    def get_host(self, port: int) -> str:
        """``host:port`` where the host reaches guest TCP ``port`` (published
        on a host port on first use)."""
        rec = self._c.get_sandbox(self.sandbox_id)
        for p in (rec.network.ports if rec.network else []):
            if p.guest_port == port:
                return f"127.0.0.1:{p.host_port}"
        pp = self._c.publish(self.sandbox_id, port)
        return f"127.0.0.1:{pp.host_port}"

    def set_network(self, egress: str, allow: Optional[Sequence[Any]] = None) -> None:
        """Replaces the egress policy: allow, deny or allowlist (with
        ``allow`` rules)."""
        self.record = self._c.set_network(self.sandbox_id, egress, allow)
