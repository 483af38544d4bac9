# forkd warm interpreter: runs eval requests for the guest agent.
#
# The agent starts this as
#   python3 -c "import sys; exec(compile(sys.argv[1], '<forkd>', 'exec'))" <this file> [module ...]
# so that its frames can be told apart from a cell's, with the modules to
# preload as arguments. Protocol: one JSON object per line,
# requests on fd 3, replies on fd 4.
#   request  {"id": N, "op": "eval", "code": "...", "ctx": "name", "reset": bool,
#             "env": {...}, "cwd": "/dir", "rich": bool}
#            {"id": N, "op": "reseed", "seed": "<hex>"}
#            {"id": N, "op": "chdir", "path": "/root"}
#   reply    {"t": "ready", "python": "...", "preloaded": [...], "failed": {...}}
#            {"id": N, "t": "out"|"err", "s": "..."}     output of call N
#            {"id": N, "t": "done", "value": ..., "error": {...},
#             "interrupted": bool, "truncated": bool, "count": N,
#             "results": [{"formats": {"text": ..., "png": ...}, "main": bool}]}
# A context ("ctx") is a namespace of its own ("" is the main one); "reset"
# empties it first. With "rich", the figures matplotlib has open at the end
# of a cell or when it calls plt.show() (the backend is module://forkd_inline
# unless MPLBACKEND names another) are reported as PNG, with the rich forms
# (_repr_html_ and friends) of the last expression's value.
# After an eval it writes the marker "\0\x1bforkd-sync-N\x1b\0" to fd 1 and 2,
# so that the agent knows when it has all of the call's raw output.
# SIGINT interrupts the running cell with KeyboardInterrupt; outside a cell,
# or while a reply is being written, it is ignored or deferred, so that the
# interpreter and the reply stream survive it.
import ast
import base64
import importlib
import importlib.util
import io
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

DISPLAY_LIMIT = 4 << 20
FORMATS = (("html", "_repr_html_"), ("markdown", "_repr_markdown_"), ("svg", "_repr_svg_"),
           ("png", "_repr_png_"), ("jpeg", "_repr_jpeg_"), ("pdf", "_repr_pdf_"),
           ("latex", "_repr_latex_"), ("json", "_repr_json_"), ("javascript", "_repr_javascript_"))

_MAIN = threading.get_ident()
_lock = threading.Lock()
_st = {"in_user": False, "in_send": False, "pending": False, "call": None, "displays": None}


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


def _figures():
    """Reports and closes the figures matplotlib has open (rich calls only)."""
    shown = _st["displays"]
    plt = sys.modules.get("matplotlib.pyplot")
    if shown is None or plt is None:
        return
    try:
        from matplotlib._pylab_helpers import Gcf
        managers = Gcf.get_all_fig_managers()
    except Exception:
        return
    for m in managers:
        fig = m.canvas.figure
        try:
            buf = io.BytesIO()
            fig.savefig(buf, format="png", bbox_inches="tight")
            data = base64.b64encode(buf.getvalue()).decode()
            if len(data) <= DISPLAY_LIMIT:
                shown.append({"formats": {"text": repr(fig), "png": data}})
        except Exception as e:
            shown.append({"formats": {"text": "%s (not rendered: %s: %s)" % (repr(fig), type(e).__name__, e)}})
        try:
            plt.close(fig)
        except Exception:
            pass


class _InlineBackend:
    """Finds module forkd_inline, a matplotlib backend: Agg, whose show()
    reports the open figures."""

    def find_spec(self, name, path=None, target=None):
        if name != "forkd_inline":
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        return None

    def exec_module(self, mod):
        from matplotlib.backend_bases import FigureManagerBase
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        mod.FigureCanvas = FigureCanvasAgg
        mod.FigureManager = FigureManagerBase

        def show(*args, **kwargs):
            _figures()

        mod.show = show


class _MatplotlibHook:
    """Makes forkd_inline matplotlib's default backend when matplotlib is
    first imported, unless MPLBACKEND names one (an environment variable
    would reach the processes cells start, which cannot import it)."""

    def find_spec(self, name, path=None, target=None):
        if name != "matplotlib" or os.environ.get("MPLBACKEND"):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec

        def exec_module(module):
            run(module)
            try:
                module.rcParams["backend"] = "module://forkd_inline"
            except Exception:
                pass

        loader.exec_module = exec_module
        return spec


def _rich(value):
    """The rich forms of a value, as a display."""
    formats = {"text": repr(value)}
    for name, method in FORMATS:
        f = getattr(type(value), method, None)
        if f is None:
            continue
        try:
            out = f(value)
        except Exception:
            continue
        if isinstance(out, tuple):
            out = out[0]
        if out is None:
            continue
        if isinstance(out, bytes):
            out = base64.b64encode(out).decode()
        elif not isinstance(out, str):
            try:
                out = json.dumps(out)
            except Exception:
                continue
        if len(out) <= DISPLAY_LIMIT:
            formats[name] = out
    return {"formats": formats, "main": True}


def _run(cid, code, env, rich=False):
    filename = "<cell-%d>" % cid
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    res = {"id": cid, "t": "done"}
    main = None
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
                    if rich:
                        main = _rich(value)
            if rich:
                _figures()
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
    if main is not None and _st["displays"] is not None:
        _st["displays"].append(main)
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
    contexts = {}  # name -> [namespace, executions]; "" is the main one
    contexts[""] = [env, 0]
    sys.meta_path.insert(0, _MatplotlibHook())
    sys.meta_path.append(_InlineBackend())
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
            name = req.get("ctx") or ""
            if req.get("reset"):
                if name:
                    contexts.pop(name, None)
                else:
                    for k in [k for k in env if k not in ("__builtins__", "__name__")]:
                        del env[k]
                    contexts[""] = [env, 0]
            code = req.get("code", "")
            res = {"id": cid, "t": "done"}
            if code or not req.get("reset"):
                if name not in contexts:
                    contexts[name] = [{"__builtins__": __builtins__, "__name__": "__main__"}, 0]
                ctx = contexts[name]
                ctx[1] += 1
                rich = bool(req.get("rich"))
                _st["displays"] = [] if rich else None
                saved = {}
                res = None
                while res is None:
                    try:
                        try:
                            for k, v in (req.get("env") or {}).items():
                                saved[k] = os.environ.get(k)
                                os.environ[k] = v
                            if req.get("cwd"):
                                os.chdir(req["cwd"])
                            res = _run(cid, code, ctx[0], rich)
                        finally:
                            for k, v in saved.items():
                                if v is None:
                                    os.environ.pop(k, None)
                                else:
                                    os.environ[k] = v
                    except KeyboardInterrupt:
                        _st["in_user"] = False
                        res = {"id": cid, "t": "done", "interrupted": True,
                               "error": {"name": "KeyboardInterrupt", "message": "", "traceback": ""}}
                    except Exception as e:  # a bad env or cwd
                        res = {"id": cid, "t": "done", "error": _error(e)}
                res["count"] = ctx[1]
                if _st["displays"]:
                    res["results"] = _st["displays"]
                _st["displays"] = None
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
