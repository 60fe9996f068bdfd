"""``FSDPModule``: what a module becomes after ``fully_shard`` (torch FSDP2's class and methods).

``fully_shard`` changes the module's class, in place, to a subclass of both ``FSDPModule`` and
the module's own class (``FSDPBlock`` for a ``Block``), as torch does: ``isinstance(m,
FSDPModule)`` holds, the module keeps its own methods, and the methods below control the unit
by hand. Moving or converting the module (``to_empty``, ``to``, ``cuda``, ``half``) goes through
``_apply``, which re-adopts the converted shards into the unit's flat buffer, so torch's
meta-device initialisation (build on ``meta``, ``fully_shard``, ``to_empty``,
``reset_parameters``) trains the parameters the forward reads.

``FSDPModule`` derives from torch's ``torch.distributed.fsdp.FSDPModule``: third-party code
(trainers, torchtitan's utilities, accelerate-style wrappers) tests ``isinstance(m,
torch.distributed.fsdp.FSDPModule)`` before calling FSDP2 methods, and torch's class is a plain
class (no ``register``). Methods defined by ours come first in the MRO; every other public
method of torch's class would run torch's implementation on a module that has none of its
state, so ``TorchFSDPModuleBase`` overrides each of them with an error that names the call,
why it cannot work here, and what to use instead (or accepts it where it asks for what our
units already do).

Gradient accumulation without communication (``no_sync`` / ``set_requires_gradient_sync``):
while gradient sync is off, each unit keeps its unsharded flat gradient across backward passes
(autograd adds into it) and issues no reduce-scatter; the first backward with sync on again
reduce-scatters the accumulated sum, as torch's FSDP does. This costs the memory of unsharded
gradients while accumulating, and saves one reduce-scatter per unit per skipped micro-batch.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from torch import nn

from shardwise._compat import TorchFSDPModule as _TorchFSDPModule
from shardwise.dp.refused import refused_method
from shardwise.fsdp.unit import FSDPUnit, get_unit, units_of


# ---- gradient accumulation without communication ------------------------------------------------
def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn gradient reduction of every unit at or below ``module`` on or off."""
    units = units_of(module)
    if not units:
        raise ValueError(f"{type(module).__name__} has no FSDP units: apply fully_shard first")
    for unit in units:
        unit.no_sync = not requires_gradient_sync


@contextmanager
def no_sync(module: nn.Module) -> Iterator[None]:
    """Inside the block, backward accumulates unsharded gradients without communicating."""
    set_requires_gradient_sync(module, False)
    try:
        yield
    finally:
        set_requires_gradient_sync(module, True)


# ---- torch's FSDPModule methods that ours refuses -----------------------------------------------
_STREAMS = ("it tunes the CUDA streams or communication memory of torch's implementation, "
            "which shardwise's units do not use; leave it out")
_HOOK = ("shardwise's units run their own collectives; FullyShardedDataParallel's "
         "register_comm_hook replaces the gradient reduction")
_FINALIZE = ("shardwise's units finish the gradient reduction when each backward ends (an "
             "autograd engine callback); for backward passes that should not reduce, call "
             "set_requires_gradient_sync(False) before them")

# torch FSDPModule method -> (why it cannot work on our modules, and what instead)
_REFUSED = {
    "reset_iter_state": "shardwise's units keep no per-iteration state that torch's "
                        "recovery resets; after an aborted step call reshard() on the root",
    "set_requires_all_reduce": "hybrid sharding's all-reduce follows "
                               "set_requires_gradient_sync",
    "set_custom_all_gather": _HOOK,
    "set_custom_reduce_scatter": _HOOK,
    "set_all_reduce_hook": _HOOK,
    "set_post_optim_event": _STREAMS,
    "set_reduce_scatter_max_input_buffers": _STREAMS,
    "set_separate_reduce_scatter_group": _STREAMS,
    "set_unshard_in_backward": "a unit is gathered again in backward unless "
                               "reshard_after_forward=False keeps it",
    "set_allocate_memory_from_process_group_for_comm": _STREAMS,
    "set_symm_mem_for_comm": _STREAMS,
    "_set_unshard_async_op": _STREAMS,
    "set_keep_unsharded_storage": "it keeps torch's unsharded storage fixed for CUDA graph "
                                  "capture; shardwise's units hand gathered memory from unit "
                                  "to unit (fsdp/collectives.py); leave it out",
    "set_manual_backward_finalization": _FINALIZE,
    "finalize_backward": _FINALIZE,
    "_get_fsdp_state": "it is torch's internal FSDP2 state, which a shardwise module does not "
                       "have: torch code that drives FSDP2's internals (e.g. "
                       "torch.distributed.pipelining's schedules) cannot drive shardwise's "
                       "units; use torch's fully_shard there",
}


def _refusal(name: str, why: str):
    return refused_method(name, "torch FSDP2's FSDPModule",
                          "a module sharded by shardwise.fully_shard", why)


class TorchFSDPModuleBase(_TorchFSDPModule):
    """torch's ``FSDPModule`` with each method that ours does not implement refused."""

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # FSDPModule._apply calls super()._apply: skip torch's, which reads torch's FSDP state
        return super(_TorchFSDPModule, self)._apply(*args, **kwargs)


