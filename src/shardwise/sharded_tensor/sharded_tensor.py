"""ShardedTensor: one logical tensor whose shards live on the ranks of a process group (SPMD).

Specs and user-made shards name global ranks, as torch's do; the metadata a ShardedTensor keeps
(``metadata()``, each local shard's) numbers the ranks within its group ([Note: global ranks in
placements], metadata.py).

Each rank holds its local shards (``Shard``: a tensor and its box) and the global metadata (every
shard's box and rank). Torch calls that receive a ShardedTensor reach ``__torch_function__`` and
are dispatched to the registered sharded implementations (``ops_*.py``); any other op raises
``UnsupportedShardedOp`` naming itself and the sharding.

A ShardedTensor is a plain Python object, not a ``torch.Tensor`` subclass: its local shards are
ordinary tensors (leaf Parameters when it shards a module's parameter, see parametrize.py), so
autograd, optimizers and kernels see only ordinary tensors and nothing can mistake a local shard
for the whole tensor.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Function

from shardwise.distributed.groups import global_ranks
from shardwise.sharded_tensor.dispatch import dispatch
from shardwise.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    ShardingError,
    ShardMetadata,
    TensorProperties,
)
from shardwise.sharded_tensor.redistribute import redistribute
from shardwise.sharded_tensor.shard import Shard
from shardwise.sharded_tensor.spec import ShardingSpec, resolve_device


def group_rank(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def resolved_metadata(spec: ShardingSpec, size: Sequence[int], group) -> list[ShardMetadata]:
    """The spec's shards for ``size`` on ranks of ``group`` (the spec's placements name global
    ranks: [Note: global ranks in placements]) with every placement's device made explicit."""
    backend = dist.get_backend(group)
    out = []
    for s in spec.group_metadata(size, global_ranks(group)):
        place = type(s.placement)(s.placement.rank, resolve_device(s.placement, backend))
        out.append(ShardMetadata(s.shard_offsets, s.shard_sizes, place))
    return out



# torch's sharded-tensor constructors take these too; we accept them and do not honour them
# (shards are strided, contiguous, not pinned; RRefs to peers' shards are not built): a value
# other than torch's default warns once. Any other keyword is a TypeError.
TORCH_ONLY_DEFAULTS: dict[str, Any] = {"layout": torch.strided, "pin_memory": False,
                                       "memory_format": torch.contiguous_format,
                                       "init_rrefs": False}
_warned_torch_only: set[str] = set()


def check_torch_only(func: str, kwargs: dict[str, Any]) -> None:
    """Refuse unknown keywords of a constructor (TypeError naming them); warn once per
    argument set to a value we do not honour."""
    unknown = sorted(set(kwargs) - set(TORCH_ONLY_DEFAULTS))
    if unknown:
        raise TypeError(f"{func}() got an unexpected keyword argument {unknown[0]!r}")
    for name, value in kwargs.items():
        if value != TORCH_ONLY_DEFAULTS[name] and name not in _warned_torch_only:
            _warned_torch_only.add(name)
            warnings.warn(f"{func}: {name}={value!r} is accepted for torch's API and ignored "
                          f"(shards use {name}={TORCH_ONLY_DEFAULTS[name]!r})", stacklevel=3)

