"""Which methods a peer may call on a value this worker owns (rule 5 of [Note: allow-list] in
callables.py).

An RRef proxy call (``rref.rpc_sync().m(...)``, ``rref.remote().m()``, ``invoke_method``),
RemoteModule's forward and DistributedOptimizer's step name a method of a value the worker
owns. :func:`resolve_method` finds it by a class-dict lookup along ``type(value).__mro__``
(never in the instance's ``__dict__``, never through ``__getattr__``) and returns it bound only
when it is either

(a) a function defined in the class dict of a class the worker allows (registered, in an
    allowed module, in ``__main__`` or in a module of the program), whose own ``__module__``
    and ``__qualname__`` say it was defined there; or
(b) in :data:`PURE_METHODS` for a ``torch.Tensor``, ``nn.Module`` or ``torch.optim.Optimizer``
    value: arithmetic, shape and value reads, copies and in-place updates of the value itself.

Names with a leading underscore are refused, as are special methods other than ``__call__``,
``__getitem__`` and ``__len__``. Everything of a library object outside (b) is data, never a
handle: an ndarray or storage a program function returned cannot be asked to ``tofile``,
``dump`` or ``from_file``, and a tensor cannot be asked for ``numpy``, ``untyped_storage``,
``share_memory_`` or hooks. ``to`` is limited to dtypes and the CPU.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise.rpc.trust.callables import ForbiddenCallable, is_allowed_class

_TENSOR_READS = (
    "size", "dim", "numel", "nelement", "element_size", "stride", "is_contiguous",
    "is_floating_point", "is_complex", "item", "tolist", "equal", "allclose", "__getitem__",
    "__len__",
)
_TENSOR_MATH = (
    "abs", "add", "addmm", "all", "any", "argmax", "argmin", "bmm", "clamp", "cos", "cumsum",
    "div", "dot", "eq", "exp", "ge", "gt", "le", "log", "lt", "matmul", "max", "maximum",
    "mean", "min", "minimum", "mm", "mul", "ne", "neg", "norm", "pow", "prod", "relu",
    "sigmoid", "sin", "softmax", "sqrt", "square", "std", "sub", "sum", "tanh", "var", "where",
    "masked_fill",
)
_TENSOR_SHAPES = (
    "chunk", "clone", "contiguous", "detach", "expand", "flatten", "narrow", "permute",
    "reshape", "select", "split", "squeeze", "t", "transpose", "unbind", "unsqueeze", "view",
    "view_as", "to", "cpu", "float", "double", "half", "bfloat16", "int", "long", "bool",
)
# in place on the owner's value (the caller holds that RRef)
_TENSOR_UPDATES = ("add_", "sub_", "mul_", "div_", "copy_", "fill_", "zero_", "requires_grad_")
_MODULE = (
    "forward", "__call__", "parameters", "named_parameters", "buffers", "named_buffers",
    "state_dict", "load_state_dict", "train", "eval", "zero_grad", "requires_grad_", "to",
)
_OPTIMIZER = ("step", "zero_grad", "state_dict", "load_state_dict")

# [Note: allow-list] rule 5(b): the documented pure methods of torch's value types
PURE_METHODS: dict[type, frozenset[str]] = {
    torch.Tensor: frozenset(_TENSOR_READS + _TENSOR_MATH + _TENSOR_SHAPES + _TENSOR_UPDATES),
    nn.Module: frozenset(_MODULE),
    torch.optim.Optimizer: frozenset(_OPTIMIZER),
}
_SPECIAL = frozenset({"__call__", "__getitem__", "__len__"})
_DESCRIPTORS = (types.MethodDescriptorType, types.WrapperDescriptorType)


class ForbiddenMethod(ForbiddenCallable):
    """A peer named a method this worker refuses to call on a value it owns."""


def check_method_name(name: Any) -> str:
    """Refuse a name that can never be allowed, before the owner's value is looked at."""
    if not isinstance(name, str) or not name.isidentifier() or len(name) > 200:
        raise ForbiddenMethod(f"RRef proxy calls need a method name, got {name!r:.80}")
    if name.startswith("__") and name.endswith("__") and name not in _SPECIAL:
        raise ForbiddenMethod(f"RRef proxy calls cannot name the special method {name!r}, "
                              "of any class (only __call__, __getitem__ and __len__); call it "
                              "in a function of the program on the owner instead")
    if name.startswith("_") and name not in _SPECIAL:
        raise ForbiddenMethod(f"RRef proxy calls cannot name the private method {name!r}, of "
                              "any class (a name with a leading underscore); call it in a "
                              "function of the program on the owner instead")
    return name


