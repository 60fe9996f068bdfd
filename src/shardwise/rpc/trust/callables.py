"""Which functions, classes and methods a peer may name, and how a local function is named.

[Note: allow-list] This is the one rule by which a worker resolves a name a peer sent: a
request's function (``module:qualname``), every global inside a pickled argument or reply (a
``(module, qualname)`` pair), and the method an RRef proxy, RemoteModule or DistributedOptimizer
call names on a value the worker owns. A worker resolves such a name only when it is, exactly,
one of:

1. a callable or class registered with :func:`register` (also a decorator), or defined in a
   module the user allowed (``init_rpc(..., allowed_modules=[...])``, :func:`register_module`);
2. the program's own code: a function or class defined in ``__main__`` / ``__mp_main__`` (the
   script every worker runs) or in an *already imported* module whose file (links resolved)
   lies under the script's directory or the working directory of ``init_rpc`` (neither
   counts when it is ``/``, a home directory or a temporary directory's root), and not under
   the interpreter's trees (``sys.prefix``, ``sys.base_prefix``, ``sys.exec_prefix``, the
   ``sysconfig`` paths, any ``site-packages`` / ``dist-packages``, the user site) nor in
   shardwise or torch; that is part of no installed distribution (its top-level name is
   none that ``importlib.metadata`` knows a distribution to provide, and the directory it was
   imported from holds no ``*.dist-info`` / ``*.egg-info``: a ``pip install --target`` or
   ``.egg-link`` layout); and that lies under no ``PYTHONPATH`` entry other than the
   script's directory (an entry holding the script's directory leaves the files beside the
   script to it). Rule 2 leaves out private names (any part of the qualified name
   starting with ``_``, as ``_spy_system`` or ``Tools._run``) of such a module: the program's
   own helpers are not a peer's to call until 1 registers them (``__main__``'s names are
   all allowed, as torch allows them: scripts name their RPC functions ``_run_trainer``). For
   1 and 2, ``name`` or ``Class.name`` is found in the module's (and
   the class's) own ``__dict__`` and the object's own ``__module__`` and ``__qualname__`` must
   be the name asked for, so a name a module imported (``os``, ``subprocess.run``) or an
   attribute path (``sibling:os.system``, ``fn.__globals__``) never resolves;
3. one of shardwise's own RPC entry points (RRefs, remote modules, the distributed optimizer,
   autograd, the pipeline), registered by their modules;
4. a pure library operation: ``DEFAULT_OPS`` (``torch.add``, ``torch.matmul``, ...), an
   ``nn.Module`` class of ``torch.nn`` or an optimizer class of ``torch.optim`` (constructors);
5. a method of a value the worker owns (methods.py): a public name found in a class dict
   along the value's MRO (never the instance's dict), either a function defined in a class
   that 1 or 2 allows, or one of the pure methods of tensors, modules and optimizers
   (``methods.PURE_METHODS``). RemoteModule's ``module_cls`` and DistributedOptimizer's
   ``optimizer_class`` must be ``nn.Module`` / ``Optimizer`` subclasses, checked
   (:func:`require_class`) before anything is constructed.

The unpickler (serialization.py) also accepts data-only globals (dtypes, ``torch.device``,
``torch.Size``, layouts, ``collections.OrderedDict``, builtin containers and scalars) and
refuses everything else, with an error that names the global and says how to allow it. Nothing
is ever imported because a peer named it. Peers are authenticated first (wire/auth.py); this is the
second line.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import importlib.metadata
import os
import site
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

import torch
from torch import nn

from shardwise.distributed.env import str_var

F = TypeVar("F")

# the script every worker runs: ``__main__``, or ``__mp_main__`` in a process that
# multiprocessing's spawn started (it imports the parent's script under that name)
MAIN_MODULES = ("__main__", "__mp_main__")
_registry: dict[str, Any] = {}  # "module:qualname" -> object
_names: dict[int, str] = {}  # id(object) -> its registered name (the caller's side)
_modules: set[str] = set(MAIN_MODULES)
_lock = threading.Lock()

# Pure tensor operations every worker serves by default (``torch.<name>``): they compute on
# their arguments and touch nothing else (no files, no code, no process state).
DEFAULT_OPS = (
    "abs", "add", "addmm", "all", "allclose", "any", "arange", "argmax", "argmin", "bmm", "cat",
    "chunk", "clamp", "clone", "cos", "cumsum", "div", "dot", "einsum", "empty", "eq", "equal",
    "exp", "eye", "flatten", "full", "ge", "gt", "le", "linspace", "log", "lt", "matmul", "max",
    "maximum", "mean", "min", "minimum", "mm", "mul", "ne", "neg", "norm", "ones", "ones_like",
    "pow", "prod", "rand", "randn", "relu", "reshape", "sigmoid", "sin", "softmax", "split",
    "sqrt", "square", "stack", "std", "sub", "sum", "t", "tanh", "transpose", "var", "where",
    "zeros", "zeros_like",
)
_DEFAULTS = {f"torch:{n}": vars(torch)[n] for n in DEFAULT_OPS}
_DEFAULT_NAMES = {id(v): k for k, v in _DEFAULTS.items()}
_TORCH_CLASS_ROOTS = (("torch.nn.modules.", nn.Module), ("torch.optim.", torch.optim.Optimizer))
# (builtins whose pickles are REDUCE calls; none iterates or allocates by its argument)
_DATA_BUILTINS = {"complex": complex, "slice": slice}
_HOW = ("register it on this worker: @shardwise.rpc.register on the function or class, or "
        "init_rpc(..., allowed_modules=[{module!r}]) for that module's own functions and "
        "classes (a module of the program itself, beside the script or in the working "
        "directory and no installed library's, is allowed once the worker has imported it)")
_HOW_PRIVATE = ("@shardwise.rpc.register on it, or init_rpc(..., allowed_modules=[{module!r}]) "
                "for every function and class that module defines")
# rule 2: the program's directories, and what is never the program under them
_LIBRARY_DIRS = ("site-packages", "dist-packages")
_NOT_PROGRAM = ("shardwise", "torch")
_program: dict[str, Any] = {"roots": None, "library": (), "script": None, "pythonpath": (),
                           "dists": None}
_program_modules: dict[str, tuple[ModuleType, bool]] = {}  # name -> (module, is program)
_metadata_dirs: dict[str, bool] = {}  # directory -> holds a *.dist-info / *.egg-info


class ForbiddenCallable(RuntimeError):
    """A peer named a function or class this worker refuses to resolve."""


def register(obj: F) -> F:
    """Let peers call (or send in an argument) ``obj``, a module-level function or class or a
    function defined in a class; usable as a decorator. Returns ``obj``."""
    name = _own_name(obj)
    with _lock:
        _registry[name] = obj
        _names[id(obj)] = name
    return obj


def register_module(module: str | ModuleType) -> None:
    """Let peers name the functions and classes that ``module`` itself defines (not the names
    it imports). A module given by name is imported now; a peer never imports anything."""
    if isinstance(module, str):
        __import__(module)
        name = module
    else:
        name = module.__name__
    with _lock:
        _modules.add(name)


def allowed_modules() -> frozenset[str]:
    return frozenset(_modules)


def _own_name(obj: Any) -> str:
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        raise TypeError(f"{obj!r} cannot be registered for RPC: only module-level functions and "
                        "classes and functions defined in a class have a name a peer can use")
    return f"{module}:{qualname}"


def qualified_name(func: Callable[..., Any]) -> str:
    """``module:qualname`` under which a peer can find ``func``."""
    known = _names.get(id(func)) or _DEFAULT_NAMES.get(id(func))
    if known is not None:
        return known
    module = getattr(func, "__module__", None)
    qualname = getattr(func, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        raise TypeError(
            f"RPC functions are sent by importable name; {func!r} has none (lambdas, local "
            "functions and bound methods of local objects cannot be called remotely: define "
            "the function at module level)"
        )
    return f"{module}:{qualname}"


def resolve(name: str) -> Any:
    """The callable a peer named ``module:qualname``, if this worker allows it."""
    module, sep, qualname = name.partition(":")
    if not sep or not module or not qualname:
        raise ForbiddenCallable(f"malformed function name {name!r}; expected module:qualname")
    return resolve_global(module, qualname)


def resolve_global(module: str, qualname: str) -> Any:
    """The object ``module.qualname`` if [Note: allow-list] allows it, else ForbiddenCallable."""
    key = f"{module}:{qualname}"
    found = _registry.get(key)
    if found is None:
        found = _DEFAULTS.get(key)
    if found is None and module in _modules:
        found = _own_member(module, qualname)
    elif found is None and is_program_module(module):
        if _private(qualname):
            raise ForbiddenCallable(
                f"RPC never resolves {module}.{qualname}: it is private (a name starting with "
                "'_') in a module of the program, which a peer may call only once it is "
                f"registered; to allow it, {_HOW_PRIVATE.format(module=module)}")
        found = _own_member(module, qualname)
    if found is None:
        found = _torch_class(module, qualname)
    if found is None:
        raise ForbiddenCallable(
            f"RPC never resolves {module}.{qualname} on this worker: it is not a registered "
            f"function or class{_why_refused(module)}; to allow it, "
            f"{_HOW.format(module=module)}")
    return found


def set_program_roots(roots: list[str] | None = None, script_dir: str | None = None) -> None:
    """Fix the directories of the program (rule 2 of [Note: allow-list]): ``roots`` (with the
    script's directory ``script_dir``), or the main script's directory and the working
    directory now (``init_rpc`` calls this). ``/``, a home directory, a temporary directory's
    root and a library tree are never a root."""
    if roots is None:
        roots = []
        main_file = vars(sys.modules.get("__main__", sys)).get("__file__")
        if isinstance(main_file, str):
            script_dir = os.path.dirname(os.path.abspath(main_file))
            roots.append(script_dir)
        with contextlib.suppress(OSError):  # (a deleted working directory)
            roots.append(os.getcwd())
    library = _library_trees()
    never = _never_roots()
    real = {os.path.realpath(r) for r in roots}
    kept = tuple(sorted(r for r in real if os.path.dirname(r) != r and r not in never
                        and not _is_home(r) and not _is_library(r, library)))
    script = os.path.realpath(script_dir) if script_dir else None
    entries = str_var("PYTHONPATH") or ""
    pythonpath = tuple(sorted({os.path.realpath(e) for e in entries.split(os.pathsep) if e}))
    with _lock:
        _program.update(roots=kept, library=library, script=script, pythonpath=pythonpath,
                        dists=None)
        _program_modules.clear()
        _metadata_dirs.clear()


def program_roots() -> tuple[str, ...]:
    if _program["roots"] is None:
        set_program_roots()
    return _program["roots"]


def is_program_module(name: str) -> bool:
    """``name`` is an imported module of the program itself (rule 2); never imports it."""
    if name in MAIN_MODULES:
        return name in sys.modules
    if name.partition(".")[0] in _NOT_PROGRAM:
        return False
    mod = sys.modules.get(name)
    if not isinstance(mod, ModuleType):
        return False
    cached = _program_modules.get(name)
    if cached is not None and cached[0] is mod:
        return cached[1]
    roots = program_roots()
    path = vars(mod).get("__file__")  # (the module's dict: a module __getattr__ never runs)
    answer = False
    if isinstance(path, str) and path:
        real = os.path.realpath(path)
        answer = any(_under(real, root) for root in roots) \
            and not _is_library(real, _program["library"]) and not _not_program(name, real)
    with _lock:
        _program_modules[name] = (mod, answer)
    return answer


def _not_program(name: str, real_path: str) -> str:
    """Why the module ``name`` (file ``real_path``, under a root) is not the program's, in
    words for an error; "" when nothing says so."""
    entry = _on_pythonpath(real_path)
    if entry:
        return f"its file {real_path} lies under the PYTHONPATH entry {entry}"
    return _installed(name, real_path)


def _why_refused(module: str) -> str:
    """`` (why ...)`` for an imported module under the program's roots that rule 2 leaves out;
    "" otherwise."""
    path = vars(sys.modules[module]).get("__file__") if module in sys.modules else None
    if not isinstance(path, str) or not path:
        return ""
    real = os.path.realpath(path)
    if not any(_under(real, root) for root in program_roots()):
        return ""
    why = _not_program(module, real)
    return f" ({module} is not the program's own: {why})" if why else ""


def _never_roots() -> set[str]:
    """Directories that hold far more than one program: home directories (this user's, and
    any directly under ``/home`` or ``/Users``, checked by ``_is_home``) and the roots of
    temporary files."""
    homes = {os.path.expanduser("~"), tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm",
             "/root"}
    with contextlib.suppress(ImportError, KeyError, OSError):
        import pwd

        homes.add(pwd.getpwuid(os.getuid()).pw_dir)
    return {os.path.realpath(h) for h in homes if h}


def _is_home(path: str) -> bool:
    return os.path.dirname(path) in ("/home", "/Users")


def _on_pythonpath(real_path: str) -> str:
    """The ``PYTHONPATH`` entry (where ``pip install --target`` puts libraries) that
    ``real_path`` lies under, other than the script's directory or one holding the script's
    directory with the file beside the script; "" if none."""
    script = _program.get("script")
    beside_script = script is not None and _under(real_path, script)
    for entry in _program.get("pythonpath", ()):
        if entry == script or not _under(real_path, entry):
            continue
        if not (beside_script and _under(script, entry)):
            return entry
    return ""


def _installed(name: str, real_path: str) -> str:
    """How the module is part of an installed distribution, "" if it is not: its top-level
    name is one that an installed distribution provides (``importlib.metadata``), or the
    directory it was imported from (its top-level package's parent) holds a ``*.dist-info`` or
    ``*.egg-info`` (a site or ``pip install --target`` directory; the project of an
    ``.egg-link`` editable install)."""
    top = name.partition(".")[0]
    if top in _distribution_names():
        return f"an installed distribution provides the package {top}"
    folder = os.path.dirname(real_path)
    levels = name.count(".") + os.path.basename(real_path).startswith("__init__.")
    for _ in range(levels):
        folder = os.path.dirname(folder)
    if _has_metadata(folder):
        return f"{folder}, where it is imported from, holds an installed distribution's metadata"
    return ""


def _distribution_names() -> frozenset[str]:
    names = _program.get("dists")
    if names is None:
        try:
            names = frozenset(importlib.metadata.packages_distributions())
        except Exception:  # noqa: BLE001 - a broken distribution's metadata: nothing known
            names = frozenset()
        _program["dists"] = names
    return names


def _has_metadata(folder: str) -> bool:
    found = _metadata_dirs.get(folder)
    if found is None:
        try:
            with os.scandir(folder) as entries:
                found = any(e.name.endswith((".dist-info", ".egg-info")) for e in entries)
        except OSError:
            found = False
        _metadata_dirs[folder] = found
    return found


def _library_trees() -> tuple[str, ...]:
    """The interpreter's, the installed packages' and shardwise's and torch's directories."""
    trees = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             *sysconfig.get_paths().values(), *site.getsitepackages()]
    user_site = site.getusersitepackages()
    trees += [user_site] if isinstance(user_site, str) else list(user_site)
    for name in _NOT_PROGRAM:
        mod = sys.modules.get(name)
        path = vars(mod).get("__file__") if mod is not None else None
        if isinstance(path, str):
            trees.append(os.path.dirname(path))
    return tuple(sorted({os.path.realpath(t) for t in trees if t}))


def _is_library(real_path: str, library: tuple[str, ...]) -> bool:
    parts = real_path.split(os.sep)
    return any(d in parts for d in _LIBRARY_DIRS) or any(_under(real_path, t) for t in library)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def is_allowed_class(cls: type) -> bool:
    """``cls`` is registered, defined in an allowed module or in the program (rules 1 and 2;
    not rule 4: torch's classes are reached through the pure methods of methods.py)."""
    module, qualname = getattr(cls, "__module__", None), getattr(cls, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return False
    if _registry.get(f"{module}:{qualname}") is cls:
        return True
    if module in _modules or (is_program_module(module) and not _private(qualname)):
        return _own_member(module, qualname) is cls
    return False


def _private(qualname: str) -> bool:
    """A part of ``qualname`` starts with ``_`` (rule 2 leaves such names to rule 1)."""
    return any(part.startswith("_") for part in qualname.split("."))


def require_class(obj: Any, base: type, what: str) -> type:
    """``obj`` if it is a subclass of ``base``; else ForbiddenCallable (nothing was called)."""
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise ForbiddenCallable(f"{what} must be a subclass of {base.__module__}."
                                f"{base.__qualname__}; got {obj!r:.100}, refused before "
                                "anything was constructed or called")
    return obj


def resolve_data(module: str, qualname: str) -> Any:
    """Data-only globals that pickles of tensors' dtypes, devices, shapes and builtin
    containers name (the unpickler's additions to :func:`resolve_global`); None if not one."""
    if module == "torch":
        value = vars(torch).get(qualname)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        if qualname == "device":
            return torch.device
        if qualname == "Size":
            return _size
    if (module, qualname) == ("torch.serialization", "_get_layout"):
        return _layout
    if (module, qualname) == ("collections", "OrderedDict"):
        return _ordered_dict
    if module == "builtins":
        return _DATA_BUILTINS.get(qualname)
    return None


def is_registered(obj: Any) -> bool:
    """``obj`` itself was passed to :func:`register` on this worker."""
    name = _names.get(id(obj))
    return name is not None and _registry.get(name) is obj


def resolve_data_class(module: str, qualname: str) -> type | None:
    """An ``nn.Module`` subclass this worker has already imported, found in ``sys.modules`` by
    its exact ``__module__`` / ``__qualname__`` (never imported for a peer), whose instances
    rebuild from their state alone: created by ``object.__new__`` (no ``__init__`` runs), state
    set by ``nn.Module.__setstate__`` or the override of a ``torch.nn`` module, pickled by
    ``object``'s own ``__reduce_ex__``. None otherwise. The unpickler returns it only as the
    class of a ``NEWOBJ`` ([Note: pickle scan] in pickle_scan.py)."""
    parts = qualname.split(".")
    obj: Any = sys.modules.get(module)
    for part in parts:
        if obj is None or part.startswith("__") or not part:
            return None
        obj = vars(obj).get(part) if hasattr(obj, "__dict__") else None
    if not (isinstance(obj, type) and type(obj) is type and issubclass(obj, nn.Module)
            and _defined_as(obj, module, qualname) and obj.__new__ is object.__new__):
        return None
    return obj if all(_owner(obj, attr) is object for attr in _OBJECTS_OWN) \
        and all(_torch_nn(_owner(obj, attr)) for attr in _MODULES_OWN) else None


_OBJECTS_OWN = ("__reduce__", "__reduce_ex__", "__getattribute__")
_MODULES_OWN = ("__setstate__", "__setattr__", "__getattr__")


def _owner(cls: type, attr: str) -> type | None:
    """The class of ``cls``'s MRO that defines ``attr``."""
    return next((k for k in cls.__mro__ if attr in vars(k)), None)


def _torch_nn(cls: type | None) -> bool:
    """``cls`` is ``nn.Module`` or a module class of torch.nn itself."""
    return cls is nn.Module or (cls is not None and issubclass(cls, nn.Module)
                                and cls.__module__.startswith("torch.nn.modules."))


def _size(dims: Any = ()) -> torch.Size:
    """``torch.Size`` from a pickled tuple of at most 64 ints (never iterates anything else)."""
    if not isinstance(dims, (tuple, list)) or len(dims) > 64 \
            or not all(type(d) is int for d in dims):
        raise ForbiddenCallable("a pickled torch.Size must be a tuple of at most 64 ints")
    return torch.Size(dims)


def _ordered_dict(*args: Any) -> collections.OrderedDict:
    """An empty OrderedDict (its pickle fills it with SETITEMS); never iterates an argument."""
    if args:
        raise ForbiddenCallable("a pickled OrderedDict must be built empty")
    return collections.OrderedDict()


def _layout(name: str) -> torch.layout:
    value = vars(torch).get(name.removeprefix("torch."))
    if not isinstance(value, torch.layout):
        raise ForbiddenCallable(f"unknown tensor layout {name!r}")
    return value


def _own_member(module: str, qualname: str) -> Any:
    """A function or class that ``module`` defines, by its exact qualified name; None if none."""
    parts = qualname.split(".")
    if len(parts) > 2 or any(p.startswith("__") or not p for p in parts):
        return None
    mod = sys.modules.get(module)
    if mod is None:
        return None
    top = vars(mod).get(parts[0])
    if not _defined_as(top, module, parts[0]):
        return None
    if len(parts) == 1:
        return top
    if not isinstance(top, type):
        return None
    member = vars(top).get(parts[1])
    func = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
    if not _defined_as(func, module, qualname):
        return None
    return getattr(top, parts[1])  # (a classmethod bound to its class)


def _defined_as(obj: Any, module: str, qualname: str) -> bool:
    """``obj`` is a function or class whose own module and qualified name are these."""
    return (obj is not None and callable(obj) and not isinstance(obj, ModuleType)
            and getattr(obj, "__module__", None) == module
            and getattr(obj, "__qualname__", None) == qualname)


def _torch_class(module: str, qualname: str) -> type | None:
    """An ``nn.Module`` class of torch.nn or an optimizer class of torch.optim, by exact name
    (RemoteModule and DistributedOptimizer send them)."""
    for root, base in _TORCH_CLASS_ROOTS:
        if module.startswith(root) and "." not in qualname:
            mod = sys.modules.get(module)
            cls = vars(mod).get(qualname) if mod is not None else None
            if (isinstance(cls, type) and issubclass(cls, base)
                    and _defined_as(cls, module, qualname)):
                return cls
    return None


def resolve_exception(module: str, qualname: str) -> type[Exception] | None:
    """The exception class a reply names, if it is a builtin one, one of shardwise's, or one the
    worker allows; None otherwise (the caller then raises a RemoteException)."""
    if module == "builtins":
        cls = vars(builtins).get(qualname)
    elif module.startswith("shardwise.") or module.startswith("torch."):
        mod = sys.modules.get(module)
        cls = _exception_in(mod, qualname) if mod is not None else None
    else:
        try:
            cls = resolve_global(module, qualname)
        except ForbiddenCallable:
            cls = None
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls
    return None


def _exception_in(mod: ModuleType, qualname: str) -> Any:
    cls = vars(mod).get(qualname)
    return cls if _defined_as(cls, mod.__name__, qualname) else None
