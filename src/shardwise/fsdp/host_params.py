"""FSDP's parameters held once per host, in memory every rank of the unit's group maps.

[Note: parameters shared on one host]
Where every rank of a unit's group runs on one host (CPU tensors; see ``shareable``), gathering
a unit's parameters is pure overhead: on gloo each rank copies its rows into loopback TCP, the
kernel copies them out on the other side, and the receiver writes them into a buffer it
allocated (and whose pages the kernel zeroed) only to free it after the unit's forward or
backward. So there the unit's unsharded buffer, ``full_data`` ([Note: flat parameters]), is one
mapping shared by the group's ranks instead (``SharedSegment``, distributed/host/segment.py),
made once when the unit is built and kept for its life. Each parameter is sharded on dim 0 as
everywhere else ([Note: FSDP layout]), so the rows a rank owns are one contiguous run of that
parameter in the mapping, and the local tensor of the parameter's ``DTensor`` is a view of exactly
those rows: the optimizer updates them in place, and the peers read the update where it is. Nothing
is gathered, copied or freed per step; an unshard only points the module's attributes at the leaves,
a reshard points them back. Every rank's shard together is the whole model once per host, the memory
the shards took before; a rank's resident set counts the pages of the whole mapping that it reads
(all of them), as it did its own shard and the units it gathered.

What replaces the gathers' ordering is a barrier over the group at three points of an
iteration, which the root issues (``RootState.sync_host``):

- before the root's forward: every rank has finished writing its rows (the optimizer step, a
  load), so none is read half-written;
- after the root's forward, and at the end of backward: every rank has finished reading the
  peers' rows for this pass, so none is overwritten while a peer computes with it (a forward
  whose backward never runs is covered by the first of the two).

So a rank writes its rows only between the end of one pass and the start of the next, as with
gathers; a recomputed forward (activation checkpointing) runs inside backward and adds nothing.
Gradients are reduced as before (the reduce-scatter of [Note: direct gradient reduction]).
Not used (the gathers stay) with mixed precision (the compute dtype needs its own copy), with
CPU offload or a device other than the CPU, for parameters of torch's tensor parallelism, with
one rank, on the fake process group of a dry run, where /dev/shm lacks room, and when
``SHARDWISE_FSDP_NO_SHARED_PARAMS=1``. A unit built on the meta device shares its parameters
when ``to_empty`` materializes them (every rank calls it); any other move or conversion of the
module (``to``, ``double``), which one rank may make alone, gives the unit private buffers and
gathers again. tests/fsdp/test_host_params.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.distributed.env import flag_var
from shardwise.distributed.host.same_host import on_one_host
from shardwise.distributed.host.segment import SharedSegment, room_for
from shardwise.fsdp.collectives import host_barrier
from shardwise.fsdp.layout import ParamLayout, UnitLayout

DISABLE_VAR = "SHARDWISE_FSDP_NO_SHARED_PARAMS"
_PURPOSE = "FSDP parameters shared on one host"


def shareable(group: dist.ProcessGroup, device: torch.device, local_ok: bool,
              nbytes: int) -> bool:
    """Whether a unit's parameters may live in one mapping for ``group`` (see the Note).

    Collective over ``group`` (``on_one_host``): ``local_ok`` is this rank's own verdict on
    the unit (dtype, offload, tensor parallelism); the mapping takes ``nbytes``."""
    return on_one_host(group, device,
                       lambda: local_ok and not flag_var(DISABLE_VAR) and room_for(nbytes))


def own_rows(full: torch.Tensor, layout: ParamLayout, rank: int) -> torch.Tensor:
    """The rows of one parameter that ``rank`` owns, as a view of the unsharded flat buffer
    ``full`` (contiguous: the parameter is sharded on dim 0)."""
    start = layout.full_offset + layout.row_start(rank) * layout.row_numel
    return full[start : start + layout.local_numel(rank)].view(layout.local_shape(rank))


class HostParams:
    """A unit's unsharded parameters in one mapping of the group's ranks (see the Note).

    Construction is collective: every rank writes its own rows from ``locals_`` (one tensor per
    parameter, its local shape) and a barrier makes the whole buffer valid on every rank."""

    def __init__(self, layout: UnitLayout, locals_: list[torch.Tensor], rank: int,
                 dtype: torch.dtype, group: dist.ProcessGroup):
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.segment = SharedSegment(max(layout.total * itemsize, 1), group, _PURPOSE,
                                     DISABLE_VAR)
        self.full = self.segment.tensor(0, layout.total, dtype)
        with torch.no_grad():
            for param, local in zip(layout.params, locals_):
                own_rows(self.full, param, rank).copy_(local)
        host_barrier(group)  # every rank's rows are in: the buffer is whole everywhere
        self.rows = [own_rows(self.full, param, rank) for param in layout.params]