def resolve_method(value: Any, name: Any) -> Callable[..., Any]:
    """``value.<name>`` bound, if rule 5 of [Note: allow-list] allows it; else
    :class:`ForbiddenMethod` naming the method, the class and how to allow it."""
    check_method_name(name)
    cls = type(value)
    owner, entry = _class_entry(cls, name)
    if owner is None:
        raise ForbiddenMethod(f"RRef method {name!r} is not defined by the class "
                              f"{_name(cls)} (an attribute of the instance is never called by "
                              "name)")
    if is_allowed_class(owner) and _defined_in(entry, owner, name):
        return entry.__get__(value, cls)
    for base, names in PURE_METHODS.items():
        if isinstance(value, base) and name in names and _library_method(entry, owner):
            bound = entry.__get__(value, cls)
            return _cpu_only(bound, name) if name == "to" else bound
    raise ForbiddenMethod(
        f"RRef method {name!r} of {_name(cls)} is not allowed on this worker: methods of a "
        "library class are limited to the pure methods of tensors, modules and optimizers "
        "(shardwise.rpc.trust.methods.PURE_METHODS); to allow the methods of a class, define it in "
        "the program (the script or a module beside it) or register it "
        "(@shardwise.rpc.register on the class, or init_rpc(..., allowed_modules=[...]))")


def _class_entry(cls: type, name: str) -> tuple[type | None, Any]:
    """The first class of ``cls.__mro__`` whose own dict has ``name``, and that entry."""
    for klass in cls.__mro__:
        entry = vars(klass).get(name)
        if entry is not None:
            return klass, entry
    return None, None


def _defined_in(entry: Any, owner: type, name: str) -> bool:
    """``entry`` is a function (or static/class method) written in ``owner``'s body."""
    func = entry.__func__ if isinstance(entry, (staticmethod, classmethod)) else entry
    return (isinstance(func, types.FunctionType)
            and func.__module__ == owner.__module__
            and func.__qualname__ == f"{owner.__qualname__}.{name}")


def _library_method(entry: Any, owner: type) -> bool:
    """A method written in C for ``owner``, or a function of ``owner``'s own package (torch's
    ``Module.__call__`` is ``_wrapped_call_impl``, ``Tensor.__len__`` is in ``torch._tensor``);
    not a function of another package that a class body borrowed."""
    if isinstance(entry, _DESCRIPTORS):
        return True
    return (isinstance(entry, types.FunctionType) and isinstance(entry.__module__, str)
            and entry.__module__.partition(".")[0] == owner.__module__.partition(".")[0])


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _cpu_only(bound: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``to`` with dtypes, CPU devices and CPU tensors only (no device a peer picks)."""
    def to(*args: Any, **kwargs: Any) -> Any:
        for arg in (*args, *kwargs.values()):
            if not _cpu_or_plain(arg):
                raise ForbiddenMethod(f"RRef method {name!r} takes only dtypes and CPU devices "
                                      f"from a peer, got {arg!r:.80}")
        return bound(*args, **kwargs)

    return to


def _cpu_or_plain(arg: Any) -> bool:
    if arg is None or isinstance(arg, (bool, torch.dtype, torch.memory_format)):
        return True
    if isinstance(arg, torch.device):
        return arg.type == "cpu"
    if isinstance(arg, torch.Tensor):
        return arg.device.type == "cpu"
    if isinstance(arg, str):
        try:
            return torch.device(arg).type == "cpu"
        except RuntimeError:
            return False
    return False
