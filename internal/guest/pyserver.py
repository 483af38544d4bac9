# forkd warm interpreter: runs eval requests for the guest agent.
#
# The agent starts this as
#   python3 -c "import sys; exec(compile(sys.argv[1], '<forkd>', 'exec'))" <this file> [module ...]
# so that its frames can be told apart from a cell's, with the modules to
# preload as arguments. Protocol: one JSON object per line,
# requests on fd 3, replies on fd 4.
#   request  {"id": N, "op": "eval", "code": "..."}
#            {"id": N, "op": "reseed", "seed": "<hex>"}
#            {"id": N, "op": "chdir", "path": "/root"}
#   reply    {"t": "ready", "python": "...", "preloaded": [...], "failed": {...}}
#            {"id": N, "t": "out"|"err", "s": "..."}     output of call N
#            {"id": N, "t": "done", "value": ..., "error": {...},
#             "interrupted": bool, "truncated": bool}
# After an eval it writes the marker "\0\x1bforkd-sync-N\x1b\0" to fd 1 and 2,
# so that the agent knows when it has all of the call's raw output.
# SIGINT interrupts the running cell with KeyboardInterrupt; outside a cell,
# or while a reply is being written, it is ignored or deferred, so that the
# interpreter and the reply stream survive it.
import ast
import importlib
import json
import linecache
import os
import signal
import sys
import threading
import traceback
import types

REQ_FD, RESP_FD = 3, 4
CHUNK = 32768
VALUE_LIMIT = 1 << 20

_MAIN = threading.get_ident()
_lock = threading.Lock()
_st = {"in_user": False, "in_send": False, "pending": False, "call": None}


def _on_sigint(signum, frame):
    if not _st["in_user"]:
        return
    if _st["in_send"]:
        _st["pending"] = True
        return
    raise KeyboardInterrupt


def _send(obj):
    data = (json.dumps(obj) + "\n").encode()
    main = threading.get_ident() == _MAIN
    with _lock:
        if main:
            _st["in_send"] = True
        try:
            view = memoryview(data)
            while view:
                n = os.write(RESP_FD, view)
                view = view[n:]
        finally:
            if main:
                _st["in_send"] = False
    if main and _st["pending"] and _st["in_user"]:
        _st["pending"] = False
        raise KeyboardInterrupt


class _Stream:
    """sys.stdout / sys.stderr: sends a cell's output to the agent by line."""

    encoding = "utf-8"
    errors = "strict"

    def __init__(self, kind):
        self.kind = kind
        self.buf = []
        self.size = 0
        self.lock = threading.Lock()

    def write(self, s):
        if not isinstance(s, str):
            raise TypeError("write() argument must be str, not %s" % type(s).__name__)
        if _st["call"] is None or not s:
            return len(s)
        with self.lock:
            self.buf.append(s)
            self.size += len(s)
            full = self.size >= CHUNK or "\n" in s
        if full:
            self.flush()
        return len(s)

    def writelines(self, lines):
        for s in lines:
            self.write(s)

    def flush(self):
        with self.lock:
            text = "".join(self.buf)
            self.buf = []
            self.size = 0
        call = _st["call"]
        if call is None:
            return
        for i in range(0, len(text), CHUNK):
            _send({"id": call, "t": self.kind, "s": text[i:i + CHUNK]})

    def isatty(self):
        return False

    def writable(self):
        return True

    def readable(self):
        return False

    def fileno(self):
        return 1 if self.kind == "out" else 2


def _error(e):
    tb = e.__traceback__
    while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<cell-"):
        tb = tb.tb_next
    te = traceback.TracebackException(type(e), e, tb)
    # The server's own frames (the SIGINT handler, a deferred interrupt in
    # _send) are noise to the user.
    te.stack[:] = [f for f in te.stack if f.filename != "<forkd>"]
    text = "".join(te.format())
    return {"name": type(e).__name__, "message": str(e), "traceback": text}


