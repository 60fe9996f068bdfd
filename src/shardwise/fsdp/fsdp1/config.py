"""torch FSDP1's enums and configuration classes, under torch's names, and readers that accept
torch's own objects as well as ours (users import them from ``torch.distributed.fsdp``).

``StateDictType`` picks what ``FullyShardedDataParallel.state_dict()`` and
``FullyShardedDataParallel.optim_state_dict()`` return (see fsdp1/state_dict.py and
optim_state_dict.py): FULL (whole tensors, gathered), SHARDED (``Shard(0)`` DTensors, no
collective) or LOCAL (each unit's flat shard as one DTensor).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import Any


class ShardingStrategy(Enum):
    FULL_SHARD = auto()
    SHARD_GRAD_OP = auto()
    NO_SHARD = auto()
    HYBRID_SHARD = auto()
    _HYBRID_SHARD_ZERO2 = auto()


class BackwardPrefetch(Enum):
    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()


class StateDictType(Enum):
    FULL_STATE_DICT = auto()
    LOCAL_STATE_DICT = auto()
    SHARDED_STATE_DICT = auto()


class OptimStateKeyType(Enum):
    PARAM_NAME = auto()
    PARAM_ID = auto()


@dataclass
class StateDictConfig:
    """``offload_to_cpu``: state dict tensors are moved to CPU memory."""

    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    """``rank0_only``: only rank 0 returns the (gathered) state dict, other ranks an empty one."""

    rank0_only: bool = False


@dataclass
class LocalStateDictConfig(StateDictConfig):
    pass


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    """Values are DTensors whatever ``_use_dtensor`` says (torch's default is ShardedTensor)."""

    _use_dtensor: bool = False


@dataclass
class OptimStateDictConfig:
    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    rank0_only: bool = False


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    offload_to_cpu: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    _use_dtensor: bool = False


@dataclass
class StateDictSettings:
    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


_CONFIGS = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
}


def as_enum(value: Any, enum: type[Enum], what: str) -> Enum:
    """Our member of ``enum`` for ``value`` (ours, torch's member of the same name, or a
    name)."""
    name = getattr(value, "name", value)
    if isinstance(name, str) and name.upper() in enum.__members__:
        return enum[name.upper()]
    raise ValueError(f"{what} must be one of {list(enum.__members__)}, got {value!r}")


def as_settings(state_dict_type: Any, state_dict_config: Any = None,
                optim_state_dict_config: Any = None) -> StateDictSettings:
    """Validated settings: torch's or our enum and configs, missing configs defaulted. A config
    of the wrong kind (e.g. ``ShardedStateDictConfig`` with FULL_STATE_DICT) is a TypeError."""
    kind = as_enum(state_dict_type, StateDictType, "state_dict_type")
    model_cls, optim_cls = _CONFIGS[kind]
    return StateDictSettings(kind, _as_config(state_dict_config, model_cls),
                             _as_config(optim_state_dict_config, optim_cls))


def _as_config(config: Any, cls: type) -> Any:
    if config is None:
        return cls()
    if type(config).__name__ != cls.__name__:
        raise TypeError(f"expected a {cls.__name__} for this state_dict_type, got "
                        f"{type(config).__name__}")
    if isinstance(config, cls):
        return config
    fields = {f: getattr(config, f) for f in cls.__dataclass_fields__ if hasattr(config, f)}
    return cls(**fields)
