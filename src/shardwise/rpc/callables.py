"""Which functions and classes a peer may name, and how a local function is named for a peer.

[Note: no code from peers] A request names its function by ``module:qualname``; the callee
resolves that name only in modules that are already imported in its process (a peer can never
make it import anything) or that the user registered with :func:`register_module`, and never in
the modules that run programs, touch files or load code (``os``, ``subprocess``, ``pickle``, ...,
and ``builtins.eval`` and friends). The unpickler applies the same rule to every global an
argument refers to (classes, dtypes), so a pickled payload cannot smuggle a call to ``os.system``
either. Peers are authenticated first (see auth.py); this is the second line.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

_DENIED_ROOTS = frozenset({
    "os", "posix", "nt", "sys", "subprocess", "shutil", "importlib", "pickle", "_pickle",
    "copyreg", "marshal", "ctypes", "socket", "runpy", "code", "codeop", "pty", "signal",
    "multiprocessing", "threading", "_thread", "asyncio", "io", "_io", "pathlib", "tempfile",
    "glob", "webbrowser", "http", "urllib", "ftplib", "smtplib", "telnetlib", "pdb", "bdb",
    "inspect", "gc", "atexit", "site", "sysconfig", "zipimport", "pkgutil", "types",
})
_DENIED_NAMES = frozenset({
    ("builtins", "eval"), ("builtins", "exec"), ("builtins", "compile"),
    ("builtins", "__import__"), ("builtins", "open"), ("builtins", "getattr"),
    ("builtins", "setattr"), ("builtins", "delattr"), ("builtins", "globals"),
    ("builtins", "locals"), ("builtins", "vars"), ("builtins", "input"),
    ("builtins", "breakpoint"), ("builtins", "exit"), ("builtins", "quit"),
    ("torch", "load"), ("torch", "save"), ("torch.serialization", "load"),
    ("torch", "compile"), ("torch", "hub"),
})
_registered: set[str] = set()
_lock = threading.Lock()


class ForbiddenCallable(RuntimeError):
    """A peer named a function or class this worker refuses to resolve."""


def register_module(module: str | ModuleType) -> None:
    """Allow peers to call functions of ``module`` (imported now if given by name).

    Modules already imported are callable by default (unless on the deny list); registering is
    how a worker opts in to a module before any local code imported it, or to one on the deny
    list that it really means to expose.
    """
    if isinstance(module, str):
        __import__(module)
        name = module
    else:
        name = module.__name__
    with _lock:
        _registered.add(name)


def qualified_name(func: Callable[..., Any]) -> str:
    """``module:qualname`` of ``func``, checked to resolve back to ``func`` in this process."""
    module = getattr(func, "__module__", None)
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    if module is None and isinstance(getattr(func, "__self__", None), ModuleType):
        module = func.__self__.__name__  # builtins of C extension modules
    if not module or not qualname or "<" in qualname:
        raise TypeError(
            f"RPC functions are sent by importable name; {func!r} has none (lambdas, local "
            "functions and bound methods of local objects cannot be called remotely: define "
            "the function at module level)"
        )
    for name in dict.fromkeys((qualname, getattr(func, "__name__", None) or qualname)):
        try:
            found = _walk(sys.modules[module], name)
        except (KeyError, AttributeError):
            continue
        if _same_callable(found, func):
            return f"{module}:{name}"
    raise TypeError(
        f"RPC function {func!r} is not reachable as {module}:{qualname}; define it at "
        "module level so that the callee can find it by name"
    )


def _same_callable(found: Any, func: Any) -> bool:
    """``found`` is ``func``; a class method is a new bound object at every access, so two
    bound methods are the same when their function and their ``__self__`` are."""
    if found is func or getattr(found, "__func__", found) is func:
        return True
    return (getattr(found, "__func__", None) is not None
            and getattr(found, "__func__", None) is getattr(func, "__func__", None)
            and getattr(found, "__self__", None) is getattr(func, "__self__", None))


def resolve(name: str) -> Any:
    """The object a peer named ``module:qualname`` (or ``module``, ``qualname``), if allowed."""
    module, sep, qualname = name.partition(":")
    if not sep or not module or not qualname:
        raise ForbiddenCallable(f"malformed function name {name!r}; expected module:qualname")
    return resolve_global(module, qualname)


def resolve_global(module: str, qualname: str) -> Any:
    """The global ``module.qualname`` if policy allows it (used by the unpickler too)."""
    root = module.split(".", 1)[0]
    allowed = module in _registered or root in _registered
    if not allowed and (root in _DENIED_ROOTS or _denied_name(module, qualname)):
        raise ForbiddenCallable(
            f"peer named {module}.{qualname}, which RPC never resolves (module {root!r} can run "
            "programs, touch files or load code); call shardwise.rpc.register_module to opt in"
        )
    mod = sys.modules.get(module)
    if mod is None:
        raise ForbiddenCallable(
            f"peer named {module}.{qualname}, but module {module!r} is not imported on this "
            "worker; import it or call shardwise.rpc.register_module before init_rpc"
        )
    try:
        return _walk(mod, qualname)
    except AttributeError as exc:
        raise ForbiddenCallable(f"module {module!r} has no attribute {qualname!r}") from exc


def _denied_name(module: str, qualname: str) -> bool:
    parts = qualname.split(".")
    dunder = any(p.startswith("__") for p in parts)  # __globals__, __subclasses__, ...
    return dunder or (module, parts[0]) in _DENIED_NAMES


def _walk(obj: Any, qualname: str) -> Any:
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
