"""Which daemon a Controller talks to, and with which token: the rules of
the Go CLI (internal/cli/remote.go) and client.DefaultSocket."""

from __future__ import annotations

import http.client
import ipaddress
import json
import os
import socket
import stat
import urllib.parse
from typing import List, Optional, Tuple

from .errors import InvalidArgumentError, UnavailableError

#: api/v1 ControllerFile: where a running daemon says where it listens.
CONTROLLER_FILE = "controller.json"


def data_dir() -> str:
    """$FORKD_DATA, else /var/lib/forkd as root, else ~/.local/share/forkd."""
    d = os.environ.get("FORKD_DATA", "")
    if d:
        return os.path.abspath(d)
    if os.geteuid() == 0:
        return "/var/lib/forkd"
    return os.path.join(os.path.expanduser("~"), ".local", "share", "forkd")


def default_socket() -> str:
    """Where `forkd serve` listens by default: /run/forkd/forkd.sock as root,
    else $XDG_RUNTIME_DIR/forkd/forkd.sock ("" without that variable)."""
    if os.geteuid() == 0:
        return "/run/forkd/forkd.sock"
    d = os.environ.get("XDG_RUNTIME_DIR", "")
    return os.path.join(d, "forkd", "forkd.sock") if d else ""


def is_loopback(host: str) -> bool:
    """localhost or a loopback address."""
    h = (host or "").strip("[]")
    if h.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def _token_file(ddir: str) -> str:
    try:
        with open(os.path.join(ddir, "token"), encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return ""


def token_for(url: str, token: Optional[str], ddir: str, insecure: Optional[bool] = None) -> str:
    """The token sent to the daemon at url: token when given, else
    $FORKD_TOKEN, else the data dir's token file, but only to a loopback
    address, so that this machine's secret never goes where a URL points.
    Plain http to a host that is not loopback is refused unless insecure
    (default: $FORKD_INSECURE=1): it would carry the token in clear."""
    u = urllib.parse.urlsplit(url)
    tok = token if token is not None else os.environ.get("FORKD_TOKEN", "")
    if u.scheme == "unix":
        return tok
    if insecure is None:
        insecure = os.environ.get("FORKD_INSECURE") == "1"
    if not is_loopback(u.hostname or ""):
        if u.scheme == "http" and not insecure:
            raise InvalidArgumentError(
                f"{url}: plain http to a host that is not loopback would send the token in clear; "
                "use https:// (or set FORKD_INSECURE=1)"
            )
        return tok
    if not tok:
        tok = _token_file(ddir)
    return tok


def _answers(path: str, timeout: float = 2.0) -> bool:
    """Whether a daemon answers /healthz on the unix socket at path."""
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return False
    except OSError:
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        conn = http.client.HTTPConnection("localhost", timeout=timeout)
        conn.sock = s
        conn.request("GET", "/healthz")
        r = conn.getresponse()
        r.read()
        return r.status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        s.close()


def resolve(
    url: Optional[str] = None,
    token: Optional[str] = None,
    socket_path: Optional[str] = None,
    ddir: Optional[str] = None,
    insecure: Optional[bool] = None,
) -> Tuple[str, str]:
    """(url, token) of the daemon to use: the arguments; else $FORKD_URL
    (and $FORKD_TOKEN); else the local daemon: the socket recorded in
    <data dir>/controller.json, then the default socket, the first that
    answers; else the TCP URL recorded there."""
    ddir = ddir or data_dir()
    if socket_path:
        return "unix://" + os.path.abspath(socket_path), token if token is not None else os.environ.get("FORKD_TOKEN", "")
    if not url:
        url = os.environ.get("FORKD_URL", "") or None
    if url:
        return url, token_for(url, token, ddir, insecure)
    socks: List[str] = []
    info = {}
    try:
        with open(os.path.join(ddir, CONTROLLER_FILE), encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        pass
    if isinstance(info, dict) and info.get("socket"):
        socks.append(info["socket"])
    ds = default_socket()
    if ds:
        socks.append(ds)
    for s in socks:
        if _answers(s):
            return "unix://" + s, token if token is not None else os.environ.get("FORKD_TOKEN", "")
    if isinstance(info, dict) and info.get("url"):
        u = info["url"]
        return u, token_for(u, token, ddir, insecure)
    tried = ", ".join(socks) or "no socket"
    raise UnavailableError(
        f"no forkd daemon found (tried {tried}; data dir {ddir}): start `forkd serve`, "
        "or name one with FORKD_URL or Controller(url=..., socket=...)",
        status=0,
    )
