"""HTTP/1.1 to the daemon over a unix socket or TCP (TLS), with a pool of
kept-alive connections and bounded retries. Standard library only.

Safe for concurrent use: each request takes a connection of its own from
the pool (guarded by ``_lock``) and gives it back once its response has
been read to the end.
"""

from __future__ import annotations

import email.utils
import http.client
import io
import json
import random
import select
import socket
import ssl
import threading
import time
import urllib.parse
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from .errors import DeadlineExceededError, ForkdError, InvalidArgumentError, UnavailableError, error_for

Query = Optional[Union[Mapping[str, Any], Sequence[Tuple[str, Any]]]]
Body = Union[None, bytes, bytearray, memoryview, io.IOBase, Iterable[bytes], Any]

# Methods that may be sent again after an answer lost on the way.
IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})

# Connections idle longer than this are not reused (the daemon closes them
# after two minutes).
_MAX_IDLE = 60.0

_BLOCK = 256 << 10


class _Default:
    def __repr__(self) -> str:
        return "DEFAULT"


#: A timeout argument meaning "the transport's timeout".
DEFAULT: Any = _Default()
_DEFAULT = DEFAULT


class _UnixConnection(http.client.HTTPConnection):
    """HTTPConnection over a unix socket; Host is "localhost"."""

    def __init__(self, path: str, timeout: Optional[float]) -> None:
        super().__init__("localhost", timeout=timeout, blocksize=_BLOCK)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(self.timeout)
            s.connect(self._path)
        except BaseException:
            s.close()
            raise
        self.sock = s


class Endpoint:
    """Where the daemon listens: a parsed unix://, http:// or https:// URL."""

    def __init__(self, url: str) -> None:
        u = urllib.parse.urlsplit(url)
        self.url = url
        self.scheme = u.scheme
        if u.scheme == "unix":
            path = u.path or u.netloc
            if u.netloc and u.path:  # unix://relative/path
                path = u.netloc + u.path
            if not path:
                raise InvalidArgumentError(f"daemon url {url!r}: want unix:///path/to/socket")
            self.path = path
            self.host, self.port = "localhost", 0
        elif u.scheme in ("http", "https"):
            if not u.hostname:
                raise InvalidArgumentError(f"daemon url {url!r}: no host")
            self.path = ""
            self.host = u.hostname
            self.port = u.port or (443 if u.scheme == "https" else 80)
        else:
            raise InvalidArgumentError(f"daemon url {url!r}: want unix://, http:// or https://")


