"""``FullyShardedDataParallel``: the wrapper-style API (torch's FSDP1), built on fully_shard.

The wrapper holds the module as ``_fsdp_wrapped_module`` and shards it in place (with its
auto-wrap policy's submodules as nested units). Names seen through the wrapper, by
``named_parameters()``, ``state_dict()`` and ``load_state_dict()``, are the unwrapped module's
(the wrapper's segment is removed, as torch does), so state dicts move between the wrapped and
the plain model unchanged. The static methods are torch FSDP1's: ``summon_full_params``,
``state_dict_type`` / ``set_state_dict_type`` / ``get_state_dict_type`` (fsdp1/state_dict.py),
``optim_state_dict`` / ``optim_state_dict_to_load`` and the older optimizer-state functions
(optim_state_dict.py); ``register_comm_hook`` replaces the gradient reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.distributed.groups import collective_device
from shardwise.dp.agree import check_same_model
from shardwise.dp.data_parallel import sync_module_state
from shardwise.fsdp.fsdp1 import args
from shardwise.fsdp.fsdp1 import optim_state_dict as osd_mod
from shardwise.fsdp.fsdp1.clip_grad import clip_grad_norm_
from shardwise.fsdp.fsdp1.config import (
    BackwardPrefetch,
    StateDictSettings,
    StateDictType,
    as_settings,
)
from shardwise.fsdp.fsdp1.policies import WrapPolicy, modules_to_wrap
from shardwise.fsdp.fsdp1.state_broadcast import broadcast_named_state, restore_tuples
from shardwise.fsdp.fsdp1.state_dict import load_local, transform_state_dict
from shardwise.fsdp.fsdp1.summon import summon_full_params
from shardwise.fsdp.fully_shard import fully_shard
from shardwise.fsdp.module import no_sync
from shardwise.fsdp.state_dict import WRAPPED, check_keys, clean_name
from shardwise.fsdp.unit import units_of


class FullyShardedDataParallel(nn.Module):
    """Fully sharded data parallelism over ``process_group`` (default: the world group).

    torch FSDP1's arguments, honoured: ``auto_wrap_policy`` (torch's policy functions, e.g.
    ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``, its
    ``ModuleWrapPolicy``, or ours) picks the submodules that become units of their own; the
    module itself is the root unit and owns the rest. ``sharding_strategy``: FULL_SHARD
    (default), SHARD_GRAD_OP (parameters stay gathered from forward to backward), NO_SHARD
    (replicated; gradients all-reduced), HYBRID_SHARD and _HYBRID_SHARD_ZERO2 (sharded within
    a shard group, replicated across groups: ``process_group=(shard, replicate)``, a 2D
    ``device_mesh`` (replicate, shard), or by default sharded within a node).
    ``cpu_offload`` and ``mixed_precision`` (torch's classes or ours; MixedPrecision's
    ``cast_root_forward_inputs`` and ``cast_forward_inputs`` both mean: cast each unit's
    inputs). ``ignored_modules`` / ``ignored_states``: their parameters stay whole, unsharded
    and unreduced, and their modules are not wrapped. ``param_init_fn(module)`` is called on
    every module that holds meta-device parameters or buffers before sharding. ``device_id``,
    ``sync_module_states`` (rank 0's parameters and buffers broadcast before sharding),
    ``forward_prefetch``, ``device_mesh`` (1D, or 2D for hybrid sharding; instead of
    ``process_group``). ``use_orig_params`` must be True (the default here, unlike torch):
    parameters are always the original ones, as ``Shard(0)`` DTensors.

    Accepted but not honoured (a warning, once, when set to a non-default value):
    ``backward_prefetch`` (backward always prefetches the next unit, like BACKWARD_PRE) and
    ``limit_all_gathers=False`` (in-flight all-gathers are always limited, see
    [Note: FSDP schedule]). Our own: ``reshard_after_forward`` (False: like SHARD_GRAD_OP).
    Any other keyword is a TypeError.
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None,
                 sharding_strategy: Any = None, cpu_offload: Any = None,
                 auto_wrap_policy: WrapPolicy | Any = None,
                 backward_prefetch: Any = BackwardPrefetch.BACKWARD_PRE,
                 mixed_precision: Any = None,
                 ignored_modules: Any = None,
                 param_init_fn: Callable[[nn.Module], None] | None = None,
                 device_id: int | torch.device | None = None, sync_module_states: bool = False,
                 forward_prefetch: bool = False, limit_all_gathers: bool = True,
                 use_orig_params: bool = True, ignored_states: Any = None,
                 device_mesh: Any = None, reshard_after_forward: bool = True):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FullyShardedDataParallel wraps an nn.Module, got "
                            f"{type(module).__name__}")
        args.check_unhonoured(backward_prefetch, limit_all_gathers, use_orig_params)
        layout = args.layout_of(sharding_strategy, process_group, device_mesh,
                                reshard_after_forward)
        group, mesh = layout.group, layout.mesh
        reshard_after_forward = layout.reshard_after_forward
        ignored_mods, ignored_params = args.ignored(module, ignored_modules, ignored_states)
        if param_init_fn is not None:
            args.materialize(module, param_init_fn, ignored_mods)
        if device_id is not None:
            module = module.to(torch.device("cuda", device_id) if isinstance(device_id, int)
                               else device_id)
        check_same_model(module, layout.sync_group, what="FullyShardedDataParallel")
        if sync_module_states:
            sync_module_state(module, layout.sync_group)
        options = dict(reshard_after_forward=reshard_after_forward,
                       mixed_precision=args.as_mixed_precision(mixed_precision),
                       cpu_offload=args.as_cpu_offload(cpu_offload),
                       ignored_params=ignored_params, forward_prefetch=forward_prefetch)
        options["mesh" if mesh is not None else "process_group"] = mesh or group
        if auto_wrap_policy is not None:
            for sub in modules_to_wrap(module, auto_wrap_policy, ignored_mods, ignored_params):
                fully_shard(sub, **options)
        fully_shard(module, **options)
        self._fsdp_wrapped_module = module
        self.process_group = group
        self._state_dict_settings = as_settings(StateDictType.FULL_STATE_DICT)
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_state_dict_post_hook(_by_state_dict_type)
        self.register_load_state_dict_pre_hook(_add_prefix)

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._fsdp_wrapped_module(*args, **kwargs)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        for name, p in super().named_parameters(prefix, recurse, remove_duplicate):
            yield clean_name(name), p

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        for name, b in super().named_buffers(prefix, recurse, remove_duplicate):
            yield clean_name(name), b

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True,
                        assign: bool = False):
        """Load a state dict of the current ``state_dict_type`` (default FULL: whole tensors
        under the original names; SHARDED: DTensors or whole tensors; LOCAL: flat shards from
        ``state_dict()`` under LOCAL_STATE_DICT). With ``strict`` a mismatch of keys raises
        KeyError naming every missing and unexpected key."""
        if self._state_dict_settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
            rest = load_local(self._fsdp_wrapped_module, state_dict, strict)
            result = super().load_state_dict(rest, strict=False, assign=assign)
            params = {n for n, _ in self.named_parameters(remove_duplicate=False)}
            missing = [k for k in result.missing_keys if clean_name(k) not in params]
            if strict and (missing or result.unexpected_keys):
                raise KeyError(f"local state dict does not match the model: missing keys "
                               f"{missing}, unexpected keys {result.unexpected_keys}")
            return result
        if strict:
            check_keys(self, state_dict)
        return super().load_state_dict(state_dict, strict, assign)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (unsharded) without reduce-scatter inside the block."""
        with no_sync(self._fsdp_wrapped_module):
            yield

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by their total norm over all shards (collective)."""
        return clip_grad_norm_(self.parameters(), max_norm, norm_type, self.process_group)

    def register_comm_hook(self, state: object, hook: Callable[..., None]) -> None:
        """Replace every unit's gradient reduce-scatter by ``hook(state, grad, output)`` (torch
        FSDP1's contract for sharded strategies): ``grad`` is the unit's flat unsharded gradient
        (1D, ``world`` equal rank-major chunks, in the reduce dtype) and the hook must leave
        this rank's reduced (averaged, if it wants the usual result) chunk in ``output``. It
        runs synchronously when the unit's gradient is complete, on every world size. Register
        once, before the first forward."""
        if not callable(hook):
            raise ValueError(f"the communication hook must be callable, got {hook!r}")
        units = [u for u in units_of(self) if u.handle is not None]
        if any(u.root_state is not None for u in units):
            raise RuntimeError("register_comm_hook must be called before the first forward")
        if any(u.handle.comm_hook is not None for u in units):
            raise RuntimeError("a communication hook is already registered")
        for unit in units:
            unit.handle.set_comm_hook(state, hook)

    # ---- torch FSDP1's static methods -----------------------------------------------------
    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False
                     ) -> list[FullyShardedDataParallel]:
        """The ``FullyShardedDataParallel`` wrappers in ``module`` (nested units here are not
        wrappers, so this lists the roots)."""
        found = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        return found[:1] if root_only else found

    summon_full_params = staticmethod(summon_full_params)

    @staticmethod
    def set_state_dict_type(module: nn.Module, state_dict_type: Any,
                            state_dict_config: Any = None,
                            optim_state_dict_config: Any = None) -> StateDictSettings:
        """Set what ``state_dict()`` and the optimizer-state functions return for every wrapper
        in ``module`` (torch's or our ``StateDictType`` and config classes); returns the
        previous settings."""
        settings = as_settings(state_dict_type, state_dict_config, optim_state_dict_config)
        previous = FullyShardedDataParallel.get_state_dict_type(module)
        for wrapper in FullyShardedDataParallel.fsdp_modules(module):
            wrapper._state_dict_settings = settings
        return previous

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        wrappers = FullyShardedDataParallel.fsdp_modules(module)
        if not wrappers:
            raise ValueError(f"{type(module).__name__} contains no FullyShardedDataParallel "
                             "module")
        return wrappers[0]._state_dict_settings

    @staticmethod
    @contextmanager
    def state_dict_type(module: nn.Module, state_dict_type: Any, state_dict_config: Any = None,
                        optim_state_dict_config: Any = None) -> Iterator[None]:
        """``set_state_dict_type`` for the block, the previous settings restored after it."""
        previous = FullyShardedDataParallel.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config)
        try:
            yield
        finally:
            FullyShardedDataParallel.set_state_dict_type(
                module, previous.state_dict_type, previous.state_dict_config,
                previous.optim_state_dict_config)

    @staticmethod
    def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                         optim_state_dict: dict[str, Any] | None = None,
                         group: dist.ProcessGroup | None = None) -> dict[str, Any]:
        """``optim``'s state keyed by parameter name: full (gathered; collective) under
        FULL_STATE_DICT, DTensors under SHARDED_STATE_DICT (see optim_state_dict.py)."""
        settings = _settings_or_full(model)
        config = settings.optim_state_dict_config
        kind = settings.state_dict_type
        if kind is StateDictType.LOCAL_STATE_DICT:
            raise NotImplementedError("optim_state_dict under LOCAL_STATE_DICT: use "
                                      "optim.state_dict() (its state is already local)")
        return osd_mod.to_named(model, optim, optim_state_dict,
                                full=kind is StateDictType.FULL_STATE_DICT,
                                rank0_only=getattr(config, "rank0_only", False),
                                cpu_offload=config.offload_to_cpu, group=group)

    @staticmethod
    def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer,
                                 optim_state_dict: dict[str, Any],
                                 is_named_optimizer: bool = False, load_directly: bool = False,
                                 group: dist.ProcessGroup | None = None) -> dict[str, Any]:
        """The state dict ``optim.load_state_dict`` takes, from a name-keyed one (full or
        sharded); no collective, except under ``FullOptimStateDictConfig(rank0_only=True)``:
        then only rank 0's ``optim_state_dict`` is read and sent to the others (structure as
        JSON, tensors by broadcast; see state_broadcast.py). Works for a model without wrappers
        too (then whole tensors load as they are)."""
        if is_named_optimizer:
            raise NotImplementedError("is_named_optimizer=True (TorchRec's KeyedOptimizer) is "
                                      "not supported")
        if FullyShardedDataParallel.fsdp_modules(model):
            config = FullyShardedDataParallel.get_state_dict_type(model).optim_state_dict_config
            if getattr(config, "rank0_only", False):
                optim_state_dict = _from_rank0(model, optim, optim_state_dict, group)
        result = osd_mod.to_load(model, optim, optim_state_dict)
        if load_directly:
            optim.load_state_dict(result)
        return result

    @staticmethod
    def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                              optim_input: Any = None, rank0_only: bool = True,
                              group: dist.ProcessGroup | None = None) -> dict[str, Any]:
        """The whole optimizer state keyed by parameter name (collective); other ranks get {}
        with ``rank0_only``."""
        args.no_optim_input(optim_input)
        return osd_mod.to_named(model, optim, None, full=True, rank0_only=rank0_only,
                                cpu_offload=True, group=group)

    @staticmethod
    def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                                 group: dist.ProcessGroup | None = None) -> dict[str, Any]:
        """The optimizer state keyed by parameter name, as DTensors (no collective)."""
        return osd_mod.to_named(model, optim, None, full=False, group=group)

    @staticmethod
    def shard_full_optim_state_dict(full_optim_state_dict: dict[str, Any], model: nn.Module,
                                    optim_input: Any = None,
                                    optim: torch.optim.Optimizer | None = None
                                    ) -> dict[str, Any]:
        """A full, name-keyed state dict cut to this rank's part for ``optim`` (required)."""
        args.no_optim_input(optim_input)
        if optim is None:
            raise TypeError("shard_full_optim_state_dict needs optim= (the optimizer that will "
                            "load the result)")
        return osd_mod.to_load(model, optim, full_optim_state_dict)

    @staticmethod
    def flatten_sharded_optim_state_dict(sharded_optim_state_dict: dict[str, Any],
                                         model: nn.Module, optim: torch.optim.Optimizer
                                         ) -> dict[str, Any]:
        """A sharded, name-keyed state dict as ``optim.load_state_dict`` takes it."""
        return osd_mod.to_load(model, optim, sharded_optim_state_dict)

    @staticmethod
    def scatter_full_optim_state_dict(full_optim_state_dict: dict[str, Any] | None,
                                      model: nn.Module, optim_input: Any = None,
                                      optim: torch.optim.Optimizer | None = None,
                                      group: Any = None) -> dict[str, Any]:
        """Rank 0's full, name-keyed state dict (other ranks pass None) cut to each rank's part
        for ``optim`` (required). Collective: the structure goes as JSON, the tensors by
        broadcast (state_broadcast.py)."""
        args.no_optim_input(optim_input)
        if optim is None:
            raise TypeError("scatter_full_optim_state_dict needs optim= (the optimizer that "
                            "will load the result)")
        full = _from_rank0(model, optim, full_optim_state_dict, group)
        return osd_mod.to_load(model, optim, full)

    @staticmethod
    def rekey_optim_state_dict(optim_state_dict: dict[str, Any], optim_state_key_type: Any,
                               model: nn.Module, optim_input: Any = None,
                               optim: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """Re-key by parameter name or by position (``OptimStateKeyType``), e.g. to load a full
        name-keyed state into a plain model's optimizer."""
        args.no_optim_input(optim_input)
        return osd_mod.rekey(optim_state_dict, optim_state_key_type, model, optim)


def _settings_or_full(model: nn.Module) -> StateDictSettings:
    if FullyShardedDataParallel.fsdp_modules(model):
        return FullyShardedDataParallel.get_state_dict_type(model)
    return as_settings(StateDictType.FULL_STATE_DICT)


def _from_rank0(model: nn.Module, optim: torch.optim.Optimizer, osd: dict[str, Any] | None,
               group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Rank 0's full optimizer state dict on every rank of the model's group (or ``group``)."""
    if group is None:
        wrappers = FullyShardedDataParallel.fsdp_modules(model)
        group = wrappers[0].process_group if wrappers else dist.group.WORLD
    if dist.get_world_size(group) == 1:
        return osd
    mine = osd if dist.get_rank(group) == 0 else None
    return restore_tuples(broadcast_named_state(mine, group, collective_device(group)), optim)


# ---- state dict hooks -----------------------------------------------------------------------
def _strip_prefix(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + WRAPPED)]:
        state_dict[prefix + key[len(prefix + WRAPPED):]] = state_dict.pop(key)


def _by_state_dict_type(module: nn.Module, state_dict: dict, prefix: str,
                        local_metadata: Any) -> None:
    """FULL (the default, as torch FSDP1's), SHARDED or LOCAL: see fsdp1/state_dict.py."""
    transform_state_dict(module._fsdp_wrapped_module, module._state_dict_settings, state_dict,
                         prefix)


def _add_prefix(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any,
                strict: bool, missing_keys: list, unexpected_keys: list,
                error_msgs: list) -> None:
    for key in [k for k in state_dict if k.startswith(prefix)
                and not k.startswith(prefix + WRAPPED)]:
        state_dict[prefix + WRAPPED + key[len(prefix):]] = state_dict.pop(key)
