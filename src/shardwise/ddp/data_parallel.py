"""Our DistributedDataParallel, with the constructor of torch.nn.parallel.DistributedDataParallel.

At wrap time rank 0's parameters and buffers are broadcast (one coalesced broadcast per dtype),
so every replica starts equal. During backward, gradients are averaged across ranks by
all-reduces on size-capped buckets, launched asynchronously from gradient hooks while backward is
still running (see [Note: gradient buckets] in shardwise/dp/grad_buckets.py), or by a
registered communication hook (dp/comm_hooks.py; ours in hooks.py). Inside
``no_sync()`` no collective runs and gradients accumulate locally; the first backward outside
it reduces the accumulated sum. Under distributed autograd (``shardwise.rpc.autograd``) the
gradients of the context are reduced the same way (see [Note: reduction outside autograd's
accumulation] in detached.py). ``join()`` handles uneven inputs (join.py).
"""

from __future__ import annotations

import warnings
import weakref
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable
from torch.distributed.device_mesh import DeviceMesh

from shardwise.ddp.compressed import compression_of
from shardwise.ddp.detached import DetachedReduction
from shardwise.ddp.join import DDPJoinHook, active_ranks, announce_reduction, common_rank
from shardwise.ddp.paths import (
    AllReduce,
    CompressedSharedMemory,
    DividingAllReduce,
    InlinePowerSGD,
    NoReduction,
    ReductionPath,
    SharedMemory,
    UserHook,
)
from shardwise.ddp.powersgd import BucketPowerSGD
from shardwise.ddp.static_graph import StaticGraph
from shardwise.ddp.torch_ddp import TorchDDPBase
from shardwise.ddp.unused import UnusedMap
from shardwise.distributed.collectives import broadcast_coalesced
from shardwise.dp.agree import check_same_model
from shardwise.dp.buckets import Bucket, BucketSizes, Waitable
from shardwise.dp.comm_hooks import CommHook, CommHookSlot
from shardwise.dp.data_parallel import buffers_to_sync, resolve_group, sync_module_state
from shardwise.dp.grad_buckets import GradBucketer
from shardwise.dp.shm_reduce import ShmReducer, usable

SECOND_GRAD_HINT = (" If every backward pass uses the parameters the same way, construct "
                    "DistributedDataParallel with static_graph=True (or call "
                    "_set_static_graph() before training).")


