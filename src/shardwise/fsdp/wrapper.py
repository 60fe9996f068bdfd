"""``FullyShardedDataParallel``: the wrapper-style API (like torch's FSDP), built on fully_shard.

The wrapper holds the module as ``_fsdp_wrapped_module`` and shards it in place (with its
auto-wrap policy's submodules as nested units). Names seen through the wrapper, by
``named_parameters()``, ``state_dict()`` and ``load_state_dict()``, are the unwrapped module's
(the wrapper's segment is removed, as torch does), so state dicts move between the wrapped and
the plain model unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.distributed.collectives import broadcast_coalesced
from shardwise.fsdp.clip_grad import clip_grad_norm_
from shardwise.fsdp.fully_shard import fully_shard
from shardwise.fsdp.mixed_precision import CPUOffload, MixedPrecision
from shardwise.fsdp.policies import WrapPolicy
from shardwise.fsdp.state_dict import WRAPPED, check_keys, clean_name, replace_with_full
from shardwise.fsdp.sync import no_sync


class FullyShardedDataParallel(nn.Module):
    """Fully sharded data parallelism over ``process_group`` (default: the world group).

    ``auto_wrap_policy`` picks the submodules that become units of their own (e.g.
    ``ModuleWrapPolicy({Block})``); the module itself is the root unit and owns the rest.
    ``sharding_strategy`` accepts torch's ``ShardingStrategy`` FULL_SHARD (default) and
    SHARD_GRAD_OP (same as ``reshard_after_forward=False``). ``sync_module_states=True``
    broadcasts rank 0's parameters and buffers before sharding. Parameters are always exposed
    under their original names (torch's ``use_orig_params=True``).
    """

    def __init__(self, module: nn.Module, process_group: dist.ProcessGroup | None = None,
                 sharding_strategy: Any = None, cpu_offload: CPUOffload | None = None,
                 auto_wrap_policy: WrapPolicy | None = None,
                 mixed_precision: MixedPrecision | None = None,
                 reshard_after_forward: bool = True, sync_module_states: bool = False,
                 device_id: int | torch.device | None = None, use_orig_params: bool = True,
                 forward_prefetch: bool = False, **ignored: Any):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FullyShardedDataParallel wraps an nn.Module, got "
                            f"{type(module).__name__}")
        group = process_group or dist.group.WORLD
        reshard_after_forward = _strategy(sharding_strategy, reshard_after_forward)
        if device_id is not None:
            module = module.to(torch.device("cuda", device_id) if isinstance(device_id, int)
                               else device_id)
        if sync_module_states:
            broadcast_coalesced([p.detach() for p in module.parameters()]
                                + list(module.buffers()), 0, group)
        fully_shard(module, process_group=group, reshard_after_forward=reshard_after_forward,
                    mixed_precision=mixed_precision, cpu_offload=cpu_offload,
                    auto_wrap_policy=auto_wrap_policy, forward_prefetch=forward_prefetch)
        self._fsdp_wrapped_module = module
        self.process_group = group
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_state_dict_post_hook(_gather_full)
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
        """Load a full state dict (original names); with ``strict`` a mismatch of keys raises
        KeyError naming every missing and unexpected key."""
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


def _strategy(strategy: Any, reshard_after_forward: bool) -> bool:
    if strategy is None:
        return reshard_after_forward
    name = getattr(strategy, "name", str(strategy)).upper()
    if name == "FULL_SHARD":
        return True
    if name == "SHARD_GRAD_OP":
        return False
    raise NotImplementedError(f"sharding_strategy {name} is not supported; use FULL_SHARD or "
                              "SHARD_GRAD_OP (or DistributedDataParallel for NO_SHARD)")


def _strip_prefix(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + WRAPPED)]:
        state_dict[prefix + key[len(prefix + WRAPPED):]] = state_dict.pop(key)


def _gather_full(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """FSDP1's default ``FULL_STATE_DICT``: whole tensors under the original names."""
    replace_with_full(module._fsdp_wrapped_module, state_dict, prefix)


def _add_prefix(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any,
                strict: bool, missing_keys: list, unexpected_keys: list,
                error_msgs: list) -> None:
    for key in [k for k in state_dict if k.startswith(prefix)
                and not k.startswith(prefix + WRAPPED)]:
        state_dict[prefix + WRAPPED + key[len(prefix):]] = state_dict.pop(key)
