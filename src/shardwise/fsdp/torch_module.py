"""Our ``FSDPModule`` as a subclass of torch's ``torch.distributed.fsdp.FSDPModule``.

Third-party code (trainers, torchtitan's utilities, accelerate-style wrappers) tests
``isinstance(m, torch.distributed.fsdp.FSDPModule)`` before calling FSDP2 methods. torch's class
is a plain class (no ``register``), so ours derives from it. Methods defined by ours (module.py)
come first in the MRO; every other public method of torch's class would run torch's
implementation on a module that has none of its state, so ``TorchFSDPModuleBase`` overrides each
of them with an error that names the call, why it cannot work here, and what to use instead
(or accepts it where it asks for what our units already do).
"""

from __future__ import annotations

from typing import Any

from shardwise._compat import TorchFSDPModule as _TorchFSDPModule
from shardwise.dp.refused import refused_method

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
                                  "to unit (fsdp/buffer_pool.py); leave it out",
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
        # ours (module.py) calls super()._apply: skip torch's, which reads torch's FSDP state
        return super(_TorchFSDPModule, self)._apply(*args, **kwargs)


for _name, _why in _REFUSED.items():
    setattr(TorchFSDPModuleBase, _name, _refusal(_name, _why))