class DistributedDataParallel(TorchDDPBase):
    """Data parallelism over ``process_group`` (default: the world group).

    Arguments keep torch's names. ``bucket_cap_mb`` caps each gradient bucket (default 25 MiB;
    the first bucket is capped at 1 MiB so that communication starts early).
    ``find_unused_parameters=True`` lets parameters go without a gradient in a step: one that
    some rank used gets the average (zeros from the others), one that no rank used keeps its
    ``.grad`` untouched (``None`` stays ``None``), as in torch; without it such a parameter is
    an error that names it. ``gradient_as_bucket_view=True`` makes ``param.grad`` a view into the
    reduced bucket instead of a copy. ``static_graph=True`` (or ``_set_static_graph()``) declares
    that every backward uses the same parameters the same number of times: unused parameters are
    then allowed, and a parameter whose gradient arrives several times in one backward
    (reentrant checkpointing) is reduced once complete. ``check_reduction`` is accepted for
    torch's signature (torch ignores it too).

    The class derives from ``torch.nn.parallel.DistributedDataParallel`` (through
    ``TorchDDPBase``, torch_ddp.py) so that frameworks' ``isinstance`` checks hold; torch's
    constructor never runs, and torch's methods that this class does not implement raise
    ``NotImplementedError`` naming what to use instead.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        device_mesh: DeviceMesh | None = None,
    ):
        nn.Module.__init__(self)  # not torch DDP's __init__: see torch_ddp.py
        Joinable.__init__(self)
        process_group = resolve_group(process_group, device_mesh, "DistributedDataParallel")
        _check_module(module, device_ids)
        check_same_model(module, process_group, what="DistributedDataParallel")
        self.module = module
        self.device_ids = device_ids
        self.output_device = output_device
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.process_group = process_group or dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.device = next(module.parameters()).device
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = False
        self._comm_hooks = CommHookSlot("DistributedDataParallel")
        self._divide_by_initial_world_size = True
        self._join_work: dist.Work | None = None  # Join's notification, to count active ranks
        self._join_divisor: int | None = None
        self._sync_buffers_next = True  # torch's require_forward_param_sync
        if init_sync:
            sync_module_state(module, self.process_group)
        self._bucket_sizes = BucketSizes.default(bucket_cap_mb)
        self.reducer = GradBucketer(
            list(module.named_parameters()), self._bucket_sizes, self._launch, self._finish,
            allow_unused=find_unused_parameters, wrapper="DistributedDataParallel",
            second_grad_hint=SECOND_GRAD_HINT,
        )
        self._unused = UnusedMap(self.process_group, find_unused_parameters)
        self.reducer.add_policy(self._unused)
        self._detached = DetachedReduction(self.reducer, self._unused)
        weakref.finalize(self, self._detached.close)
        self._shm = self._shared_memory_buckets()
        self._compressed: torch.dtype | None = None  # a compression hook run on self._shm
        self._powersgd: BucketPowerSGD | None = None  # our powerSGD_hook, run on the buckets
        self._powersgd_step = False  # the coming backward runs it ([Note: PowerSGD inside DDP])
        self._hook_buckets = False  # replanned for a communication hook
        self._joining = False  # the last forward ran inside an enabled join context
        self._choose_path(False)
        if static_graph:
            self._set_static_graph()

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self.reducer.end_abandoned_backward()  # the last backward may have raised
        will_reduce = torch.is_grad_enabled() and self.reducer.enabled
        joining = self._join_config.enable
        work = Join.notify_join_context(self)  # an all-reduce only inside a join context
        self._join_work = work if work is not None and not self._divide_by_initial_world_size \
            else None
        self._join_divisor = None
        if self._will_sync_buffers():
            src = common_rank(self.process_group, True, self.device) if joining else 0
            self._broadcast_buffers(src)
        if joining:
            announce_reduction(self.process_group, will_reduce, self.device)
        self._sync_buffers_next = will_reduce
        if joining != self._joining:
            self._choose_path(joining)
        if self._powersgd is not None:
            self._prepare_powersgd(will_reduce and not joining)
        if self.device_ids:
            device = torch.device("cuda", _index(self.device_ids[0]))
            inputs, kwargs = _to_device(inputs, device), _to_device(kwargs, device)
        return self.module(*inputs, **kwargs)

    def no_sync(self) -> AbstractContextManager[None]:
        """Skip gradient reduction inside the block; gradients accumulate locally."""
        return self.reducer.paused()

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch's flag behind ``no_sync()``: whether the next backward reduces gradients."""
        return self.reducer.enabled

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.reducer.enabled = bool(value)

    @property
    def require_forward_param_sync(self) -> bool:
        """torch's flag: whether the next forward broadcasts buffers (the last forward ran
        with gradients to reduce)."""
        return self._sync_buffers_next

    @require_forward_param_sync.setter
    def require_forward_param_sync(self, value: bool) -> None:
        self._sync_buffers_next = bool(value)

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts the module's buffers from rank 0."""
        return self._will_sync_buffers()

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """The settings torch's DDP logs under the same keys (frameworks read it to give
        hints); torch's runtime statistics are not collected, so their keys are absent."""
        params = list(self.module.parameters())
        return {
            "module_name": type(self.module).__name__,
            "world_size": self.world_size,
            "rank": dist.get_rank(self.process_group),
            "backend_name": str(dist.get_backend(self.process_group)),
            "broadcast_buffers": int(self.broadcast_buffers),
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "static_graph": int(self.static_graph),
            "num_parameter_tensors": len(params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
        }

    # ------------------------------------------------------------------ torch's extras
    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Reduce every bucket with ``hook(state, bucket)`` instead of the built-in averaging
        all-reduce (torch's contract; see dp/comm_hooks.py; torch's hooks and ours in
        ``shardwise.ddp.hooks`` both fit). Only one hook may be registered."""
        self._comm_hooks.register(state, hook)
        self._compressed = compression_of(hook, state, self.process_group)
        self._powersgd = BucketPowerSGD.of(hook, state, self.process_group)
        if not self._compressing():  # else the hook's arithmetic on the shared-memory path
            self._use_hook_buckets()  # ([Note: compression on one host] in compressed.py)
        self._choose_path(self._joining)

    def _compressing(self) -> bool:
        """A compression hook computed on the shared-memory buckets ([Note: compression on
        one host])."""
        return self._compressed is not None and self._shm is not None

    def _use_hook_buckets(self) -> None:
        """torch's bucket sizes for a hook, which pays per bucket (see BucketSizes.for_hooks);
        its collectives are its own, so the shared-memory buckets are not used. Once only, and
        not after the first backward (then the buckets in use stay as they are)."""
        if not self._hook_buckets and not self.reducer.reductions:
            self.reducer.replan(self._bucket_sizes.for_hooks())
            self._hook_buckets = True
        if self._shm is not None:
            self._shm.close()
            self._shm = None
            self._choose_path(self._joining)

    def _set_static_graph(self) -> None:
        """Declare the graph static (see the class docstring); before the first backward."""
        if self.static_graph:
            warnings.warn("static_graph is already set; no need to set it again", stacklevel=2)
            return
        if self.reducer.reductions:
            raise RuntimeError("the static graph must be set before the first backward pass "
                               "that reduces gradients, right after the wrapper is built")
        self.reducer.add_policy(StaticGraph())
        self._unused.static = True
        self.static_graph = True
        if self.find_unused_parameters:
            warnings.warn("with a static graph, unused parameters are detected in the first "
                          "iteration; find_unused_parameters=True is not needed", stacklevel=2)

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """torch's context manager for uneven inputs: ranks that run out of batches shadow
        the others' collectives until all are done (see [Note: DDP join] in join.py)."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> DDPJoinHook:
        """The hook torch's ``Join`` runs on a joined rank (``divide_by_initial_world_size``
        is read from ``kwargs``; other keywords belong to other joinables)."""
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    # ------------------------------------------------------------------ internals
    def _will_sync_buffers(self) -> bool:
        return (self._sync_buffers_next and self.broadcast_buffers and self.world_size > 1
                and bool(buffers_to_sync(self.module)))

    def _broadcast_buffers(self, src: int) -> None:
        broadcast_coalesced(buffers_to_sync(self.module), src, self.process_group)

    def _broadcast_state(self, src: int) -> None:
        """Parameters (and buffers, if they are broadcast) from group rank ``src``."""
        tensors = [p.detach() for p in self.module.parameters()]
        if self.broadcast_buffers:
            tensors += buffers_to_sync(self.module)
        broadcast_coalesced(tensors, src, self.process_group)

    def _prepare_powersgd(self, enable: bool) -> None:
        """Whether the coming backward runs PowerSGD on the buckets, and so adds each bucket's
        error to the gradients on their way in ([Note: PowerSGD inside DDP])."""
        self._powersgd_step = enable
        for bucket in self.reducer.buckets:
            bucket.addend = self._powersgd.addend(bucket) if enable else None

    def _powersgd_runs(self, bucket: Bucket) -> bool:
        """Whether our powerSGD_hook's round runs inside DDP on ``bucket``: in a step that
        runs it, on the bucket itself (not a joined rank's all-zero copy, which goes to the
        hook)."""
        return self._powersgd_step and self.reducer.buckets[bucket.index] is bucket

    def _powersgd_into_grads(self) -> bool:
        """Whether the round may land the mean in ``.grad`` ([Note: PowerSGD inside DDP])."""
        return not (self.gradient_as_bucket_view or self.find_unused_parameters
                    or self.static_graph or self._detached.active)

    def _divisor(self) -> int:
        if self._join_work is not None:
            self._join_divisor, self._join_work = active_ranks(self._join_work), None
        return self._join_divisor or self.world_size

    def _shared_memory_buckets(self) -> ShmReducer | None:
        """On one host, the buckets become slots of a shared segment and the averaging
        all-reduce runs through it (see [Note: same-host shared-memory reduction])."""
        buckets = self.reducer.buckets
        layouts = [(b.numel, b.params[0].dtype) for b in buckets]
        if not usable(self.process_group, self.device, layouts):
            return None
        shm = ShmReducer(layouts, self.process_group)
        for bucket in buckets:
            bucket.adopt(shm.buffer(bucket.index))
        weakref.finalize(self, shm.close)
        return shm

    def _choose_path(self, joining: bool) -> None:
        """Pick how buckets are reduced from now on ([Note: DDP reduction paths] in paths.py);
        ``joining``: inside an enabled join context."""
        self._joining = joining
        self._path = self._path_for(joining)
        self.reducer.scale = 1.0 / self.world_size if self._path.prescaled else None

    def _path_for(self, joining: bool) -> ReductionPath:
        n_buckets = lambda: len(self.reducer.buckets)  # noqa: E731 (re-planned buckets count)
        hook = UserHook(self._comm_hooks, n_buckets) if self._comm_hooks.hook is not None \
            else None
        if self._shm is not None and not joining and (hook is None or self._compressing()):
            if self._compressed is not None:
                return CompressedSharedMemory(self._shm, self._compressed)
            return SharedMemory(self._shm)
        if hook is not None:
            if self._powersgd is not None and not joining:
                return InlinePowerSGD(self._powersgd, self._powersgd_runs,
                                      self._powersgd_into_grads, n_buckets, hook)
            return hook
        if self.world_size == 1:
            return NoReduction()
        if joining:
            return DividingAllReduce(self.process_group, self._divisor)
        return AllReduce(self.process_group)

    def _launch(self, bucket: Bucket) -> Waitable | None:
        return self._path.reduce(bucket)

    def _shadow_launch(self, bucket: Bucket) -> Waitable | None:
        """A joined rank's all-zero bucket, through the path of a join context."""
        return self._path_for(True).reduce(bucket)

    def _finish(self, bucket: Bucket) -> None:
        if getattr(bucket.work, "in_grads", False):
            return  # the mean is already in .grad ([Note: PowerSGD inside DDP])
        skip = bucket.unused  # no rank used them: .grad stays as it is (torch's rule)
        views = bucket.views  # each parameter's view of the reduced buffer
        for i, param in enumerate(bucket.params):
            if skip and i in skip:
                continue
            reduced = views[i]
            if self.gradient_as_bucket_view:
                param.grad = reduced
            elif param.grad is None:
                param.grad = reduced.clone()
            else:
                param.grad.copy_(reduced)


def _check_module(module: nn.Module, device_ids: list | None) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"DistributedDataParallel wraps an nn.Module, got {type(module).__name__}")
    kinds = {p.device.type for p in module.parameters()}
    if len(kinds) > 1:
        raise ValueError(
            "DistributedDataParallel needs all parameters on one device type, "
            f"found {sorted(kinds)}"
        )
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError("DistributedDataParallel: the module has no parameter that requires grad")
    if hasattr(module, "_ddp_params_and_buffers_to_ignore"):
        raise NotImplementedError(
            "the module has parameters marked to be ignored (torch's DistributedDataParallel."
            "_set_params_and_buffers_to_ignore_for_model); shardwise's DDP reduces every "
            "parameter: wrap only the part to replicate, or use torch's DDP")
    if device_ids is not None and len(device_ids) != 1:
        raise ValueError(f"device_ids must name exactly one device per process, got {device_ids}")


def _index(device: int | torch.device) -> int:
    return device if isinstance(device, int) else (device.index or 0)


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj
