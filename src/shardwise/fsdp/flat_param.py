"""One unit's parameters as one flat, sharded buffer, with the original parameters as views.

[Note: flat parameters]
Each FSDP unit keeps three tensors for all of its parameters together:

- ``shard`` (1D, ``padded / world`` elements, the parameters' own dtype): this rank's part of the
  parameters laid out back to back and padded (see padding.py). It is the only copy that lives
  between steps. Every original parameter is replaced, under its original name, by an
  ``nn.Parameter`` that is a 1D view of the part of ``shard`` it owns (possibly empty), so
  ``model.parameters()`` hands an optimizer exactly the local shards and its state is sharded
  too; the memory accounting counts ``shard`` once.
- ``full_data`` (1D, ``padded`` elements, the compute dtype): the all-gather's output. Its storage
  is allocated just before the all-gather and resized to zero bytes when the unit reshards.
  Tensors autograd saved during forward keep pointing at this storage, so re-gathering into it
  in backward makes them valid again without keeping the parameters alive in between.
- ``leaves`` (one per parameter, its original shape, the compute dtype): autograd leaves that
  alias ``full_data``'s storage at their parameter's offset, each with its own version counter
  (so that writing the all-gather's output does not look like an in-place change of saved
  tensors). While unsharded, each module attribute is its parameter's leaf (detached if the
  parameter does not require grad, so that none is computed for it). They are made once and
  live as long as the handle; only the storage under them comes and goes.
- ``grad_buffer`` (1D, ``padded`` elements, the compute dtype): the unit's flat gradient, which
  the reduce-scatter works on directly. It is allocated when the unit's first gradient of a
  backward arrives; each leaf's post-accumulate-grad hook copies (or, when accumulating, adds)
  that leaf's gradient into its slice and drops the leaf's ``.grad`` at once. So the unit's
  gradient costs one flat buffer plus one parameter's gradient in flight, never the per-parameter
  gradients and their concatenation together (which a ``split`` of one flat leaf would cost:
  its backward concatenates every gradient while all of them are alive). The last expected
  gradient marks the end of the unit's backward.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from enum import Enum, auto

import torch
import torch.distributed as dist
from torch import nn

from shardwise.distributed.fast_collectives import Pending
from shardwise.fsdp.collectives import all_gather_now, start_all_gather, start_reduce_scatter
from shardwise.fsdp.padding import LocalSlice, local_slices, padded_numel, shard_bounds


class ShardState(Enum):
    SHARDED = auto()  # only `shard` exists; `full_data` has no storage
    GATHERING = auto()  # the all-gather into `full_data` is issued, not yet waited for
    UNSHARDED = auto()  # `full_data` holds every rank's shard


@dataclass
class ParamSlot:
    """One original parameter (possibly held by several modules: tied weights)."""

    aliases: list[tuple[nn.Module, str]]  # every (module, attribute name) that holds it
    fqns: list[str]  # names relative to the unit's module, one per alias
    shape: torch.Size
    offset: int  # start in the flat buffer
    local: LocalSlice  # this rank's part
    shard_param: nn.Parameter  # 1D, local.length elements: a view of the shard

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def requires_grad(self) -> bool:
        return self.shard_param.requires_grad


@dataclass
class GradReduction:
    """A reduce-scatter in flight: its result goes to the slots' gradients once waited for."""

    pending: Pending
    out: torch.Tensor  # 1D, shard elements, reduce dtype
    full_grad: torch.Tensor  # 1D, padded: kept alive until the collective is done


