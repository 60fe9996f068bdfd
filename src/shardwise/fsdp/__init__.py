"""Fully Sharded Data Parallel (ZeRO stage 3): parameters, gradients and optimizer state sharded
across ranks; each unit's parameters gathered just for its forward and backward.

Start with [Note: flat parameters] (flat_param.py) and [Note: FSDP schedule] (root.py). The
runtime (``fully_shard``, torch FSDP2's shape) lives in this package's top level; torch FSDP1's
surface over it (``FullyShardedDataParallel``, wrap policies, ``enable_wrap`` / ``wrap``, its
state-dict types and optimizer-state functions) in ``fsdp1/``, re-exported here under torch's
names.
"""

import sys

from shardwise.fsdp.flat_param import ShardState
from shardwise.fsdp.fsdp1 import wrap  # the module; calling it wraps (fsdp1/wrap.py)
from shardwise.fsdp.fsdp1.clip_grad import clip_grad_norm_
from shardwise.fsdp.fsdp1.config import (
    BackwardPrefetch,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from shardwise.fsdp.fsdp1.policies import (
    ModuleWrapPolicy,
    SizeBasedWrapPolicy,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from shardwise.fsdp.fsdp1.wrap import enable_wrap
from shardwise.fsdp.fsdp1.wrapper import FullyShardedDataParallel
from shardwise.fsdp.fully_shard import fully_shard
from shardwise.fsdp.mixed_precision import (
    CPUOffload,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from shardwise.fsdp.module import FSDPModule, UnshardHandle, no_sync, set_requires_gradient_sync
from shardwise.fsdp.state_dict import (
    full_state_dict,
    load_full_state_dict,
    load_sharded_state_dict,
    sharded_state_dict,
)
from shardwise.fsdp.unit import units_of

# ``from shardwise.fsdp.wrap import enable_wrap, wrap``: torch's module path
# (``torch.distributed.fsdp.wrap``) with ours in place of torch's package
sys.modules[f"{__name__}.wrap"] = wrap


def unsharded_bytes(module) -> int:
    """Bytes of unsharded (gathered) parameter buffers alive right now in ``module``'s units."""
    return sum(u.handle.unsharded_bytes() for u in units_of(module) if u.handle is not None)


def unsharded_grad_bytes(module) -> int:
    """Bytes of unsharded (flat) gradients alive right now in ``module``'s units: those being
    filled during backward and those whose reduce-scatter is still in flight."""
    units = [u for u in units_of(module) if u.handle is not None]
    roots = {id(u.root_state): u.root_state for u in units if u.root_state is not None}
    return (sum(u.handle.unsharded_grad_bytes() for u in units)
            + sum(state.reduction_bytes() for state in roots.values()))


__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "CPUOffloadPolicy",
    "FSDPModule",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "MixedPrecisionPolicy",
    "ModuleWrapPolicy",
    "OffloadPolicy",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardState",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "SizeBasedWrapPolicy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "UnshardHandle",
    "always_wrap_policy",
    "clip_grad_norm_",
    "enable_wrap",
    "full_state_dict",
    "fully_shard",
    "lambda_auto_wrap_policy",
    "load_full_state_dict",
    "load_sharded_state_dict",
    "no_sync",
    "set_requires_gradient_sync",
    "sharded_state_dict",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "unsharded_bytes",
    "unsharded_grad_bytes",
    "wrap",
]
