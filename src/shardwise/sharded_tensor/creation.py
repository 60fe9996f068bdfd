"""Creating sharded tensors: allocation, seeded random values, scattering, wrapping local shards.

[Note: reproducible random sharded tensors] ``rand``/``randn`` give the values that the same call
on one process would give: after ``torch.manual_seed(s)``, ``rand(spec, 5, 7).full_tensor()``
equals ``torch.rand(5, 7)`` under the same seed, whatever the spec and world size. Every rank
draws the whole tensor from its default generator and keeps its boxes: no communication, and the
default generator advances by the same amount on every rank as on one process, so replicated
values drawn afterwards (the rest of a model's initialisation) stay identical across ranks too.
The price is one transient full-size tensor per rank at creation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from shardwise.distributed.groups import global_ranks
from shardwise.sharded_tensor.metadata import (
    Placement,
    ShardedTensorMetadata,
    ShardingError,
    ShardMetadata,
    TensorProperties,
    to_group_ranks,
    validate_shards,
)
from shardwise.sharded_tensor.redistribute import redistribute
from shardwise.sharded_tensor.shard import Shard
from shardwise.sharded_tensor.sharded_tensor import (
    ShardedTensor,
    _size_arg,
    check_torch_only,
    group_rank,
    resolved_metadata,
)
from shardwise.sharded_tensor.spec import EnumerableShardingSpec, ShardingSpec


def _filled(fill: Callable[[torch.Tensor], None], spec: ShardingSpec, size: tuple, dtype,
            requires_grad: bool, process_group) -> ShardedTensor:
    st = ShardedTensor(spec, *size, dtype=dtype, process_group=process_group)
    with torch.no_grad():
        for shard in st.local_shards():
            fill(shard.tensor)
    for shard in st.local_shards():
        shard.tensor.requires_grad_(requires_grad)
    return st


def empty(sharding_spec: ShardingSpec, *size: int, dtype: torch.dtype | None = None,
          requires_grad: bool = False, process_group=None, **torch_only) -> ShardedTensor:
    """Uninitialised shards (no communication)."""
    check_torch_only("empty", torch_only)
    return ShardedTensor(sharding_spec, *size, dtype=dtype, requires_grad=requires_grad,
                         process_group=process_group)


def zeros(sharding_spec: ShardingSpec, *size: int, dtype: torch.dtype | None = None,
          requires_grad: bool = False, process_group=None, **torch_only) -> ShardedTensor:
    check_torch_only("zeros", torch_only)
    return _filled(lambda t: t.zero_(), sharding_spec, size, dtype, requires_grad, process_group)


def ones(sharding_spec: ShardingSpec, *size: int, dtype: torch.dtype | None = None,
         requires_grad: bool = False, process_group=None, **torch_only) -> ShardedTensor:
    check_torch_only("ones", torch_only)
    return _filled(lambda t: t.fill_(1), sharding_spec, size, dtype, requires_grad, process_group)


def full(sharding_spec: ShardingSpec, size: Sequence[int], fill_value, *,
         dtype: torch.dtype | None = None, requires_grad: bool = False, process_group=None,
         **torch_only) -> ShardedTensor:
    check_torch_only("full", torch_only)
    return _filled(lambda t: t.fill_(fill_value), sharding_spec, tuple(size), dtype,
                   requires_grad, process_group)


def _random(draw: Callable, spec: ShardingSpec, size: tuple, dtype, requires_grad,
            process_group, generator) -> ShardedTensor:
    # See [Note: reproducible random sharded tensors].
    st = ShardedTensor(spec, *size, dtype=dtype, process_group=process_group)
    whole = draw(_size_arg(size), dtype=st.dtype, generator=generator)
    with torch.no_grad():
        for shard in st.local_shards():
            shard.tensor.copy_(whole[shard.metadata.region()])
            shard.tensor.requires_grad_(requires_grad)
    return st


def rand(sharding_spec: ShardingSpec, *size: int, dtype: torch.dtype | None = None,
         requires_grad: bool = False, process_group=None, generator=None,
         **torch_only) -> ShardedTensor:
    """Uniform [0, 1) values equal to ``torch.rand(*size)`` on one process with the same seed."""
    check_torch_only("rand", torch_only)
    return _random(torch.rand, sharding_spec, size, dtype, requires_grad, process_group,
                   generator)


def randn(sharding_spec: ShardingSpec, *size: int, dtype: torch.dtype | None = None,
          requires_grad: bool = False, process_group=None, generator=None,
          **torch_only) -> ShardedTensor:
    """Normal values equal to ``torch.randn(*size)`` on one process with the same seed."""
    check_torch_only("randn", torch_only)
    return _random(torch.randn, sharding_spec, size, dtype, requires_grad, process_group,
                   generator)


def shard_tensor(tensor: torch.Tensor, sharding_spec: ShardingSpec, src_rank: int = 0,
                 process_group=None) -> ShardedTensor:
    """Scatter ``tensor`` as held by ``src_rank`` (other ranks pass a tensor of the same size
    and dtype whose values are ignored): one ``all_to_all_single`` in which only ``src_rank``
    sends. The result does not require grad (it is a new leaf)."""
    rank, world = group_rank(process_group)
    if not 0 <= src_rank < world:
        raise ShardingError(f"shard_tensor(src_rank={src_rank}): not a rank of the group "
                            f"(0..{world - 1})")
    size = tuple(tensor.shape)
    metas = resolved_metadata(sharding_spec, size, process_group)
    source = [ShardMetadata((0,) * len(size), size, f"rank:{src_rank}")]
    local = {0: tensor.detach()} if rank == src_rank else {}
    got = redistribute(local, source, metas, rank, world, process_group, tensor.detach())
    shards = [Shard(got[j], m) for j, m in enumerate(metas) if j in got]
    meta = ShardedTensorMetadata(metas, size, TensorProperties(tensor.dtype, False))
    return ShardedTensor._from_parts(shards, meta, sharding_spec, process_group)


def init_from_local_shards(local_shards: list[Shard], *global_size: int,
                           process_group=None, **torch_only) -> ShardedTensor:
    """Wrap each rank's shards into one ShardedTensor (one ``all_gather_object`` of the shards'
    metadata, then validation: sizes match the metadata, shards on their own rank, no overlap,
    full coverage). The spec is the EnumerableShardingSpec of the gathered shards."""
    check_torch_only("init_from_local_shards", torch_only)
    size = _size_arg(global_size)
    rank, world = group_rank(process_group)
    me = dist.get_rank()  # placements name global ranks, as torch's do
    for s in local_shards:
        if s.metadata.rank != me:
            raise ShardingError(f"rank {me}: local shard {s.metadata.describe()} is placed on "
                                f"rank {s.metadata.rank}, not on this rank (placements name "
                                "global ranks)")
    ranks = global_ranks(process_group)
    local_shards = [Shard(s.tensor, m) for s, m in zip(local_shards, to_group_ranks(
        [s.metadata for s in local_shards], ranks, "init_from_local_shards"))]
    mine = [(s.metadata, s.tensor.dtype) for s in local_shards]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine, group=process_group)
    dtypes = {d for rank_shards in everyone for _, d in rank_shards}
    if len(dtypes) > 1:
        raise ShardingError(f"init_from_local_shards: ranks hold shards of dtypes "
                            f"{sorted(map(str, dtypes))}")
    metas = [m for rank_shards in everyone for m, _ in rank_shards]
    validate_shards(metas, size, world)
    dtype = dtypes.pop() if dtypes else torch.get_default_dtype()
    rg = any(s.tensor.requires_grad for s in local_shards)
    meta = ShardedTensorMetadata(metas, size, TensorProperties(dtype, rg))
    spec = EnumerableShardingSpec([ShardMetadata(m.shard_offsets, m.shard_sizes, Placement(
        ranks[m.rank], m.placement.device)) for m in metas])  # global ranks, as given
    return ShardedTensor._from_parts(list(local_shards), meta, spec,
                                     process_group)