for _name, _why in _REFUSED.items():
    setattr(TorchFSDPModuleBase, _name, _refusal(_name, _why))


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``: ``wait()`` blocks until the module's
    parameters are gathered and in place."""

    def __init__(self, unit: FSDPUnit):
        self._unit = unit

    def wait(self) -> None:
        self._unit.finish_manual_unshard()


class FSDPModule(TorchFSDPModuleBase):
    """Mixin placed before the module's own class by ``fully_shard``; a subclass of torch's
    ``FSDPModule``, so ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` holds (see
    ``TorchFSDPModuleBase`` above for torch's methods that ours does not implement)."""

    # [FSDP<Orig>, FSDPModule, TorchFSDPModuleBase, torch's FSDPModule, Orig, ...]
    _orig_cls_mro_index = 4

    def __new__(cls, *args: Any, **kwargs: Any):
        # a container that builds a new instance of its own class (e.g. slicing a ModuleList)
        # gets the original class, not a sharded one
        orig = cls.__mro__[cls._orig_cls_mro_index]
        self = orig.__new__(orig)
        self.__init__(*args, **kwargs)
        return self

    def _fsdp_unit(self) -> FSDPUnit:
        return get_unit(self)  # type: ignore[arg-type]

    def reshard(self) -> None:
        """Free this module's gathered parameters (no collective)."""
        self._fsdp_unit().manual_reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this module's parameters (all-gather over its group) and keep them until
        ``reshard()`` or the end of the next backward; with ``async_op`` return a handle whose
        ``wait()`` finishes the gather."""
        unit = self._fsdp_unit()
        unit.start_manual_unshard()
        if async_op:
            return UnshardHandle(unit)
        unit.finish_manual_unshard()
        return None

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """Turn the gradient reduce-scatter on or off (off: gradients accumulate unsharded)."""
        if recurse:
            set_requires_gradient_sync(self, requires_gradient_sync)  # type: ignore[arg-type]
        else:
            self._fsdp_unit().no_sync = not requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, *,
                                  recurse: bool = True) -> None:
        _check_bool("reshard_after_forward", reshard_after_forward)
        for unit in self._units(recurse):
            unit.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """False keeps parameters gathered after backward (e.g. between micro-batches of one
        accumulated step), saving the next forward's all-gather for memory."""
        _check_bool("reshard_after_backward", reshard_after_backward)
        for unit in self._units(recurse):
            unit.reshard_after_backward = reshard_after_backward

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """True: a parameter that no rank used gets a zero gradient, as with torch's FSDP2
        under this setting. False (the default): it keeps ``grad is None`` ([Note: gradients of
        unused parameters], fsdp/reduction.py). Either way every rank reduces every
        parameter of the unit, with zeros for those it got no gradient for, so ranks may use
        different parameters."""
        _check_bool("reduce_scatter_unused_params", reduce_scatter_unused_params)
        for unit in self._units(recurse):
            unit.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_gradient_divide_factor(self, factor: float) -> None:
        """This unit's gradients become the sum over its data-parallel ranks divided by
        ``factor`` instead of their mean (torch FSDP2's method; e.g. ``1.0`` where the loss is
        already divided by the global token count). The collectives are unchanged: the mean
        they give is scaled once by ``ranks / factor`` when it lands in ``.grad``. As in torch,
        it sets this module's own unit only; call it on each ``FSDPModule`` to cover a model."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (
                math.isfinite(factor) and factor > 0):
            raise ValueError(f"set_gradient_divide_factor: factor must be a finite number "
                             f"above 0, got {factor!r}")
        unit = self._fsdp_unit()
        if unit.handle is not None:
            unit.handle.divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """torch's older name of ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted for torch's API; it changes nothing here. torch uses it to make NCCL reduce
        with SUM and scale separately; shardwise's units already pick each backend's fastest
        equivalent collective, and the gradients' values do not depend on that choice."""
        _check_bool("enable", enable)
        if enable:
            warnings.warn("set_force_sum_reduction_for_comms(True) has no effect on modules "
                          "sharded by shardwise.fully_shard (their collectives are chosen per "
                          "backend; gradients are the same)", stacklevel=2)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for torch's API. On CPU every backward already waits for its reductions;
        the flag changes nothing here."""
        _check_bool("is_last_backward", is_last_backward)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """When this module's forward starts, also issue the all-gathers of ``modules`` (in
        place of the prefetch that follows the recorded forward order)."""
        self._fsdp_unit().forward_prefetch_units = _units_of_modules(modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """When this module's backward starts, also issue the all-gathers of ``modules`` (in
        place of the prefetch that follows the reverse forward order)."""
        self._fsdp_unit().backward_prefetch_units = _units_of_modules(modules)

    def _units(self, recurse: bool) -> list[FSDPUnit]:
        return units_of(self) if recurse else [self._fsdp_unit()]  # type: ignore[arg-type]

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        unit = self._fsdp_unit()
        if unit.handle is not None:
            unit.handle.reshard()
        out = super()._apply(fn, recurse)  # type: ignore[misc]
        if unit.handle is not None:
            unit.adopt_applied_params()
        return out

    def __deepcopy__(self, memo: dict) -> NoReturn:
        raise TypeError("a module sharded by fully_shard cannot be deep-copied; copy the "
                        "unsharded module before sharding, or save and load a state dict")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _units_of_modules(modules: Iterable[nn.Module]) -> list[FSDPUnit]:
    units = []
    for m in modules:
        unit = get_unit(m)
        if unit is None:
            raise ValueError(f"{type(m).__name__} is not sharded: apply fully_shard to it "
                             "before naming it for prefetch")
        units.append(unit)
    return units


_CLASSES: dict[type, type] = {}


def make_fsdp_class(module: nn.Module) -> None:
    """Give ``module`` the class ``FSDP<its class>`` (made once per class)."""
    cls = type(module)
    if issubclass(cls, FSDPModule):
        return
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"_fsdp_orig_cls": cls})
    module.__class__ = _CLASSES[cls]
