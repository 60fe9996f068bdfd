"""One training step's structure on one simulated rank, for each strategy.

The model is built on the meta device and materialised under ``FakeTensorMode``; the strategy's
own library code wraps it (``DistributedDataParallel``, ``ZeroRedundancyOptimizer`` with DDP or
``ZeroDataParallel``, ``fully_shard`` per transformer layer and on the root over a 1D mesh, a
(dp, tp) mesh after ``shard_module`` or a (replicate, shard) mesh); then one step runs: forward,
backward, optimizer step. The first step runs uncounted: it learns the schedule (FSDP records
the order of its units' forwards and from then on keeps the last one gathered into backward;
optimizer state is made lazily). The second step is counted: the bytes this rank sends per
collective kind, its collectives, and the peak of FSDP's gathered buffers (wrapping's own
collectives, such as DDP's initial broadcast, are not part of a step). What the rank holds
afterwards (parameters, gradients, optimizer state) comes from
``shardwise.memory.state_bytes``, the library's byte accounting. See
[Note: simulated ranks] (fake_group.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardwise.memory.accounting import StateBytes, state_bytes
from shardwise.sim.counting import SimCounter
from shardwise.sim.fake_group import SimulationError, fake_tensors, fake_world
from shardwise.sim.models import blocks_of, sequence_length
from shardwise.sim.optim import MasterWeightAdamW

SIM_STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "hsdp")
ZERO_PARTITIONS = ("parameters", "elements")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "mixed": torch.bfloat16}


@dataclass(frozen=True)
class DryRun:
    """What to simulate: ``strategy`` on rank ``rank`` of ``world_size`` ranks; ``replicas``
    (hsdp) and ``tp`` (fsdp x tp) shape the mesh; ``zero_partition`` is zero1's and zero2's
    ``ZeroRedundancyOptimizer(partition=...)``: whole parameters or element ranges."""

    strategy: str
    world_size: int
    rank: int = 0
    replicas: int = 1
    tp: int = 1
    precision: str = "fp32"
    local_world_size: int | None = None
    batch: int = 1
    zero_partition: str = "parameters"
    # fsdp x tp: the model's tensor-parallel plan over a group (the demo GPT's is
    # cli/strategy_tp.gpt_plan, passed in by `shardwise plan`: nothing here imports the CLI)
    tp_plan: Callable[[dist.ProcessGroup], tuple[dict, list[str]]] | None = None

    def __post_init__(self) -> None:
        if self.strategy not in SIM_STRATEGIES:
            raise SimulationError(f"unknown strategy {self.strategy!r} for a dry run; known: "
                                  f"{', '.join(SIM_STRATEGIES)}")
        if self.zero_partition not in ZERO_PARTITIONS:
            raise SimulationError(f"unknown ZeRO partition {self.zero_partition!r}; known: "
                                  f"{', '.join(ZERO_PARTITIONS)}")
        if self.precision not in DTYPES:
            raise SimulationError(f"unknown precision {self.precision!r}; known: "
                                  f"{', '.join(DTYPES)}")
        for name in ("world_size", "replicas", "tp", "batch"):
            if getattr(self, name) < 1:
                raise SimulationError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.tp > 1 and self.tp_plan is None:
            raise SimulationError(f"--tp {self.tp} needs the model's tensor-parallel plan")
        if self.tp > 1 and self.strategy != "fsdp":
            raise SimulationError(f"--tp {self.tp} is simulated with --strategy fsdp (a "
                                  f"(dp, tp) mesh), not with {self.strategy}")
        if self.world_size % (self.replicas * self.tp):
            raise SimulationError(
                f"the mesh cannot factor the world size: {self.world_size} ranks are not "
                f"divisible by replicas ({self.replicas}) x tp ({self.tp})")


@dataclass
class StepResult:
    """One simulated rank after one counted step."""

    state: StateBytes
    peak_gathered: int
    sent_bytes: dict[str, int]
    collectives: int
    counter: SimCounter = field(repr=False)
    extra: dict = field(default_factory=dict)
    # operators dispatched on fake tensors while wrapping and stepping: the dry run's work
    operators: int = 0


@dataclass
class _Wrapped:
    model: nn.Module  # what forward is called on
    params: nn.Module  # whose parameters are counted
    optimizer: torch.optim.Optimizer
    gathered: Callable[[], int] = lambda: 0


def simulate_step(build: Callable[[], nn.Module], run: DryRun,
                  after: Callable[[_Wrapped], dict] | None = None) -> StepResult:
    """Set up the fake world, wrap the model built by ``build`` (meta device) with ``run``'s
    strategy and run a first training step, then a second one, counted; ``after`` (optional) runs on
    the wrapped model inside the fake world, after the fake mode (the checkpoint planner: torch
    computes a DTensor's box with small real tensors), and its dict is kept."""
    with fake_world(run.world_size, run.rank) as world:
        meshes = _meshes(run, world)  # real tensors: made before the fake mode starts
        model = build().to(DTYPES[run.precision])  # on the meta device
        with fake_tensors() as mode:
            model.to_empty(device="cpu")
            wrapped = WRAPPERS[run.strategy](model, run, world, meshes)
            ids = torch.zeros((run.batch, min(sequence_length(model), 16)), dtype=torch.long)
            _step(wrapped, ids)  # uncounted: the first step learns the schedule
            counter = SimCounter(local_world_size=run.local_world_size or run.world_size,
                                 gathered=wrapped.gathered)
            with counter:
                _step(wrapped, ids)
            state = state_bytes(wrapped.params, wrapped.optimizer)
        extra = after(wrapped) if after is not None else {}  # outside the mode: see its doc
    return StepResult(state, counter.peak_gathered, counter.sent_by_kind(), counter.calls(),
                      counter, extra, mode.operators)


def _step(w: _Wrapped, ids: torch.Tensor) -> None:
    w.optimizer.zero_grad(set_to_none=True)
    out = w.model(ids)
    out = out[0] if isinstance(out, tuple) else out
    out.float().mean().backward()
    w.optimizer.step()


def _optimizer_class(run: DryRun) -> type[torch.optim.Optimizer]:
    return MasterWeightAdamW if run.precision == "mixed" else torch.optim.AdamW


def _meshes(run: DryRun, world: dist.ProcessGroup) -> dict[str, DeviceMesh]:
    from shardwise.distributed.mesh import init_device_mesh
    from shardwise.distributed.topology import HSDP_DIM_NAMES, TP_DIM_NAMES

    n = run.world_size
    if run.strategy == "hsdp":
        return {"mesh": init_device_mesh("cpu", (run.replicas, n // run.replicas),
                                         mesh_dim_names=HSDP_DIM_NAMES)}
    if run.strategy == "fsdp" and run.tp > 1:
        mesh = init_device_mesh("cpu", (n // run.tp, run.tp), mesh_dim_names=TP_DIM_NAMES)
        _tp_meshes_before_fake(mesh)
        return {"mesh": mesh}
    if run.strategy == "fsdp":
        return {"mesh": DeviceMesh.from_group(world, "cpu")}
    return {}


def _tp_meshes_before_fake(mesh: DeviceMesh) -> None:
    """fully_shard makes (and caches, in fsdp/tp_params.py) a 1D mesh over shard_module's group
    and the (dp, tp) mesh the first time it meets a tensor-parallel parameter. A DeviceMesh
    reads its rank table, which under the fake mode would be a fake tensor (and the fake group's
    all-gather of the tp groups carries no values), so both are made here, before the mode
    starts, from the (dp, tp) mesh that the dry run built."""
    from shardwise.fsdp import tp_params

    dp, tp = mesh["dp"].get_group(), mesh["tp"].get_group()
    tp_params._TP_MESHES.get((tp,), lambda: DeviceMesh.from_group(tp, "cpu"))
    tp_params._MESHES.get((dp, tp), lambda: mesh)


def _ddp(model, run, world, meshes) -> _Wrapped:
    from shardwise.ddp import DistributedDataParallel

    ddp = DistributedDataParallel(model, process_group=world)
    return _Wrapped(ddp, model, _optimizer_class(run)(model.parameters()))


def _zero(model, run, world, meshes) -> _Wrapped:
    from shardwise.ddp import DistributedDataParallel
    from shardwise.zero import ZeroDataParallel, ZeroRedundancyOptimizer

    opt = ZeroRedundancyOptimizer(model.parameters(), _optimizer_class(run), process_group=world,
                                  partition=run.zero_partition)
    if run.strategy == "zero1":
        return _Wrapped(DistributedDataParallel(model, process_group=world), model, opt)
    return _Wrapped(ZeroDataParallel(model, opt), model, opt)


def _fsdp(model, run, world, meshes) -> _Wrapped:
    from shardwise.fsdp import fully_shard
    from shardwise.fsdp.unit import units_of

    mesh = meshes["mesh"]
    if run.tp > 1:
        mesh = _tensor_parallel(model, mesh, run)
    for block in blocks_of(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    handles = [u.handle for u in units_of(model) if u.handle is not None]
    return _Wrapped(model, model, _optimizer_class(run)(model.parameters()),
                    lambda: sum(h.unsharded_bytes() for h in handles))


def _tensor_parallel(model: nn.Module, mesh: DeviceMesh, run: DryRun) -> DeviceMesh:
    """The model made tensor-parallel over ``mesh["tp"]`` by ``run.tp_plan``; the mesh to shard
    over is then ``mesh["dp"]`` (see [Note: FSDP x TP], fsdp/tp_params.py)."""
    from shardwise.sharded_tensor import shard_module

    tp_group = mesh["tp"].get_group()
    plan, gathered = run.tp_plan(tp_group)
    shard_module(model, plan, gather_output=gathered, process_group=tp_group)
    return mesh["dp"]


WRAPPERS = {"ddp": _ddp, "zero1": _zero, "zero2": _zero, "fsdp": _fsdp, "hsdp": _fsdp}

__all__ = ["SIM_STRATEGIES", "DryRun", "StepResult", "simulate_step"]