class ShardedTensor:
    """``ShardedTensor(spec, *size, dtype=None, requires_grad=False, process_group=None)``
    allocates uninitialised local shards, as torch's constructor does (torch's ``layout``,
    ``pin_memory``, ``memory_format``, ``init_rrefs`` are accepted, ignored, and warn once when
    not torch's default; any other keyword is a TypeError); see creation.py for
    ``zeros``/``ones``/``rand``/``randn``, ``shard_tensor`` and ``init_from_local_shards``."""

    def __init__(self, sharding_spec: ShardingSpec, *size: int, dtype: torch.dtype | None = None,
                 requires_grad: bool = False, process_group: dist.ProcessGroup | None = None,
                 **torch_only: Any):
        check_torch_only("ShardedTensor", torch_only)
        size = _size_arg(size)
        dtype = dtype or torch.get_default_dtype()
        metas = resolved_metadata(sharding_spec, size, process_group)
        rank, _ = group_rank(process_group)
        shards = [Shard(torch.empty(m.shard_sizes, dtype=dtype, device=m.placement.device,
                                    requires_grad=requires_grad), m)
                  for m in metas if m.rank == rank]
        meta = ShardedTensorMetadata(metas, size, TensorProperties(dtype, requires_grad))
        self._init(shards, meta, sharding_spec, process_group)

    def _init(self, shards: list[Shard], meta: ShardedTensorMetadata, spec: ShardingSpec,
              group) -> None:
        self._local_shards = shards
        self._metadata = meta
        self._sharding_spec = spec
        self._process_group = group

    @classmethod
    def _from_parts(cls, shards: list[Shard], meta: ShardedTensorMetadata, spec: ShardingSpec,
                    group) -> ShardedTensor:
        """Wrap local shards that already match ``meta`` on this rank (checked)."""
        st = cls.__new__(cls)
        st._init(shards, meta, spec, group)
        st._check_local()
        return st

    def _check_local(self) -> None:
        rank, _ = group_rank(self._process_group)
        expected = self._metadata.on_rank(rank)
        got = [s.metadata for s in self._local_shards]
        if got != expected:
            raise ShardingError(
                f"rank {rank}: local shards {[m.describe() for m in got]} do not match the "
                f"metadata's shards for this rank {[m.describe() for m in expected]}"
            )

    # --- the torch.distributed._shard.ShardedTensor surface ---------------------------------
    def local_shards(self) -> list[Shard]:
        return self._local_shards

    def local_tensor(self) -> torch.Tensor:
        """The one local shard's tensor (error when this rank holds none or several)."""
        if len(self._local_shards) != 1:
            rank, _ = group_rank(self._process_group)
            raise ShardingError(f"local_tensor(): rank {rank} holds {len(self._local_shards)} "
                                f"shards of {self._sharding_spec!r}; use local_shards()")
        return self._local_shards[0].tensor

    def metadata(self) -> ShardedTensorMetadata:
        return self._metadata

    def sharding_spec(self) -> ShardingSpec:
        return self._sharding_spec

    @property
    def process_group(self):
        return self._process_group

    def size(self, dim: int | None = None):
        return self._metadata.size if dim is None else self._metadata.size[dim]

    @property
    def shape(self) -> torch.Size:
        return self._metadata.size

    def dim(self) -> int:
        return len(self._metadata.size)

    ndim = property(dim)

    def numel(self) -> int:
        return self._metadata.size.numel()

    def _a_local_tensor(self) -> torch.Tensor | None:
        """A local tensor to answer dtype, device and requires_grad from: a sharded parameter's
        slot as it is (even while another mechanism shards it further, see parametrize.py)."""
        slot = getattr(self._local_shards, "tensor", None)
        if callable(slot):
            return slot()
        return self._local_shards[0].tensor if self._local_shards else None

    @property
    def dtype(self) -> torch.dtype:
        t = self._a_local_tensor()
        return t.dtype if t is not None else self._metadata.tensor_properties.dtype

    @property
    def device(self) -> torch.device:
        t = self._a_local_tensor()
        if t is not None:
            return t.device
        return resolve_device(self._metadata.shards_metadata[0].placement,
                              dist.get_backend(self._process_group))

    @property
    def requires_grad(self) -> bool:
        slot = getattr(self._local_shards, "tensor", None)
        if callable(slot):  # a sharded parameter: its slot
            return slot().requires_grad
        return any(s.tensor.requires_grad for s in self._local_shards)

    def gather(self, dst: int = 0, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The whole tensor on rank ``dst`` (into ``out`` when given); None on other ranks.

        One ``all_to_all_single`` in which only ``dst`` receives. Not differentiable."""
        rank, world = group_rank(self._process_group)
        if not 0 <= dst < world:
            raise ShardingError(f"gather(dst={dst}): dst must be a rank of the group "
                                f"(0..{world - 1})")
        target = [ShardMetadata((0,) * self.dim(), tuple(self.shape), f"rank:{dst}")]
        whole = redistribute(self._by_index(), self._metadata.shards_metadata, target, rank,
                             world, self._process_group, self._like())
        if rank != dst:
            return None
        if out is None:
            return whole[0]
        if out.shape != self.shape:
            raise ShardingError(f"gather: out has size {tuple(out.shape)}, the sharded tensor "
                                f"{tuple(self.shape)}")
        return out.copy_(whole[0])

    def full_tensor(self) -> torch.Tensor:
        """The whole tensor on every rank (one ``all_to_all_single``: an all-gather).

        Differentiable: the gradient of each local shard is its box of the output's gradient
        (the output is replicated, so every rank's gradient of it is the same)."""
        return _FullTensor.apply(_Holder(self), *[s.tensor for s in self._local_shards])

    def reshard(self, resharding_spec: ShardingSpec) -> ShardedTensor:
        """Move to ``resharding_spec`` in place and return self (torch's contract).

        One ``all_to_all_single`` moves every element whose rank changes, for any pair of chunk
        and enumerable specs. Not differentiable (it replaces the local shards)."""
        rank, world = group_rank(self._process_group)
        new = resolved_metadata(resharding_spec, self.shape, self._process_group)
        moved = redistribute(self._by_index(), self._metadata.shards_metadata, new, rank, world,
                             self._process_group, self._like())
        rg = self.requires_grad
        shards = [Shard(moved[j].requires_grad_(rg), m) for j, m in enumerate(new) if j in moved]
        meta = ShardedTensorMetadata(new, self.shape, self._metadata.tensor_properties)
        self._init(shards, meta, resharding_spec, self._process_group)
        return self

    # --- helpers for ops --------------------------------------------------------------------
    def _by_index(self) -> dict[int, torch.Tensor]:
        index = {m: i for i, m in enumerate(self._metadata.shards_metadata)}
        return {index[s.metadata]: s.tensor.detach() for s in self._local_shards}

    def _like(self) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype, device=self.device)

    def _with_local(self, tensors: list[torch.Tensor], spec: ShardingSpec | None = None,
                    meta: ShardedTensorMetadata | None = None) -> ShardedTensor:
        """A new ShardedTensor with these local tensors in place of this one's shards."""
        meta = meta or self._metadata
        rank, _ = group_rank(self._process_group)
        shards = [Shard(t, m) for t, m in zip(tensors, meta.on_rank(rank))]
        return ShardedTensor._from_parts(shards, meta, spec or self._sharding_spec,
                                         self._process_group)

    # --- torch function protocol and operators ----------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return dispatch(func, args, kwargs or {})

    def __add__(self, o):
        return torch.add(self, o)

    def __radd__(self, o):
        return torch.add(o, self)

    def __sub__(self, o):
        return torch.sub(self, o)

    def __rsub__(self, o):
        return torch.sub(o, self)

    def __mul__(self, o):
        return torch.mul(self, o)

    def __rmul__(self, o):
        return torch.mul(o, self)

    def __truediv__(self, o):
        return torch.div(self, o)

    def __rtruediv__(self, o):
        return torch.div(o, self)

    def __neg__(self):
        return torch.neg(self)

    def __abs__(self):
        return torch.abs(self)

    def __pow__(self, o):
        return torch.pow(self, o)

    def __rpow__(self, o):
        return torch.pow(o, self)

    def __matmul__(self, o):
        return torch.matmul(self, o)

    def __rmatmul__(self, o):
        return torch.matmul(o, self)

    def __getattr__(self, name: str):
        # Tensor methods (st.sum(), st.relu(), st.mul_(2), ...) go through the same dispatch.
        method = getattr(torch.Tensor, name, None)
        if method is None or name.startswith("_") or not callable(method):
            raise AttributeError(f"ShardedTensor has no attribute {name!r} (a tensor attribute "
                                 "such as .grad belongs to each local shard: local_shards())")
        return lambda *a, **k: dispatch(method, (self, *a), k)

    def __getstate__(self) -> dict:
        # The process group cannot be pickled: a loaded ShardedTensor belongs to the default
        # (world) group until it is loaded into a module, which rebinds it (parametrize.py).
        return {"shards": [Shard(s.tensor.detach(), s.metadata) for s in self._local_shards],
                "metadata": self._metadata, "spec": self._sharding_spec}

    def __setstate__(self, state: dict) -> None:
        self._init(state["shards"], state["metadata"], state["spec"], None)

    def __repr__(self) -> str:
        return (f"ShardedTensor(size={tuple(self.shape)}, dtype={self.dtype}, "
                f"spec={self._sharding_spec!r}, local_shards={len(self._local_shards)})")


class _Holder:
    """Carries a ShardedTensor into an autograd Function without it being seen as an argument
    that overrides torch functions."""

    def __init__(self, st: ShardedTensor):
        self.st = st


class _FullTensor(Function):
    @staticmethod
    def forward(ctx, holder: _Holder, *locals_):
        st = holder.st
        ctx.boxes = [s.metadata for s in st.local_shards()]
        rank, world = group_rank(st.process_group)
        everywhere = [ShardMetadata((0,) * st.dim(), tuple(st.shape), f"rank:{r}")
                      for r in range(world)]
        out = redistribute(st._by_index(), st.metadata().shards_metadata, everywhere, rank,
                           world, st.process_group, st._like())
        return out[rank]

    @staticmethod
    def backward(ctx, grad):
        return (None, *[grad[m.region()] for m in ctx.boxes])


def _size_arg(size: tuple) -> torch.Size:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    if not size or any(not isinstance(s, int) or s < 0 for s in size):
        raise ShardingError(f"size {size}: expected non-negative ints")
    return torch.Size(size)