class FlatParamHandle:
    """The flat sharded parameters of one unit; see [Note: flat parameters]."""

    def __init__(self, params: list[tuple[nn.Parameter, list[tuple[nn.Module, str, str]]]],
                 group: dist.ProcessGroup, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
                 compute_device: torch.device, shard_device: torch.device):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.compute_device, self.shard_device = compute_device, shard_device
        numels = [p.numel() for p, _ in params]
        self.total = sum(numels)
        self.padded = padded_numel(self.total, self.world)
        # weak references to the replaced parameters, to detect one shared with another unit
        self.orig_params = [(weakref.ref(p), holders[0][2]) for p, holders in params]
        self.shard = self._make_shard([p for p, _ in params])  # 1D, padded / world
        self.slots = self._make_slots(params, numels)
        self.full_data = torch.empty(self.padded, dtype=param_dtype, device=compute_device)
        self.leaves = self._make_leaves()  # one per slot, its shape: views of full_data's storage
        self._free_full()
        self.grad_buffer: torch.Tensor | None = None  # 1D, padded, param dtype
        self._grad_written = [False] * len(self.slots)  # per slot, since grad_buffer was made
        self._grads_arrived = 0  # in this backward
        self.state = ShardState.SHARDED
        self.views_set = False
        self._gather: Pending | None = None
        self._gather_input: torch.Tensor | None = None
        self.use_sharded_params()

    # ---- construction -------------------------------------------------------------------
    def _make_shard(self, params: list[nn.Parameter]) -> torch.Tensor:
        start, end = shard_bounds(self.rank, self.total, self.world)
        shard = torch.zeros(end - start, dtype=params[0].dtype, device=self.shard_device)
        at = 0
        with torch.no_grad():
            for p in params:
                lo, hi = max(at, start), min(at + p.numel(), end)
                if hi > lo:
                    shard[lo - start : hi - start].copy_(p.detach().reshape(-1)[lo - at : hi - at])
                at += p.numel()
        return shard

    def _make_slots(self, params, numels: list[int]) -> list[ParamSlot]:
        slots, offset = [], 0
        for (p, holders), local in zip(params, local_slices(numels, self.rank, self.world)):
            view = self.shard[local.shard_offset : local.shard_offset + local.length]
            shard_param = nn.Parameter(view, requires_grad=p.requires_grad)
            slots.append(ParamSlot([(m, n) for m, n, _ in holders], [f for _, _, f in holders],
                                   p.shape, offset, local, shard_param))
            offset += p.numel()
        return slots

    def _make_leaves(self) -> list[torch.Tensor]:
        storage = self.full_data.untyped_storage()
        leaves = []
        for slot in self.slots:
            leaf = torch.empty(0, dtype=self.param_dtype, device=self.compute_device)
            leaf.set_(storage, slot.offset, slot.shape)
            leaves.append(leaf.requires_grad_())
        return leaves

    @property
    def requires_grad(self) -> bool:
        return any(s.requires_grad for s in self.slots)

    def live_orig_params(self) -> dict[int, str]:
        """``id -> name`` of the replaced parameters that something else still holds."""
        return {id(p): name for ref, name in self.orig_params if (p := ref()) is not None}

    # ---- unshard / reshard --------------------------------------------------------------
    def start_unshard(self) -> None:
        """Allocate the full buffer and issue the all-gather into it (SHARDED -> GATHERING)."""
        if self.state is not ShardState.SHARDED:
            return
        self.full_data.untyped_storage().resize_(self.padded * self.full_data.element_size())
        source = self.shard
        if source.dtype != self.param_dtype or source.device != self.compute_device:
            source = source.to(self.compute_device, self.param_dtype, non_blocking=True)
        self._gather_input = source
        self._gather = start_all_gather(self.full_data, source, self.group)
        self.state = ShardState.GATHERING

    def finish_unshard(self) -> None:
        """Wait for the all-gather (GATHERING -> UNSHARDED); start it first if needed."""
        self.start_unshard()
        if self.state is ShardState.GATHERING:
            self._gather.wait()
            self._gather, self._gather_input = None, None
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
            self._gather, self._gather_input = None, None
        self.use_sharded_params()
        self._free_full()
        self.state = ShardState.SHARDED

    def _free_full(self) -> None:
        self.full_data.untyped_storage().resize_(0)

    def unsharded_bytes(self) -> int:
        """Bytes of the full buffer's storage right now (0 while sharded)."""
        return self.full_data.untyped_storage().nbytes()

    # ---- gradients ----------------------------------------------------------------------
    def add_param_grad(self, index: int) -> bool:
        """Move leaf ``index``'s ``.grad`` into its slice of ``grad_buffer`` (allocated by the
        first one). True when every parameter that requires grad has delivered its gradient in
        this backward."""
        leaf, slot = self.leaves[index], self.slots[index]
        grad, leaf.grad = leaf.grad, None
        if self.grad_buffer is None:
            self.grad_buffer = torch.empty(self.padded, dtype=self.param_dtype,
                                           device=self.compute_device)
        dest = self.grad_buffer[slot.offset : slot.offset + slot.numel].view(slot.shape)
        if self._grad_written[index]:
            dest.add_(grad)
        else:
            dest.copy_(grad)
            self._grad_written[index] = True
        self._grads_arrived += 1
        return self._grads_arrived == sum(s.requires_grad for s in self.slots)

    def grads_arrived(self) -> bool:
        """Whether any gradient has arrived in this backward."""
        return self._grads_arrived > 0

    def reset_backward(self) -> None:
        """A new backward expects every gradient again (``grad_buffer`` itself is kept)."""
        self._grads_arrived = 0

    def take_full_grad(self) -> torch.Tensor | None:
        """The flat gradient (1D, padded), zero where no gradient arrived; the handle lets go."""
        grad, self.grad_buffer = self.grad_buffer, None
        if grad is None:
            return None
        for slot, written in zip(self.slots, self._grad_written):
            if not written:
                grad[slot.offset : slot.offset + slot.numel].zero_()
        grad[self.total :].zero_()
        self._grad_written = [False] * len(self.slots)
        return grad

    def unsharded_grad_bytes(self) -> int:
        """Bytes of the flat gradient buffer alive right now (0 when there is none)."""
        return 0 if self.grad_buffer is None else self.grad_buffer.untyped_storage().nbytes()

    def start_grad_reduction(self, full_grad: torch.Tensor) -> GradReduction:
        """Issue the averaging reduce-scatter of ``full_grad`` (1D, padded) in the reduce dtype."""
        full_grad = full_grad.to(self.reduce_dtype)
        if self.world == 1:
            return GradReduction(Pending([]), full_grad, full_grad)
        out = torch.empty(self.padded // self.world, dtype=self.reduce_dtype,
                          device=full_grad.device)
        return GradReduction(start_reduce_scatter(out, full_grad, self.group), out, full_grad)

    def finish_grad_reduction(self, reduction: GradReduction) -> None:
        """Wait for the reduce-scatter and add its result to each sharded parameter's ``.grad``
        (views of one flat buffer in the shards' dtype and device)."""
        reduction.pending.wait()
        flat = reduction.out.to(self.shard.device, self.shard.dtype, non_blocking=False)
        for slot in self.slots:
            if not slot.requires_grad:
                continue
            part = flat[slot.local.shard_offset : slot.local.shard_offset + slot.local.length]
            param = slot.shard_param
            if param.grad is None:
                param.grad = part
            else:
                param.grad.add_(part)

    # ---- whole parameters (state dicts) --------------------------------------------------
    def gather_full_params(self) -> list[torch.Tensor]:
        """Every parameter in its original shape and the shards' dtype (a collective)."""
        full = torch.empty(self.padded, dtype=self.shard.dtype, device=self.shard.device)
        all_gather_now(full, self.shard.detach(), self.group)
        return [full[s.offset : s.offset + s.numel].view(s.shape).clone() for s in self.slots]

    def load_full_param(self, slot: ParamSlot, value: torch.Tensor) -> None:
        """Copy this rank's part of ``value`` (the whole parameter) into the shard."""
        part = value.detach().reshape(-1)[slot.local.param_offset :
                                          slot.local.param_offset + slot.local.length]
        with torch.no_grad():
            slot.shard_param.copy_(part)
