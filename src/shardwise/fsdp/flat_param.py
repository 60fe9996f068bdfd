"""One unit's parameters as one flat, sharded buffer, with the original parameters as views.

[Note: flat parameters]
Each FSDP unit keeps these tensors for all of its parameters together (where each parameter's
rows sit in them is [Note: FSDP layout], layout.py):

- ``shard`` (1D, ``shard_numel`` elements, the parameters' own dtype): this rank's chunk of every
  parameter, back to back. It is the only copy that lives between steps. Every original
  parameter is replaced, under its original name, by an ``nn.Parameter`` holding a ``DTensor``
  (``Shard(0)``, global shape) whose local tensor is a view of its chunk of ``shard``, so
  ``model.parameters()`` hands an optimizer exactly the local shards, its state is sharded too,
  and torch's functions that understand DTensors work on them (see layout.py).
- ``full_data`` (1D, ``total`` elements, the compute dtype): every parameter unsharded, back to
  back. Its storage is allocated just before the all-gather and resized to zero bytes when the
  unit reshards. Tensors autograd saved during forward keep pointing at this storage, so
  re-gathering into it in backward makes them valid again without keeping the parameters alive
  in between.
- ``leaves`` (one per parameter, its original shape, the compute dtype): autograd leaves that
  alias ``full_data``'s storage at their parameter's offset, each with its own version counter
  (so that writing the all-gather's output does not look like an in-place change of saved
  tensors). While unsharded, each module attribute is its parameter's leaf (detached if the
  parameter does not require grad, so that none is computed for it). They are made once and
  live as long as the handle (or until the module is moved, see ``adopt_applied_params``);
  only the storage under them comes and goes. A parameter of torch's tensor parallelism keeps
  its TP-local tensor here, and its leaf is the TP DTensor wrapping that view (see [Note: FSDP x
  TP], tp_params.py).
- ``grad_buffer`` (1D, ``world * shard_numel`` elements, the compute dtype, held by the unit's
  reduction path, reduction.py): the unit's flat gradient in rank-major order, which the
  reduce-scatter works on directly. It is allocated when the unit's first gradient of a
  backward arrives; each leaf's post-accumulate-grad hook
  copies (or, when accumulating, adds) that leaf's gradient into its chunks and drops the
  leaf's ``.grad`` at once. So the unit's gradient costs one flat buffer plus one parameter's
  gradient in flight, never the per-parameter gradients and their concatenation together.
  Where the unit's backward ends is not decided here ([Note: where a unit's backward ends],
  unit.py): a rank may never get some gradients. Where the direct reduction
  applies (gloo, see [Note: direct gradient reduction]) the large parameters' gradients are
  sent as they arrive instead and only the packed ones take a (smaller) rank-major buffer; and
  a large parameter's rows of ``full_data`` are given back to the OS once its gradient is in
  ([Note: releasing a dead parameter's rows], unit.py).

Where the group's ranks share a host, ``full_data`` is instead one mapping of those ranks for the
unit's life, each slot's local rows are a view of it, and ``shard`` is None ([Note: parameters
shared on one host], host_params.py): nothing is gathered or freed, and ``flat_shard()`` packs a
copy in the shard's layout for whoever needs one.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardwise._compat import DTensor
from shardwise.distributed.groups import rank_table
from shardwise.distributed.host.same_host import on_one_host
from shardwise.dp.fast_collectives import Pending, uses_fast_path
from shardwise.fsdp.collectives import (
    CollectiveGather,
    HostSharedGather,
    StoragePool,
    start_unit_gather,
)
from shardwise.fsdp.host_params import HostParams, shareable
from shardwise.fsdp.layout import (
    ParamLayout,
    UnitLayout,
    local_tensor,
    plan_layout,
    set_local_tensor,
    sharded_like,
    sharded_parameter,
)
from shardwise.fsdp.reduction import (
    TAG_BASE,
    GradArrivals,
    PeerRows,
    ReducedSlots,
    Reduction,
    choose_reduction,
    peer_rows,
)
from shardwise.fsdp.tp_params import TPLayout, local_grad
from shardwise.memory.heap import release_pages
from shardwise.memory.kept_buffer import KeptBuffer


class ShardState(Enum):
    SHARDED = auto()  # only `shard` exists; `full_data` has no storage
    GATHERING = auto()  # the all-gather into `full_data` is issued, not yet waited for
    UNSHARDED = auto()  # `full_data` holds every parameter whole


@dataclass
class ParamSlot:
    """One original parameter (possibly held by several modules: tied weights)."""

    aliases: list[tuple[nn.Module, str]]  # every (module, attribute name) that holds it
    fqns: list[str]  # names relative to the unit's module that holds it, one per alias
    layout: ParamLayout
    shard_param: nn.Parameter  # DTensor, Shard(0); local: this rank's rows, a view of `shard`
    # per alias, the index of that module in the unit's modules (all 0 for a unit of one
    # module): [Note: one unit over several modules], unit.py
    homes: list[int] = field(default_factory=list)

    def names_in(self, home: int) -> list[str]:
        """The names of the aliases held under the unit's module number ``home``."""
        homes = self.homes or [0] * len(self.fqns)
        return [fqn for fqn, h in zip(self.fqns, homes, strict=True) if h == home]

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.layout.shape)

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def offset(self) -> int:
        return self.layout.full_offset

    @property
    def requires_grad(self) -> bool:
        return self.shard_param.requires_grad

    @property
    def local(self) -> torch.Tensor:
        """This rank's rows (a view of the unit's shard)."""
        return local_tensor(self.shard_param)


