"""AsyncSandbox: the Sandbox API for asyncio, for agents that drive many
sandboxes at once. Each call runs the blocking client in a thread pool of
its own (``FORKD_ASYNC_WORKERS`` threads, default 64), so a hundred
sandboxes each waiting on a command do not queue behind asyncio's small
default executor. Output handlers may be plain functions or coroutine
functions; either way they run on the event loop, in order.

    async with await AsyncSandbox.create(template="py") as sbx:
        r = await sbx.commands.run("echo hi")
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import inspect
import os
import threading
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

from .sandbox import (
    DEFAULT_COMMAND_TIMEOUT,
    DEFAULT_SANDBOX_TIMEOUT,
    CommandHandle,
    CommandResult,
    EntryInfo,
    Execution,
    ProcessInfo,
    Sandbox,
    SandboxInfo,
    WriteInfo,
)
from .types import EvalResult, Snapshot

__all__ = ["AsyncSandbox", "AsyncCommandHandle", "AsyncCommands", "AsyncFilesystem"]


R = TypeVar("R")
AsyncOutputHandler = Callable[[str], Union[None, Awaitable[None]]]


_lock = threading.Lock()
_executor: Optional[concurrent.futures.ThreadPoolExecutor] = None  # guarded by _lock


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            n = int(os.environ.get("FORKD_ASYNC_WORKERS", "64") or 64)
            _executor = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, n), thread_name_prefix="forkd-async")
        return _executor


async def _run(fn: Callable[..., R], *args: Any, **kw: Any) -> R:
    """fn(*args, **kw) in the pool, with this task's context variables."""
    loop = asyncio.get_running_loop()
    ctx = contextvars.copy_context()
    return await loop.run_in_executor(_pool(), functools.partial(ctx.run, fn, *args, **kw))


async def _invoke(cb: AsyncOutputHandler, s: str) -> None:
    r = cb(s)
    if inspect.isawaitable(r):
        await r


def _bridge(cb: Optional[AsyncOutputHandler], loop: asyncio.AbstractEventLoop) -> Optional[Callable[[str], None]]:
    """A handler for a worker thread that runs cb on the loop and waits for
    it, so that output keeps its order and a slow handler slows the read."""
    if cb is None:
        return None

    def call(s: str) -> None:
        asyncio.run_coroutine_threadsafe(_invoke(cb, s), loop).result()

    return call


class AsyncCommandHandle:
    """A background command, for asyncio: ``await wait()``, ``async for
    stdout, stderr, _ in handle``, ``await kill()``, ``await send_stdin()``."""

    def __init__(self, handle: CommandHandle) -> None:
        self._h = handle
        self.pid = handle.pid
        self._it: Optional[Iterator[Tuple[Optional[str], Optional[str], None]]] = None

    @property
    def stdout(self) -> str:
        return self._h.stdout

    @property
    def stderr(self) -> str:
        return self._h.stderr

    @property
    def exit_code(self) -> Optional[int]:
        return self._h.exit_code

    async def wait(self, on_stdout: Optional[AsyncOutputHandler] = None, on_stderr: Optional[AsyncOutputHandler] = None) -> CommandResult:
        loop = asyncio.get_running_loop()
        return await _run(self._h.wait, _bridge(on_stdout, loop), _bridge(on_stderr, loop))

    def __aiter__(self) -> AsyncIterator[Tuple[Optional[str], Optional[str], None]]:
        return self

    async def __anext__(self) -> Tuple[Optional[str], Optional[str], None]:
        if self._it is None:
            self._it = iter(self._h)
        it = self._it
        item = await _run(next, it, None)
        if item is None:
            raise StopAsyncIteration
        return item

    async def kill(self) -> bool:
        return await _run(self._h.kill)

    async def send_stdin(self, data: Union[str, bytes]) -> None:
        await _run(self._h.send_stdin, data)

    async def close_stdin(self) -> None:
        await _run(self._h.close_stdin)

    async def disconnect(self) -> None:
        await _run(self._h.disconnect)


class AsyncCommands:
    """``sbx.commands`` of an AsyncSandbox."""

    def __init__(self, sandbox: "AsyncSandbox") -> None:
        self._s = sandbox._s

    async def run(
        self,
        cmd: str,
        background: bool = False,
        envs: Optional[Mapping[str, str]] = None,
        user: Optional[str] = None,
        cwd: Optional[str] = None,
        on_stdout: Optional[AsyncOutputHandler] = None,
        on_stderr: Optional[AsyncOutputHandler] = None,
        stdin: Any = None,
        timeout: Optional[float] = DEFAULT_COMMAND_TIMEOUT,
        tag: str = "",
    ) -> Any:
        """As Sandbox.commands.run; background=True gives an
        AsyncCommandHandle."""
        loop = asyncio.get_running_loop()
        r = await _run(
            self._s.commands.run, cmd, background, envs, user, cwd,
            _bridge(on_stdout, loop), _bridge(on_stderr, loop), stdin, timeout, tag,
        )
        return AsyncCommandHandle(r) if isinstance(r, CommandHandle) else r

    async def list(self) -> List[ProcessInfo]:
        return await _run(self._s.commands.list)

    async def connect(self, pid: int) -> AsyncCommandHandle:
        return AsyncCommandHandle(await _run(self._s.commands.connect, pid))

    async def kill(self, pid: int) -> bool:
        return await _run(self._s.commands.kill, pid)

    async def send_stdin(self, pid: int, data: Union[str, bytes]) -> None:
        await _run(self._s.commands.send_stdin, pid, data)


