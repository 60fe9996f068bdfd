"""Hugging Face accelerate with shardwise's DistributedDataParallel.

accelerate's ``prepare()`` wraps every trainable model in torch's DDP when it runs on several
processes, whatever the model already is. ``prepare(accelerator, *objs)`` here wraps each model
with ``shardwise.DistributedDataParallel`` instead (after accelerate's device placement and
mixed-precision forward, as accelerate orders them) and hands everything to
``accelerator.prepare``, which then passes our wrapper through as already prepared and prepares
the optimizers, data loaders and schedulers as usual. Our wrapper is a torch DDP to
``isinstance`` (ddp/torch_ddp.py), so ``accelerator.unwrap_model``, ``get_state_dict``,
``no_sync`` and ``accumulate`` treat it as they treat torch's.

``use_shardwise_ddp(accelerator)`` makes every later ``accelerator.prepare``/``prepare_model``
call on that accelerator wrap with ours: the form a framework that calls ``prepare`` itself
(the transformers Trainer, transformers.py) needs.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

import shardwise
from shardwise.integrations._require import framework

_accelerate = framework("accelerate", "accelerate", "accelerate")
_utils = framework("accelerate.utils", "accelerate", "accelerate")


def _replicates(accelerator: Any) -> bool:
    """Whether accelerate would wrap a model in torch's DDP: several processes, plain data
    parallelism (no FSDP, DeepSpeed, XLA or tensor parallelism)."""
    kind = accelerator.distributed_type
    plain = accelerator.multi_device or kind == _utils.DistributedType.MULTI_CPU
    tp = accelerator.parallelism_config is not None and accelerator.parallelism_config.tp_enabled
    return plain and not tp


def prepare_model(accelerator: Any, model: nn.Module, device_placement: bool | None = None,
                  evaluation_mode: bool = False, **ddp_kwargs: Any) -> nn.Module:
    """``accelerator.prepare_model`` with ``shardwise.DistributedDataParallel`` in place of
    torch's. The wrapper's constructor broadcasts rank 0's parameters and buffers (one
    coalesced broadcast per dtype) so every replica starts equal; ``ddp_kwargs`` (and the
    accelerator's ``DistributedDataParallelKwargs``, if given) go to it."""
    if isinstance(model, shardwise.DistributedDataParallel):
        raise ValueError("the model is already wrapped in shardwise.DistributedDataParallel; "
                         "pass the bare module")
    plain = type(accelerator).prepare_model
    wrap = (not evaluation_mode and _replicates(accelerator)
            and not getattr(model, "_is_accelerate_prepared", False)
            and any(p.requires_grad for p in model.parameters()))
    if not wrap:
        return plain(accelerator, model, device_placement=device_placement,
                     evaluation_mode=evaluation_mode)
    bare = plain(accelerator, model, device_placement=device_placement, evaluation_mode=True)
    handler = accelerator.ddp_handler
    kwargs = {**(handler.to_kwargs() if handler is not None else {}), **ddp_kwargs}
    wrapped = shardwise.DistributedDataParallel(bare, **kwargs)
    if handler is not None:
        handler.register_comm_hook(wrapped)
    models = accelerator._models  # accelerate's list for save_state/load_state: the wrapper
    accelerator._models = [wrapped if m is bare else m for m in models]
    wrapped._is_accelerate_prepared = True  # accelerate's mark: prepare() passes it through
    return wrapped


def prepare(accelerator: Any, *objs: Any, device_placement: list[bool] | None = None,
            **ddp_kwargs: Any) -> Any:
    """``accelerator.prepare(*objs)`` with models wrapped by ``shardwise.DistributedDataParallel``
    (see ``prepare_model``); returns the prepared objects in order, as accelerate does."""
    places = device_placement or [None] * len(objs)
    if len(places) != len(objs):
        raise ValueError(f"device_placement has {len(places)} entries for {len(objs)} objects")
    objs = tuple(prepare_model(accelerator, o, device_placement=p, **ddp_kwargs)
                 if isinstance(o, nn.Module) else o for o, p in zip(objs, places))
    return accelerator.prepare(*objs, device_placement=device_placement)


def use_shardwise_ddp(accelerator: Any, **ddp_kwargs: Any) -> Any:
    """Make ``accelerator``'s own ``prepare``/``prepare_model`` wrap models with ours from now
    on (an attribute on this accelerator object only); returns the accelerator."""
    if not isinstance(accelerator, _accelerate.Accelerator):
        raise TypeError(f"use_shardwise_ddp takes an accelerate.Accelerator, got "
                        f"{type(accelerator).__name__}")
    accelerator.prepare_model = functools.partial(prepare_model, accelerator, **ddp_kwargs)
    return accelerator
