"""``PipelineStage``: one stage's module, its place in the pipeline, and its transport.

A stage runs the forward and backward of one micro-batch at a time when its schedule says so
(schedules.py). Where the activations come from and where gradients go is the transport's
business: ``"p2p"`` (c10d send/recv over ``group``, p2p.py) or ``"rpc"`` (RPCs and distributed
autograd, rpc_transport.py). The stage also keeps the step's measurements: time busy computing
(for the bubble) and the peak bytes of saved activations (activations.py).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardwise.pipeline.activations import ActivationMeter
from shardwise.pipeline.p2p import P2PRuntime
from shardwise.pipeline.rpc_transport import RpcRuntime

TRANSPORTS = ("p2p", "rpc")


@dataclass(frozen=True)
class StepStats:
    """One step of one stage. ``idle_fraction``: 1 - busy / step time, busy being the time in
    the stage's forwards and backwards (the measured bubble). None over RPC, where a stage's
    backward runs in RPC threads, driven by the last stage's distributed backward."""

    step_s: float
    busy_s: float
    idle_fraction: float | None
    peak_activation_bytes: int | None  # None unless the stage measures activations
    n_microbatches: int
    num_stages: int

    @property
    def formula_bubble(self) -> float:
        return bubble_fraction(self.num_stages, self.n_microbatches)


def bubble_fraction(num_stages: int, n_microbatches: int) -> float:
    """The idle fraction of GPipe and 1F1B with equal stage times: (p - 1) / (m + p - 1)."""
    return (num_stages - 1) / (n_microbatches + num_stages - 1)