class AsyncFilesystem:
    """``sbx.files`` of an AsyncSandbox."""

    def __init__(self, sandbox: "AsyncSandbox") -> None:
        self._f = sandbox._s.files

    async def read(self, path: str, format: str = "text") -> Any:
        """text (default), bytes, or with format="stream" an async iterator
        of chunks."""
        if format != "stream":
            return await _run(self._f.read, path, format)
        it = await _run(self._f.read, path, "stream")
        return _aiter(it)

    async def write(self, path: str, data: Any, mode: Optional[int] = None) -> WriteInfo:
        return await _run(self._f.write, path, data, mode)

    async def write_files(self, files: Sequence[Mapping[str, Any]]) -> List[WriteInfo]:
        return await _run(self._f.write_files, files)

    async def list(self, path: str, depth: int = 1) -> List[EntryInfo]:
        return await _run(self._f.list, path, depth)

    async def get_info(self, path: str) -> EntryInfo:
        return await _run(self._f.get_info, path)

    async def exists(self, path: str) -> bool:
        return await _run(self._f.exists, path)

    async def remove(self, path: str) -> None:
        await _run(self._f.remove, path)

    async def rename(self, old_path: str, new_path: str) -> EntryInfo:
        return await _run(self._f.rename, old_path, new_path)

    async def make_dir(self, path: str) -> bool:
        return await _run(self._f.make_dir, path)


async def _aiter(it: Iterator[bytes]) -> AsyncIterator[bytes]:
    while True:
        b = await _run(next, it, None)
        if b is None:
            return
        yield b


class AsyncSandbox:
    """A Sandbox for asyncio: the same calls, awaited."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._s = sandbox
        self.commands = AsyncCommands(self)
        self.files = AsyncFilesystem(self)

    @property
    def sandbox_id(self) -> str:
        return self._s.sandbox_id

    @property
    def id(self) -> str:
        return self._s.sandbox_id

    @property
    def envs(self) -> Dict[str, str]:
        return self._s.envs

    @property
    def sync(self) -> Sandbox:
        """The blocking Sandbox under this one."""
        return self._s

    def __repr__(self) -> str:
        return f"AsyncSandbox({self.sandbox_id!r})"

    @classmethod
    async def create(
        cls,
        template: str = "base",
        timeout: Optional[int] = DEFAULT_SANDBOX_TIMEOUT,
        metadata: Optional[Mapping[str, str]] = None,
        envs: Optional[Mapping[str, str]] = None,
        **kw: Any,
    ) -> "AsyncSandbox":
        """As Sandbox.create."""
        return cls(await _run(Sandbox.create, template, timeout, metadata, envs, **kw))

    @classmethod
    async def connect(cls, sandbox_id: str, timeout: Optional[int] = None, **kw: Any) -> "AsyncSandbox":
        return cls(await _run(Sandbox.connect, sandbox_id, timeout, **kw))

    @classmethod
    async def list(cls, **kw: Any) -> List[SandboxInfo]:
        return await _run(Sandbox.list, **kw)

    async def run_code(
        self,
        code: str,
        on_stdout: Optional[AsyncOutputHandler] = None,
        on_stderr: Optional[AsyncOutputHandler] = None,
        timeout: Optional[float] = None,
    ) -> Execution:
        loop = asyncio.get_running_loop()
        return await _run(self._s.run_code, code, _bridge(on_stdout, loop), _bridge(on_stderr, loop), timeout)

    async def eval(self, code: str, timeout: Optional[float] = None) -> EvalResult:
        return await _run(self._s.eval, code, timeout)

    async def branch(self, tag: Optional[str] = None, mode: Optional[str] = None, wait: bool = True) -> Snapshot:
        return await _run(self._s.branch, tag, mode, wait)

    async def fork(self, n: int = 1, mode: Optional[str] = None, timeout: Optional[int] = DEFAULT_SANDBOX_TIMEOUT, metadata: Optional[Mapping[str, str]] = None) -> List["AsyncSandbox"]:
        return [AsyncSandbox(s) for s in await _run(self._s.fork, n, mode, timeout, metadata)]

    async def get_info(self) -> SandboxInfo:
        return await _run(self._s.get_info)

    async def is_running(self) -> bool:
        return await _run(self._s.is_running)

    async def set_timeout(self, timeout: float) -> None:
        await _run(self._s.set_timeout, timeout)

    async def kill(self) -> bool:
        return await _run(self._s.kill)

    async def get_host(self, port: int) -> str:
        return await _run(self._s.get_host, port)

    async def set_network(self, egress: str, allow: Optional[Sequence[Any]] = None) -> None:
        await _run(self._s.set_network, egress, allow)

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.kill()
