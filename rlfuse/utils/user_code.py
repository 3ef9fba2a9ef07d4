"""A user's function named `module:function` or `path/to/file.py:function`: imported with
errors that name the file and line, and served to a parent process by a worker.

`load_function(spec, what)` imports it (reward functions, the data.map row transform; a
relative FILE is resolved against the recipe's folder when the recipe is loaded); a
SyntaxError, an ImportError or any exception raised while the module runs becomes one
ValueError naming the file, the line and the message (the CLI prints it as one
`rlfuse: error:` line).
`check_kwargs(what, name, fn, kwargs)` refuses recipe kwargs the function does not take.
`python rlfuse/utils/user_code.py` is the worker (rlfuse.rollout.reward_worker starts it
by path: `-m` would import the rlfuse package, and with it torch):
it reads (name, kwargs) from stdin, imports the function and checks the kwargs (so the
parent never imports the user's module: a module that hangs as it imports is stopped by
the parent's timeout like a hung call), then answers calls
(args, kwargs) -> ("ok", result) | ("raise", exception_message(e)) | ("import-error", message),
each message a pickle prefixed by its 8-byte length; `rebuild_exception` turns an
exception message back into the exception (one of the same type name and text when its
class lives in a file only the worker imported). The protocol uses the process's original
stdout; the user's prints go to stderr. This module imports no torch, so the worker starts
in the time of Python plus the user's own imports.
Test: python -m pytest -q tests/test_bad_inputs.py -k "reward"
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import pickle
import struct
import sys
import traceback
from collections.abc import Callable
from pathlib import Path


def _where(e: BaseException, path: Path) -> str:
    """`file:line` of the deepest frame of `e` inside `path` (else the deepest frame)."""
    if isinstance(e, SyntaxError) and e.filename:
        return f"{e.filename}:{e.lineno}"
    frames = traceback.extract_tb(e.__traceback__)
    inside = [f for f in frames if Path(f.filename).resolve() == path.resolve()] or frames
    return f"{inside[-1].filename}:{inside[-1].lineno}" if inside else str(path)


def load_function(name: str, what: str = "function") -> Callable:
    """The callable `name` = `module:function` or `file.py:function` (module docstring)."""
    if ":" not in name:
        raise ValueError(f"{what} {name!r}: expected module:function or path/to/file.py:function")
    mod_name, fn_name = name.rsplit(":", 1)
    if mod_name.endswith(".py"):
        path = Path(mod_name)
        if not path.exists():
            raise ValueError(f"{what} {name!r}: no such file {path}")
        spec = importlib.util.spec_from_file_location(f"rlfuse_user_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        try:
            spec.loader.exec_module(module)
        except SyntaxError as e:
            sys.modules.pop(spec.name, None)
            raise ValueError(f"{what} {name!r}: {_where(e, path)}: SyntaxError: {e.msg}") from None
        except Exception as e:  # noqa: BLE001 -- the user's module failed as it ran: its file, line, message
            sys.modules.pop(spec.name, None)
            raise ValueError(f"{what} {name!r}: importing {path} failed at {_where(e, path)}: "
                             f"{type(e).__name__}: {e}") from None
    else:
        try:
            module = importlib.import_module(mod_name)
        except ImportError as e:
            raise ValueError(f"{what} {name!r}: cannot import module {mod_name!r} ({e})") from None
        except Exception as e:  # noqa: BLE001 -- as above
            raise ValueError(f"{what} {name!r}: importing module {mod_name!r} failed at "
                             f"{_where(e, Path(getattr(e, 'filename', None) or mod_name))}: "
                             f"{type(e).__name__}: {e}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"{what} {name!r}: module {mod_name!r} has no function {fn_name!r}")
    return fn


def check_kwargs(what: str, name: str, fn: Callable, kwargs: dict, valid: dict | None = None) -> None:
    """ValueError naming the first key of `kwargs` (a recipe's, bound to `fn` at every call)
    that is not in `valid`: by default fn's own parameters less prompts and completions, and
    anything when fn takes **kwargs or has no readable signature."""
    if valid is None:
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):  # a callable without a readable signature: bound as given
            return
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return
        valid = {k: p for k, p in params.items() if k not in ("prompts", "completions")}
    for k in kwargs:
        if k not in valid:
            allowed = ", ".join(valid) if valid else "none"
            raise ValueError(f"{what} {name!r}: unknown keyword argument {k!r} in kwargs "
                             f"(valid kwargs of {name!r}: {allowed})")


def send(f, obj) -> None:
    data = pickle.dumps(obj)
    f.write(struct.pack("<Q", len(data)) + data)
    f.flush()


def receive(f):
    """The next message from `f`; EOFError when the other side closed."""
    head = f.read(8)
    if len(head) < 8:
        raise EOFError
    (n,) = struct.unpack("<Q", head)
    data = f.read(n)
    if len(data) < n:
        raise EOFError
    return pickle.loads(data)


def exception_message(e: BaseException) -> tuple[bytes | None, str, str]:
    """(the pickled exception or None, its type's name, its text) for `rebuild_exception`."""
    try:
        data = pickle.dumps(e)
    except Exception:  # noqa: BLE001 -- an exception that does not pickle: its name and text
        data = None
    return data, type(e).__name__, str(e)


def rebuild_exception(message: tuple[bytes | None, str, str]) -> BaseException:
    data, name, text = message
    if data is not None:
        try:
            return pickle.loads(data)
        except Exception:  # noqa: BLE001 -- its class is in a module only the worker imported (file.py)
            pass
    return type(name, (Exception,), {})(text)


def _serve() -> None:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the user's print() goes to stderr, not into the protocol
    sys.stdout = sys.stderr
    inp = sys.stdin.buffer
    name, kwargs, what = receive(inp)
    try:
        fn = load_function(name, what)
        check_kwargs(what, name, fn, kwargs)
    except ValueError as e:
        send(out, ("import-error", str(e)))
        return
    send(out, ("ready", None))
    while True:
        try:
            args, kw = receive(inp)
        except EOFError:
            return
        try:
            result = ("ok", fn(*args, **kwargs, **kw))
        except Exception as e:  # noqa: BLE001 -- the user's exception, raised again in the parent
            result = ("raise", exception_message(e))
        try:
            send(out, result)
        except Exception as e:  # noqa: BLE001 -- a result that does not pickle
            send(out, ("raise", exception_message(RuntimeError(
                f"{type(result[1]).__name__}: {_short(result[1])} (could not be sent back: {e})"))))


def _short(x, n: int = 200) -> str:
    s = repr(x)
    return s if len(s) <= n else s[:n] + "..."


if __name__ == "__main__":
    # run by path: its own folder is not a place to import the user's modules from
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    _serve()