def _run(cid, code, env):
    filename = "<cell-%d>" % cid
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    res = {"id": cid, "t": "done"}
    try:
        tree = ast.parse(code, filename, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = compile(ast.Expression(tree.body.pop().value), filename, "eval")
        body = compile(tree, filename, "exec")
    except BaseException as e:
        res["error"] = _error(e)
        return res
    try:
        try:
            _st["in_user"] = True
            exec(body, env)
            if last is not None:
                value = eval(last, env)
                if value is not None:
                    env["_"] = value
                    text = repr(value)
                    if len(text) > VALUE_LIMIT:
                        text = text[:VALUE_LIMIT]
                        res["truncated"] = True
                    res["value"] = text
        finally:
            _st["in_user"] = False
            _st["pending"] = False
    except KeyboardInterrupt as e:
        _st["in_user"] = False
        res["error"] = _error(e)
        res["interrupted"] = True
    except BaseException as e:
        _st["in_user"] = False
        res["error"] = _error(e)
    return res


def _reseed(seed):
    import random

    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        words = [int.from_bytes(seed[i:i + 4].ljust(4, b"\0"), "little") for i in range(0, min(len(seed), 32), 4)]
        try:
            np.random.seed(words or [0])
        except Exception:
            pass


def main():
    preload = sys.argv[2:]
    sys.argv = [""]
    for fd in (REQ_FD, RESP_FD):
        os.set_inheritable(fd, False)
    signal.signal(signal.SIGINT, _on_sigint)
    out, err = _Stream("out"), _Stream("err")
    sys.stdout, sys.stderr = out, err
    # Cells run in a fresh __main__ so that they cannot clobber this server
    # and so that pickling their classes works.
    mod = types.ModuleType("__main__")
    mod.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = mod
    env = mod.__dict__
    loaded, failed = [], {}
    for name in preload:
        try:
            importlib.import_module(name)
            # As if the cell had run `import name`: the top-level package
            # is bound in the cells' namespace.
            top = name.split(".")[0]
            env[top] = sys.modules[top]
            loaded.append(name)
        except BaseException as e:
            failed[name] = "%s: %s" % (type(e).__name__, e)
    _send({"t": "ready", "python": sys.version.split()[0], "preloaded": loaded, "failed": failed})
    reqs = os.fdopen(REQ_FD, "rb")
    while True:
        line = reqs.readline()
        if not line:
            return
        try:
            req = json.loads(line)
        except ValueError:
            continue
        cid = req.get("id")
        op = req.get("op")
        if op == "eval":
            sys.stdout, sys.stderr = out, err
            _st["call"] = cid
            res = None
            while res is None:
                try:
                    res = _run(cid, req.get("code", ""), env)
                except KeyboardInterrupt:
                    _st["in_user"] = False
                    res = {"id": cid, "t": "done", "interrupted": True,
                           "error": {"name": "KeyboardInterrupt", "message": "", "traceback": ""}}
            out.flush()
            err.flush()
            _st["call"] = None
            # Everything written to fd 1 and 2 during the cell (by C code or
            # child processes) precedes these markers in the pipes.
            for fd in (1, 2):
                try:
                    os.write(fd, b"\x00\x1bforkd-sync-%d\x1b\x00" % cid)
                except OSError:
                    pass
            _send(res)
        elif op == "reseed":
            try:
                _reseed(bytes.fromhex(req.get("seed", "")))
            except Exception as e:
                _send({"id": cid, "t": "done", "error": {"name": type(e).__name__, "message": str(e)}})
                continue
            _send({"id": cid, "t": "done"})
        elif op == "chdir":
            # The root moved under the interpreter (a disk was attached):
            # the agent gives the path of its directory, to take again.
            try:
                os.chdir(req.get("path", "/"))
            except Exception as e:
                _send({"id": cid, "t": "done", "error": {"name": type(e).__name__, "message": str(e)}})
                continue
            _send({"id": cid, "t": "done"})


main()
