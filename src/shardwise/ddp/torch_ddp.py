"""Our ``DistributedDataParallel`` as a subclass of ``torch.nn.parallel.DistributedDataParallel``.

Training frameworks (Lightning's Trainer and Fabric, accelerate, the transformers Trainer) test
``isinstance(model, torch.nn.parallel.DistributedDataParallel)`` to unwrap a model, to enter
``no_sync()`` or to read ``module``. So ours derives from torch's class, without running its
``__init__`` (ours builds its own state, data_parallel.py). Methods defined by ours come first in
the MRO; every other method of torch's class would run torch's implementation on an object that
has none of torch's state (its C++ reducer, logger, stream and buffer bookkeeping), so
``TorchDDPBase`` overrides each with an error that names the call and what to use instead, and
reading one of torch's instance attributes that ours does not have raises
``TorchOnlyAttribute`` (an ``AttributeError``, so ``hasattr``/``getattr(..., default)`` still
answer "absent", and a ``NotImplementedError``) with the same kind of message.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from shardwise.dp.refused import refused_method

_INTERNAL = ("it drives torch's C++ reducer, which a shardwise.DistributedDataParallel does "
             "not have (its buckets live in shardwise.dp.grad_buckets)")
_FORWARD = ("shardwise's forward() does what torch's forward steps do; call the wrapper "
            "itself, model(inputs)")
_JOIN = "uneven inputs are handled by join() (shardwise.ddp.join), which runs its own checks"
_BUFFERS = ("buffers are broadcast from rank 0 at each forward while broadcast_buffers=True "
            "(shardwise.dp.data_parallel.buffers_to_sync)")
_HOOK = ("register a communication hook with register_comm_hook(state, hook); torch's "
         "built-in and our shardwise.ddp.hooks both fit")
_DEVICES = "shardwise's DDP is single-device per process; move inputs to the device yourself"

# torch DistributedDataParallel method -> (why it cannot work on ours, and what instead)
_REFUSED: dict[str, str] = {
    "_register_accum_grad_hook": "it registers torch's compiled-autograd hooks; " + _INTERNAL,
    "_delayed_all_reduce_hook": _INTERNAL,
    "_register_delay_all_reduce_hook": _INTERNAL,
    "_setup_in_backward_optimizers": "optimizers that step inside backward are not supported; "
                                     "step the optimizer after backward",
    "_fire_reducer_autograd_hook": _INTERNAL,
    "_root_copy_hook": "mixed-precision parameter copies are not supported by shardwise's DDP",
    "_module_wait_for_copy_hook": "mixed-precision parameter copies are not supported by "
                                  "shardwise's DDP",
    "_log_and_throw": "shardwise raises its errors directly; there is no DDP logger",
    "_ddp_init_helper": "the constructor builds everything; " + _INTERNAL,
    "_build_params_for_reducer": _INTERNAL,
    "_assign_modules_buffers": _BUFFERS,
    "_build_debug_param_to_name_mapping": "errors already name parameters by their names",
    "_get_parameters": "use model.parameters() or model.module.parameters()",
    "_check_default_group": "shardwise's DDP pickles with its process group left as is",
    "_inside_ddp_forward": _FORWARD,
    "_run_ddp_forward": _FORWARD,
    "_clear_grad_buffer": _INTERNAL,
    "_lazy_init": "shardwise's DDP initialises everything in its constructor",
    "_pre_forward": _FORWARD,
    "_post_forward": _FORWARD,
    "scatter": _DEVICES,
    "to_kwargs": _DEVICES,
    "gather": _DEVICES,
    "_check_global_requires_backward_grad_sync": _JOIN,
    "_check_and_sync_module_buffers": _JOIN,
    "_sync_final_model": _JOIN,
    "_match_all_reduce_for_bwd_pass": _JOIN,
    "_match_unused_params_allreduce": _JOIN,
    "_register_buffer_comm_hook": "buffer communication hooks are not supported; " + _BUFFERS,
    "_register_builtin_comm_hook": _HOOK,
    "_register_fused_optim": "fused optimizers inside backward are not supported; step the "
                             "optimizer after backward",
    "_distributed_broadcast_coalesced": _BUFFERS,
    "_check_sync_bufs_post_fwd": _BUFFERS,
    "_check_sync_bufs_pre_fwd": _BUFFERS,
    "_find_common_rank": _JOIN,
    "_sync_buffers": _BUFFERS,
    "_sync_module_buffers": _BUFFERS,
    "_default_broadcast_coalesced": _BUFFERS,
    "_passing_sync_batchnorm_handle": "SyncBatchNorm under shardwise's DDP is not supported",
    "_check_comm_hook": _HOOK,
    "_set_ddp_runtime_logging_sample_rate": "shardwise's DDP keeps no runtime logging samples",
    "_remove_autograd_hooks": _INTERNAL,
    "_check_reducer_finalized": _INTERNAL,
    "_set_sparse_metadata": "sparse gradients are not supported by shardwise's DDP",
    "_update_process_group": "the process group is fixed at construction; build a new wrapper "
                             "for another group",
    "_set_ddp_sink_clone": _INTERNAL,
}

# torch's instance attributes (set by its __init__) that ours does not have -> what instead
_TORCH_ATTRIBUTES: dict[str, str] = {
    "logger": "shardwise's DDP has no C++ logger; _get_ddp_logging_data() returns its settings",
    "forward_sync_buffers": "read broadcast_buffers",
    "bucket_bytes_cap": "bucket sizes are set by bucket_cap_mb at construction",
    "mixed_precision": "mixed-precision parameter copies are not supported by shardwise's DDP",
    "device_type": "read model.device.type",
    "parameters_to_ignore": "ignoring parameters is not supported by shardwise's DDP",
    "use_side_stream_for_tensor_copies": _DEVICES,
    "modules_buffers": _BUFFERS,
    "named_module_buffers": _BUFFERS,
    "_module_copies": _DEVICES,
    "_delay_all_reduce_all_params": _INTERNAL,
    "_use_python_reducer": _INTERNAL,
    "_ddp_sink_clone": _INTERNAL,
    "_accum_grad_hooks": _INTERNAL,
    "_mp_stream": "mixed-precision parameter copies are not supported by shardwise's DDP",
}


class TorchOnlyAttribute(AttributeError, NotImplementedError):
    """An attribute of torch's DistributedDataParallel that shardwise's does not have."""


def _refusal(name: str, why: str):
    return refused_method(name, "torch's DistributedDataParallel",
                          "shardwise.DistributedDataParallel", why)


class TorchDDPBase(_TorchDDP):
    """torch's ``DistributedDataParallel`` with each part that ours does not implement refused.

    Its ``__init__`` is never run: the subclass calls ``nn.Module.__init__`` and
    ``Joinable.__init__`` itself."""

    # torch's class makes broadcast_buffers a property over forward_sync_buffers; ours is a
    # plain instance attribute, so the class-level name here shadows torch's property
    broadcast_buffers: bool = True

    # pickling as nn.Module does (torch's drops and rebuilds its C++ reducer and logger)
    __getstate__ = object.__getstate__
    __setstate__ = nn.Module.__setstate__

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # nn.Module's: parameters, buffers, submodules
        except AttributeError:
            why = _TORCH_ATTRIBUTES.get(name)
            if why is None:
                raise
        raise TorchOnlyAttribute(
            f"{type(self).__name__}.{name} is an attribute of torch's DistributedDataParallel "
            f"that shardwise.DistributedDataParallel does not have: {why}", name=name, obj=self)


for _name, _why in _REFUSED.items():
    setattr(TorchDDPBase, _name, _refusal(_name, _why))


def refused_methods() -> list[str]:
    """The names of torch's DDP methods that shardwise's refuses (for tests and docs)."""
    return sorted(_REFUSED)


def torch_only_attributes() -> list[str]:
    """torch's DDP instance attributes that shardwise's does not have."""
    return sorted(_TORCH_ATTRIBUTES)