@dataclass
class GradReduction:
    """A reduce-scatter in flight: its result goes to the slots' gradients once waited for."""

    pending: Pending
    out: torch.Tensor  # 1D, shard_numel elements, reduce dtype
    held: list[torch.Tensor]  # what the collective sends from: kept alive until it is done

    def held_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.held)


class FlatParamHandle:
    """The flat sharded parameters of one unit; see [Note: flat parameters]."""

    def __init__(self, params: list[tuple[nn.Parameter, list[tuple[nn.Module, str, str]]]],
                 group: dist.ProcessGroup, mesh: DeviceMesh, param_dtype: torch.dtype,
                 reduce_dtype: torch.dtype, compute_device: torch.device, offload: bool,
                 direct_min_numel: float, replicate_group: dist.ProcessGroup | None = None,
                 tp: list[TPLayout | None] | None = None):
        # `group` shards; `replicate_group` (hybrid sharding only) holds the other replicas of
        # this rank's shard, across which reduced gradients are averaged
        self.group, self.mesh, self.replicate_group = group, mesh, replicate_group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.global_ranks = rank_table(group)  # a range on a mesh: O(1) per unit
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.offload = offload  # shards (and their gradients) stay in CPU memory
        self.compute_device = compute_device
        self.shard_device = torch.device("cpu") if offload else compute_device
        # each parameter's tensor-parallel layout, or None (see [Note: FSDP x TP]); the flat
        # buffers hold the local tensors of TP parameters
        self.tp = list(tp) if tp is not None else [None] * len(params)
        self.layout: UnitLayout = plan_layout([local_tensor(p).shape for p, _ in params],
                                              self.world, direct_min_numel)
        # weak references to the replaced parameters, to detect one shared with another unit
        self.orig_params = [(weakref.ref(p), holders[0][2]) for p, holders in params]
        self.shard = self._make_shard([p for p, _ in params])  # 1D, shard_numel
        self.slots = self._make_slots(params)
        self.shard_dtype = self.shard.dtype
        # the unsharded parameters in one mapping per host, or None: [Note: parameters shared
        # on one host] (host_params.py); then `shard` is None and each slot's local rows live
        # in that mapping
        self.host: HostParams | None = self._share_on_host()
        # where direct exchanges read the peers' gradient rows ([Note: gradient rows read from
        # the peers], reduction.py), else None
        self.peer_rows: PeerRows | None = self._peer_rows()
        self._make_full()
        self.tag_base = TAG_BASE  # of its direct exchanges; the root sets one per unit
        # torch FSDP2's gradient divide factor: None divides the sum over the data-parallel
        # ranks by their number (the mean every reduction path computes)
        self.divide_factor: float | None = None
        # this backward's reductions: [Note: gradients of unused parameters] (reduction.py)
        self.reduced = ReducedSlots(len(self.slots))
        # where reductions write this rank's reduced shard: [Note: a reduced-gradient buffer
        # kept across steps] (memory/kept_buffer.py)
        self.reduced_buffer = KeptBuffer()
        self.state = ShardState.SHARDED
        self.views_set = False
        self._gather: Pending | None = None
        # memory for full_data, shared by the units of one root ([Note: unshard buffer pool])
        self.storage_pool: StoragePool | None = None
        self.released_bytes = 0  # of the full buffer's pages, by release_param_rows
        # (state, hook): FSDP1's register_comm_hook; hook(state, full_grad, out) replaces the
        # reduce-scatter and must leave this rank's reduced shard in `out`
        self.comm_hook: tuple[Any, Callable[..., None]] | None = None
        # how the unit's gradients are reduced, and which arrived (reduction.py)
        self.reduction: Reduction = choose_reduction(self)
        self.use_sharded_params()

    # ---- construction -------------------------------------------------------------------
    def _make_shard(self, params: list[nn.Parameter]) -> torch.Tensor:
        shard = torch.zeros(self.layout.shard_numel, dtype=params[0].dtype,
                            device=self.shard_device)
        with torch.no_grad():
            for p, layout in zip(params, self.layout.params):
                rows = layout.local_rows(self.rank)
                start = layout.row_start(self.rank)
                whole = local_tensor(p.detach())  # a TP parameter: its local tensor
                self._local_view(shard, layout).copy_(whole[start : start + rows])
        return shard

    def _local_view(self, shard: torch.Tensor, layout: ParamLayout) -> torch.Tensor:
        n = layout.local_numel(self.rank)
        return shard[layout.shard_offset : layout.shard_offset + n].view(
            layout.local_shape(self.rank))

    def _make_slots(self, params) -> list[ParamSlot]:
        slots = []
        for (p, holders), layout in zip(params, self.layout.params):
            local = self._local_view(self.shard, layout)
            shard_param = sharded_parameter(local, layout, self.mesh, p.requires_grad)
            slots.append(ParamSlot([(m, n) for m, n, _ in holders], [f for _, _, f in holders],
                                   layout, shard_param))
        return slots

    def _share_on_host(self) -> HostParams | None:
        """Move the local rows into a mapping of the group's ranks where [Note: parameters
        shared on one host] applies (collective over the group); None where it does not."""
        shard = self.shard
        local_ok = (not self.offload and self.param_dtype == shard.dtype
                    and all(tp is None for tp in self.tp))
        if not shareable(self.group, shard.device, local_ok,
                         self.layout.total * shard.element_size()):
            return None
        host = HostParams(self.layout, [s.local for s in self.slots], self.rank, shard.dtype,
                          self.group)
        for slot, rows in zip(self.slots, host.rows):
            set_local_tensor(slot.shard_param, rows)
        self.shard = None
        return host

    def _peer_rows(self) -> PeerRows | None:
        """Collective over the group where direct exchanges may run on gloo on the CPU (every
        rank decides that alike): whether the ranks share this host and may read each other."""
        probe = torch.empty(0, device=self.compute_device)
        if (self.world < 2 or not any(True for _ in self.layout.direct())
                or not uses_fast_path(self.group, probe, "auto")):
            return None
        # shared parameters already established that every rank runs on this host
        if self.host is None and not on_one_host(self.group, self.compute_device, lambda: True):
            return None
        return peer_rows(self.group, len(self.layout.params))

    def _make_full(self) -> None:
        # how each unshard fills full_data (collectives.py): chosen with it
        self.gather_path: CollectiveGather | HostSharedGather
        if self.host is not None:  # the shared mapping, for the unit's life
            self.full_data = self.host.full
            self.gather_path = HostSharedGather()
        else:
            self.gather_path = CollectiveGather(self)
            self.full_data = torch.empty(self.layout.total, dtype=self.param_dtype,
                                         device=self.compute_device)
        storage = self.full_data.untyped_storage()
        base = self.full_data.storage_offset()
        self.leaves = []  # one per slot, its shape: views of full_data's storage
        for slot, tp in zip(self.slots, self.tp):
            leaf = torch.empty(0, dtype=self.param_dtype, device=self.compute_device)
            leaf.set_(storage, base + slot.offset, slot.shape)
            if tp is not None and tp.as_dtensor:  # torch's TP reads its DTensor again
                leaf = DTensor(leaf, tp.spec(self.param_dtype), requires_grad=True)
            self.leaves.append(leaf.requires_grad_())
        if self.host is None:
            storage.resize_(0)  # no memory until the first unshard (not into the pool)

    @property
    def requires_grad(self) -> bool:
        return any(s.requires_grad for s in self.slots)

    def live_orig_params(self) -> dict[int, str]:
        """``id -> name`` of the replaced parameters that something else still holds."""
        return {id(p): name for ref, name in self.orig_params if (p := ref()) is not None}

    def adopt_applied_params(self) -> None:
        """After ``module._apply`` (``to_empty``, ``to``, ``cuda``...) swapped new local
        tensors into the DTensor parameters, copy them into a new flat shard on their device
        and point the parameters back at views of it; remake the unsharded buffers there. The
        caller re-registers hooks on the new ``leaves``. A unit built on the meta device
        (materialized by ``to_empty``, which every rank calls) shares its parameters on the
        host where it may ([Note: parameters shared on one host]: collective then); any other
        move or conversion, which one rank may make alone, gives private buffers."""
        if self.state is not ShardState.SHARDED:
            raise RuntimeError("FSDP: a unit's module was moved or converted while its "
                               "parameters were unsharded; do it between steps")
        was_meta = self.is_meta
        first = self.slots[0].local
        device, dtype = first.device, first.dtype
        self.compute_device = device
        self.shard_device = torch.device("cpu") if self.offload else device
        if self.param_dtype == self.shard_dtype:  # no mixed precision: follow the new dtype
            self.param_dtype = dtype
        if self.reduce_dtype == self.shard_dtype:
            self.reduce_dtype = dtype
        self.shard_dtype = dtype
        shard = torch.zeros(self.layout.shard_numel, dtype=dtype, device=self.shard_device)
        with torch.no_grad():
            for slot in self.slots:
                view = self._local_view(shard, slot.layout)
                view.copy_(slot.local)
                set_local_tensor(slot.shard_param, view)
        self.shard = shard
        self.host = self._share_on_host() if was_meta else None
        self._make_full()
        self.reduction = choose_reduction(self, self.reduction.arrivals)  # the device may differ
        self.use_sharded_params()

    # ---- unshard / reshard --------------------------------------------------------------
    def start_unshard(self) -> None:
        """Allocate the full buffer and issue the gather into it (SHARDED -> GATHERING)."""
        if self.state is not ShardState.SHARDED:
            return
        pending = self.gather_path.start()
        if pending is None:  # nothing to gather: [Note: parameters shared on one host]
            self.state = ShardState.UNSHARDED
            return
        self._gather = pending
        self.state = ShardState.GATHERING

    def gather_source(self) -> torch.Tensor:
        """This rank's rows as the gather sends them: the shard in the compute device and dtype."""
        source = self.shard
        if source.dtype != self.param_dtype or source.device != self.compute_device:
            source = source.to(self.compute_device, self.param_dtype, non_blocking=True)
        return source

    def _start_gather(self, full: torch.Tensor, source: torch.Tensor) -> Pending:
        return start_unit_gather(full, source, self.layout, self.rank, self.global_ranks,
                                 self.group)

    def finish_unshard(self) -> None:
        """Wait for the gather (GATHERING -> UNSHARDED); start it first if needed."""
        self.start_unshard()
        if self.state is ShardState.GATHERING:
            self._gather.wait()
            self._gather = None
            self.state = ShardState.UNSHARDED

    def use_unsharded_views(self) -> None:
        """Point every module attribute at its parameter's leaf (see the Note)."""
        for slot, leaf in zip(self.slots, self.leaves):
            tensor = leaf if slot.requires_grad else leaf.detach()
            for module, name in slot.aliases:
                module._parameters[name] = tensor
        self.views_set = True

    def use_sharded_params(self) -> None:
        """Point every module attribute back at its sharded parameter."""
        for slot in self.slots:
            for module, name in slot.aliases:
                module._parameters[name] = slot.shard_param
        self.views_set = False

    def reshard(self) -> None:
        """Free the full buffer and restore the sharded parameters (-> SHARDED)."""
        if self.state is ShardState.SHARDED:
            return
        if self.state is ShardState.GATHERING:
            self._gather.wait()  # the collective must finish writing before its buffer goes
            self._gather = None
        self.use_sharded_params()
        self.gather_path.free()
        self.state = ShardState.SHARDED

    def unsharded_bytes(self) -> int:
        """Bytes of the full buffer's storage right now (0 while sharded, and always 0 where
        the parameters are shared on the host: nothing is allocated to unshard them)."""
        return self.gather_path.unsharded_bytes()

    def release_param_rows(self, index: int) -> int:
        """Give the pages under direct parameter ``index``'s unsharded rows back to the OS
        ([Note: releasing a dead parameter's rows], unit.py); the bytes released (0 for a
        packed parameter, or where pages cannot be released)."""
        slot = self.slots[index]
        if slot.layout.packed or self.host is not None or self.state is not ShardState.UNSHARDED:
            return 0
        released = release_pages(self.full_data[slot.offset : slot.offset + slot.numel])
        self.released_bytes += released
        return released

    # ---- gradients ----------------------------------------------------------------------
    @property
    def arrivals(self) -> GradArrivals:
        """Which gradients are in ([Note: gradient arrival]): the reduction path's record."""
        return self.reduction.arrivals

    def set_comm_hook(self, state: Any, hook: Callable[..., None]) -> None:
        """FSDP1's ``register_comm_hook``: ``hook(state, full_grad, out)`` reduces this unit's
        gradients from now on (the unit's reduction path is chosen again)."""
        self.comm_hook = (state, hook)
        self.reduction = choose_reduction(self, self.reduction.arrivals)

    def add_param_grad(self, index: int, sync: bool = True) -> None:
        """Hand leaf ``index``'s ``.grad`` to the unit's reduction path (its arrival is recorded
        there, [Note: gradient arrival]); ``sync``: this backward reduces."""
        leaf = self.leaves[index]
        grad, leaf.grad = leaf.grad, None
        if isinstance(grad, DTensor):  # a TP parameter's: its local tensor (tp_params.py)
            grad = local_grad(grad, self.tp[index])
        self.reduction.add(index, grad, sync)

    def reduced_out(self) -> torch.Tensor:
        """The buffer a reduction writes this rank's reduced shard into (1D, the reduce dtype,
        on the compute device, where the gradients are)."""
        return self.reduced_buffer.take(self.layout.shard_numel, self.reduce_dtype,
                                        self.compute_device)

    def has_gradient(self) -> bool:
        """Whether gradients wait to be reduced (the next ``start_reduction`` issues one)."""
        return self.reduction.has_gradient()

    def drop_gradients(self) -> None:
        """Let go of the gradients waiting to be reduced, after waiting for the direct
        exchanges already posted ([Note: a backward that raised], root.py)."""
        self.reduction.drop()
        self.reduction.arrivals.taken()

    def expect_gradient(self) -> None:
        """Make the next ``start_reduction`` issue one although no gradient arrived on this rank:
        the peers' did ([Note: where a unit's backward ends], unit.py), so this rank takes part
        with zeros, through the unit's reduction path."""
        self.reduction.expect()

    def start_reduction(self) -> GradReduction:
        """Issue the unit's reduction of the gradients gathered so far (zero where none
        arrived; see reduction.py for the path); the handle lets go of them."""
        pending, out, held = self.reduction.start()
        arrivals = self.reduction.arrivals
        self.reduced.reduced([arrivals.waiting(i) for i in range(len(self.slots))])
        arrivals.taken()
        return GradReduction(pending, out, held)

    def unsharded_grad_bytes(self) -> int:
        """Bytes of unreduced gradients this handle holds right now (flat buffer or held)."""
        return self.reduction.held_bytes()

    def finish_grad_reduction(self, reduction: GradReduction) -> None:
        """Wait for the reduce-scatter and add its result to each sharded parameter's ``.grad``
        (``Shard(0)`` DTensors whose local tensors are views of one flat buffer in the shards'
        dtype and device)."""
        reduction.pending.wait()
        flat = reduction.out.to(self.shard_device, self.shard_dtype, non_blocking=False)
        if self.divide_factor is not None:  # the mean, times ranks / factor: sum / factor
            flat.mul_(self.data_parallel_size() / self.divide_factor)
        for index, slot in enumerate(self.slots):
            if not slot.requires_grad:
                continue
            part = self._local_view(flat, slot.layout)
            param = slot.shard_param
            if param.grad is None:
                param.grad = sharded_like(part, param)
                self.reduced.grad_made(index)
            else:
                local_tensor(param.grad).add_(part)

    def data_parallel_size(self) -> int:
        """The ranks whose gradients a reduction averages: the shard group's, times the
        replicas' with hybrid sharding."""
        replicas = 1 if self.replicate_group is None else dist.get_world_size(
            self.replicate_group)
        return self.world * replicas

    def drop_grads_of_unused(self, used: list[int]) -> None:
        """``used[i]``: whether any rank had a gradient for slot i in this backward's
        reductions. The ``.grad`` they created for a slot no rank used goes back to None
        ([Note: gradients of unused parameters], reduction.py)."""
        for index in self.reduced.made:
            if not used[index]:
                self.slots[index].shard_param.grad = None

    def new_backward(self) -> None:
        """A backward ended: the next one starts with no arrivals and no reductions."""
        self.arrivals.new_backward()
        self.reduced.clear()

    # ---- whole parameters (state dicts) --------------------------------------------------
    def gather_full_params(self) -> list[torch.Tensor]:
        """Every parameter whole, in the shards' dtype (a collective over the unit's group)."""
        full = torch.empty(self.layout.total, dtype=self.shard_dtype, device=self.shard_device)
        self._start_gather(full, self.flat_shard()).wait()
        return [full[s.offset : s.offset + s.numel].view(s.shape) for s in self.slots]

    def flat_shard(self) -> torch.Tensor:
        """This rank's rows of every parameter in the flat shard's layout ([Note: FSDP
        layout]): the shard itself, or a packed copy where the rows live in the host's
        mapping."""
        if self.shard is not None:
            return self.shard.detach()
        flat = torch.zeros(self.layout.shard_numel, dtype=self.shard_dtype,
                           device=self.shard_device)
        for slot in self.slots:
            self._local_view(flat, slot.layout).copy_(slot.local.detach())
        return flat

    def load_flat_shard(self, flat: torch.Tensor) -> None:
        """Copy ``flat`` (the flat shard's layout) into this rank's rows."""
        with torch.no_grad():
            if self.shard is not None:
                self.shard.copy_(flat)
                return
            for slot in self.slots:
                slot.local.copy_(self._local_view(flat, slot.layout))

    @property
    def is_meta(self) -> bool:
        """Built on the meta device: no rows hold values yet."""
        return self.shard is not None and self.shard.is_meta

    def load_full_param(self, slot: ParamSlot, value: torch.Tensor) -> None:
        """Copy this rank's rows of ``value`` (the whole parameter) into the shard."""
        layout = slot.layout
        start = layout.row_start(self.rank)
        with torch.no_grad():
            slot.local.copy_(value.detach()[start : start + layout.local_rows(self.rank)])