class PipelineStage:
    """Stage ``stage_index`` of ``num_stages``; this rank's position in ``group`` (default: the
    world group) must be ``stage_index`` modulo the group's size, and ``num_stages`` a multiple
    of that size: one stage per rank (GPipe, 1F1B), or several, stage k on rank k % size
    (``ScheduleInterleaved1F1B``, which runs a rank's stages together).

    ``submodule`` may be wrapped in ``shardwise.DistributedDataParallel`` over a data-parallel
    group: its gradients are then reduced once per step (``no_sync`` for all but the last
    backward). torch's ``input_args`` / ``output_args`` are accepted and not needed: shapes are
    sent with the first micro-batch of each step (warns once). ``name`` keeps two pipelines
    over RPC apart (default: from the group's ranks). ``measure_activations=True`` counts the
    bytes of activations saved for backward (activations.py; a Python hook per saved tensor, a
    few per cent of a small model's step, hence off by default): ``stats.peak_activation_bytes``.
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int,
                 device: torch.device | str | None = None,
                 input_args: object = None, output_args: object = None,
                 group: dist.ProcessGroup | None = None, *, transport: str = "p2p",
                 name: str | None = None, measure_activations: bool = False):
        if not isinstance(submodule, nn.Module):
            raise TypeError(f"a stage wraps an nn.Module, got {type(submodule).__name__}")
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {transport!r}; use one of {TRANSPORTS}")
        if input_args is not None or output_args is not None:
            _warn_once("PipelineStage: input_args/output_args are not needed and are ignored "
                       "(shapes are sent with each step's first micro-batch)")
        self.group = group or dist.group.WORLD
        _check_place(stage_index, num_stages, self.group)
        self.submod, self.stage_index, self.num_stages = submodule, stage_index, num_stages
        self.device = torch.device(device) if device is not None else _device_of(submodule)
        self.transport = transport
        size = dist.get_world_size(self.group)
        ranks = [dist.get_global_rank(self.group, k % size) for k in range(num_stages)]
        if transport == "p2p":
            self._p2p = P2PRuntime(self.group, stage_index, num_stages, self.device)
        else:
            self._rpc = RpcRuntime(name or "pp" + "-".join(map(str, ranks[:size])), stage_index,
                                   num_stages, ranks)
        self.meter = ActivationMeter(exclude=submodule.parameters()) if measure_activations \
            else None
        self.stats: StepStats | None = None
        self._saved: dict[int, tuple] = {}
        self._grads: dict[torch.Tensor, torch.Tensor] = {}
        self._own_params = set(submodule.parameters())

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    # ---------------------------------------------------------------- one step
    def begin_step(self, n_microbatches: int, backward: bool = True) -> None:
        """Start a step of ``n_microbatches``; ``backward=False``: forwards only (no graph is
        kept, no gradient is received, no distributed autograd context is opened)."""
        if self._saved:
            raise RuntimeError("a new step began while micro-batches of the last one were in "
                               "flight (an earlier step failed?)")
        self._n, self._busy, self._start = n_microbatches, 0.0, time.perf_counter()
        self._backward = backward
        if self.meter is not None:
            self.meter.reset_peak()
        if self.transport == "p2p":
            self._p2p.begin_step(n_microbatches)
        elif backward:
            self._set_ddp_sync(False)  # micro-batches' distributed backwards stay local

    def end_step(self) -> None:
        if self.transport == "p2p":
            self._p2p.end_step()
        else:
            self._rpc.end_step()
            if self._backward:
                self._apply_rpc_grads()
        step_s = time.perf_counter() - self._start
        idle = None if self.transport == "rpc" else 1 - self._busy / step_s
        peak = self.meter.peak_bytes if self.meter is not None else None
        self.stats = StepStats(step_s, self._busy, idle, peak, self._n, self.num_stages)

    def forward_one_chunk(self, micro: int, x: torch.Tensor | None) -> torch.Tensor:
        """Forward of micro-batch ``micro``: ``x`` on the first stage, received elsewhere."""
        cid, train = None, self._backward
        if self.transport == "rpc":
            if not self.is_first:
                cid, x = self._rpc.recv_forward(micro)
            elif train:
                cid = self._rpc.new_context()
        elif not self.is_first:
            x = self._p2p.recv_forward()
            if x.is_floating_point() and train:
                x.requires_grad_(True)
        start = time.perf_counter()
        meter = self.meter.recording() if self.meter is not None and train else \
            contextlib.nullcontext()
        with meter, contextlib.nullcontext() if train else torch.no_grad():
            out = self.submod(x)
        self._busy += time.perf_counter() - start
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"stage {self.stage_index} returned {type(out).__name__}; a stage "
                            "passes one tensor to the next")
        if not self.is_last:
            if self.transport == "p2p":
                self._p2p.send_forward(out, expect_grad=train)
            else:
                self._rpc.send_forward(micro, cid, out)
        if train:
            self._saved[micro] = (x, out, cid)
        return out

    def backward_one_chunk(self, micro: int, loss: torch.Tensor | None = None,
                           last_backward: bool = False) -> None:
        """Backward of micro-batch ``micro`` (``loss`` on the last stage)."""
        x, out, cid = self._saved.pop(micro)
        if self.transport == "rpc":
            self._rpc_backward(micro, cid, loss)
            return
        grad = None if self.is_last else self._p2p.recv_backward(out)
        root = loss if self.is_last else out
        sync = contextlib.nullcontext()
        if not last_backward and callable(getattr(self.submod, "no_sync", None)):
            sync = self.submod.no_sync()
        start = time.perf_counter()
        with sync:
            torch.autograd.backward(root, grad)
        self._busy += time.perf_counter() - start
        if not self.is_first and x.requires_grad:
            self._p2p.send_backward(x.grad)

    def _rpc_backward(self, micro: int, cid: int, loss: torch.Tensor | None) -> None:
        if self.is_last:
            grads = self._rpc.run_backward(micro, cid, loss)
        else:
            grads = self._rpc.wait_backward(micro)
        own = self._own_params
        for p, g in grads.items():
            if p in own:  # the worker's other stages' parameters are theirs to keep
                self._grads[p] = self._grads[p] + g if p in self._grads else g

    def _apply_rpc_grads(self) -> None:
        """The step's summed gradients into ``.grad`` by one local backward from the parameters,
        so that a DistributedDataParallel wrapper's hooks reduce them (once)."""
        params = [p for p in self.submod.parameters() if p in self._grads]
        grads = [self._grads[p] for p in params]
        self._grads = {}
        self._set_ddp_sync(True)
        if params:
            torch.autograd.backward(params, grads)

    def _set_ddp_sync(self, on: bool) -> None:
        """A DistributedDataParallel stage also reduces under distributed autograd: turn that
        off for the micro-batches (their gradients are summed here) and on for the one local
        backward of the step."""
        if hasattr(self.submod, "require_backward_grad_sync"):
            self.submod.require_backward_grad_sync = on


def _check_place(stage_index: int, num_stages: int, group: dist.ProcessGroup) -> None:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if num_stages < size or num_stages % size:
        raise ValueError(f"num_stages={num_stages} does not match the pipeline group, which has "
                         f"{size} ranks (one stage per rank, or a multiple of {size} stages for "
                         "an interleaved schedule)")
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index={stage_index} is outside 0..{num_stages - 1}")
    if stage_index % size != rank:
        raise ValueError(f"stage_index={stage_index} but this process is rank {rank} of the "
                         f"pipeline group; stage k runs on the group's rank k % {size}")


def _device_of(module: nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)