class Response:
    """A response whose body is read as it is needed (streams, files). Close
    it, or read it to the end, to give its connection back."""

    def __init__(self, transport: "Transport", conn: Optional[http.client.HTTPConnection], resp: http.client.HTTPResponse, reusable: bool = True) -> None:
        self._t = transport
        self._conn = conn
        self.raw = resp
        self.status = resp.status
        self.headers = resp.headers
        self._reusable = reusable

    def read(self, n: int = -1) -> bytes:
        b = self.raw.read(n) if n >= 0 else self.raw.read()
        if n < 0 or (n > 0 and not b):
            self._release()
        return b

    def readline(self) -> bytes:
        b = self.raw.readline()
        if not b:
            self._release()
        return b

    def iter_chunks(self, size: int = _BLOCK) -> Iterator[bytes]:
        try:
            while True:
                b = self.raw.read1(size) if hasattr(self.raw, "read1") else self.raw.read(size)
                if not b:
                    break
                yield b
        finally:
            self.close()

    def iter_lines(self) -> Iterator[bytes]:
        try:
            while True:
                line = self.raw.readline()
                if not line:
                    break
                yield line
        finally:
            self.close()

    def drain(self, limit: int = 64 << 10) -> None:
        """Reads what is left of a body that should be at its end (a stream
        after its last event) so that the connection can be kept; closes
        it when more than limit bytes remain."""
        try:
            self.raw.read(limit)
        except (OSError, http.client.HTTPException):
            pass
        self.close()

    def json(self) -> Any:
        b = self.read()
        return json.loads(b) if b else None

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._reusable and self.raw.isclosed() and not self.raw.will_close:
            self._t._put(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Gives the connection back when the body was read to its end,
        else closes it."""
        if self._conn is not None and not self.raw.isclosed():
            self._conn.close()
            self._conn = None
            self.raw.close()
            return
        self._release()

    def __enter__(self) -> "Response":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def retry_after(value: Optional[str]) -> Optional[float]:
    """Seconds to wait from a Retry-After header (seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - time.time())


class Transport:
    """Sends requests to one daemon. ``timeout`` bounds each wait for the
    daemon (connect, and every read: a quiet stream counts), None for no
    bound; a request may override it."""

    def __init__(
        self,
        url: str,
        token: str = "",
        *,
        timeout: Optional[float] = 60.0,
        connect_timeout: float = 10.0,
        max_retries: int = 4,
        backoff: float = 0.25,
        max_backoff: float = 8.0,
        ssl_context: Optional[ssl.SSLContext] = None,
        user_agent: str = "forkd-python",
    ) -> None:
        self.endpoint = Endpoint(url)
        self.url = url
        self.token = token
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.ssl_context = ssl_context
        self.user_agent = user_agent
        self._lock = threading.Lock()
        self._idle: List[Tuple[http.client.HTTPConnection, float]] = []  # guarded by _lock
        #: Called with (attempt, delay, error) before each retry; for tests and logs.
        self.on_retry: Optional[Callable[[int, float, ForkdError], None]] = None

    # -- connections ------------------------------------------------------

    def _new(self) -> http.client.HTTPConnection:
        ep = self.endpoint
        if ep.scheme == "unix":
            return _UnixConnection(ep.path, self.connect_timeout)
        if ep.scheme == "https":
            ctx = self.ssl_context or ssl.create_default_context()
            return http.client.HTTPSConnection(ep.host, ep.port, timeout=self.connect_timeout, context=ctx, blocksize=_BLOCK)
        return http.client.HTTPConnection(ep.host, ep.port, timeout=self.connect_timeout, blocksize=_BLOCK)

    def _get(self) -> Tuple[http.client.HTTPConnection, bool]:
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._idle:
                    break
                conn, since = self._idle.pop()
            if now - since < _MAX_IDLE and conn.sock is not None and _alive(conn.sock):
                return conn, True
            conn.close()
        return self._new(), False

    def _put(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < 32:
                self._idle.append((conn, time.monotonic()))
                return
        conn.close()

    def close(self) -> None:
        """Closes the idle connections."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit
            pass

    # -- requests ---------------------------------------------------------

    def _target(self, path: str, query: Query) -> str:
        if not query:
            return path
        items = query.items() if isinstance(query, Mapping) else query
        pairs = [(k, _qs(v)) for k, v in items if v is not None]
        return path + ("?" + urllib.parse.urlencode(pairs) if pairs else "")

    def _headers(self, content_type: Optional[str], extra: Optional[Mapping[str, str]]) -> Dict[str, str]:
        h = {"User-Agent": self.user_agent, "Accept-Encoding": "identity"}
        if self.token:
            h["Authorization"] = "Bearer " + self.token
        if content_type:
            h["Content-Type"] = content_type
        if extra:
            h.update(extra)
        return h

    def _wait(self, timeout: Any) -> Optional[float]:
        return self.timeout if timeout is _DEFAULT else timeout

    def send(
        self,
        method: str,
        path: str,
        *,
        query: Query = None,
        body: Body = None,
        content_type: Optional[str] = None,
        headers: Optional[Mapping[str, str]] = None,
        timeout: Any = _DEFAULT,
        retry: bool = True,
    ) -> Response:
        """Sends a request and returns its response once its status is 2xx
        (its body unread); raises the error of its class otherwise. Answers
        the daemon gives before acting are retried, at most max_retries
        times, with exponential backoff honouring Retry-After, when the body
        can be sent again: 429 always, 503 for idempotent methods or with a
        Retry-After."""
        target = self._target(path, query)
        hdrs = self._headers(content_type, headers)
        wait = self._wait(timeout)
        rewind = _rewinder(body)
        attempt = 0
        while True:
            resp = self._once(method, target, body, hdrs, wait, rewind)
            if 200 <= resp.status < 300:
                return resp
            ra = retry_after(resp.headers.get("Retry-After"))
            err = _decode_error(resp)
            # 429 is an admission refusal: nothing was done. 503 may also
            # come from a guest lost in the middle of a call, so a request
            # that is not idempotent goes again only when the daemon says
            # when (Retry-After).
            refused = resp.status == 429 or (resp.status == 503 and (method in IDEMPOTENT or ra is not None))
            if not (retry and refused and rewind is not None and attempt < self.max_retries):
                raise err
            delay = min(self.max_backoff, self.backoff * (2 ** attempt)) * (0.5 + random.random() / 2)
            if ra is not None:
                if ra > self.max_backoff * 4:
                    raise err  # longer than we are willing to wait
                delay = max(delay, ra)
            attempt += 1
            if self.on_retry is not None:
                self.on_retry(attempt, delay, err)
            time.sleep(delay)
            rewind()  # type: ignore[misc]

    def _once(self, method: str, target: str, body: Body, hdrs: Dict[str, str], wait: Optional[float], rewind: Optional[Callable[[], None]]) -> Response:
        """One exchange; a connection from the pool that turns out dead
        before any answer is replaced once by a fresh one when the request
        may be sent again (idempotent, or nothing of it was sent)."""
        for fresh_try in (False, True):
            conn, reused = self._get() if not fresh_try else (self._new(), False)
            sent = False
            try:
                if conn.sock is None:
                    conn.connect()
                conn.sock.settimeout(wait)  # type: ignore[union-attr]
                conn.request(method, target, body=body, headers=hdrs)  # type: ignore[arg-type]
                sent = True
                r = conn.getresponse()
                return Response(self, conn, r)
            except socket.timeout as e:
                conn.close()
                raise DeadlineExceededError(f"{method} {target}: no answer from the forkd daemon at {self.url} within {wait}s", status=0) from e
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError) as e:
                conn.close()
                if reused and (method in IDEMPOTENT or not sent) and rewind is not None:
                    rewind()
                    continue
                raise UnavailableError(f"{method} {target}: forkd daemon at {self.url}: {e or type(e).__name__}", status=0) from e
            except OSError as e:
                conn.close()
                raise UnavailableError(f"forkd daemon at {self.url}: {e}", status=0) from e
            except http.client.HTTPException as e:
                conn.close()
                raise UnavailableError(f"{method} {target}: forkd daemon at {self.url}: {e!r}", status=0) from e
        raise AssertionError("unreachable")

    def open_duplex(
        self,
        method: str,
        path: str,
        head: bytes,
        stream: Iterable[bytes],
        content_type: str,
        timeout: Any = _DEFAULT,
    ) -> Response:
        """Sends head then the chunks of stream as a chunked body from a
        thread of its own while the caller reads the response, for a body
        the daemon reads while it answers (exec with streamed stdin). The
        connection is not reused."""
        target = self._target(path, None)
        hdrs = self._headers(content_type, {"Transfer-Encoding": "chunked"})
        wait = self._wait(timeout)
        conn = self._new()
        try:
            conn.connect()
            conn.sock.settimeout(wait)  # type: ignore[union-attr]
            conn.putrequest(method, target, skip_accept_encoding=True)
            for k, v in hdrs.items():
                conn.putheader(k, v)
            conn.endheaders()
            sock = conn.sock
        except OSError as e:
            conn.close()
            raise UnavailableError(f"forkd daemon at {self.url}: {e}", status=0) from e

        def pump() -> None:
            try:
                _send_chunk(sock, head)
                for chunk in stream:
                    if isinstance(chunk, str):
                        chunk = chunk.encode()
                    if chunk:
                        _send_chunk(sock, bytes(chunk))
                sock.sendall(b"0\r\n\r\n")  # type: ignore[union-attr]
            except OSError:
                pass  # the daemon answered early (an error) or went away

        threading.Thread(target=pump, name="forkd-stdin", daemon=True).start()
        try:
            r = conn.getresponse()
        except socket.timeout as e:
            conn.close()
            raise DeadlineExceededError(f"{method} {target}: no answer within {wait}s", status=0) from e
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise UnavailableError(f"{method} {target}: forkd daemon at {self.url}: {e!r}", status=0) from e
        resp = Response(self, conn, r, reusable=False)
        if not 200 <= resp.status < 300:
            raise _decode_error(resp)
        return resp


def _send_chunk(sock: Any, b: bytes) -> None:
    if b:
        sock.sendall(b"%x\r\n" % len(b) + b + b"\r\n")


def _qs(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _alive(sock: socket.socket) -> bool:
    """False when a kept-alive connection was closed by the daemon (it is
    readable: EOF, or data nobody asked for)."""
    try:
        r, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not r


def _rewinder(body: Body) -> Optional[Callable[[], None]]:
    """How to send body again: nothing to do for bytes, a seek back for a
    seekable file; None when it cannot be sent twice (an iterator)."""
    if body is None or isinstance(body, (bytes, bytearray, memoryview, str)):
        return lambda: None
    seek = getattr(body, "seek", None)
    tell = getattr(body, "tell", None)
    if seek is not None and tell is not None:
        try:
            if body.seekable():  # type: ignore[union-attr]
                pos = tell()
                return lambda: seek(pos)
        except (OSError, AttributeError):
            return None
    return None


def _decode_error(resp: Response) -> ForkdError:
    """The error of an answer's class; reads (and so releases) the body."""
    try:
        raw = resp.read(1 << 20)
        resp.close()
    except (OSError, http.client.HTTPException):
        raw = b""
        resp.close()
    code, message = None, ""
    try:
        doc = json.loads(raw)
        if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
            code = doc["error"].get("code") or None
            message = doc["error"].get("message") or ""
    except ValueError:
        pass
    if not message:
        message = raw.decode("utf-8", "replace").strip() or f"{resp.status} {resp.raw.reason}"
    return error_for(code, message, resp.status)
