"""Sharding an existing module's parameters in place: ``shard_parameter`` and ``shard_module``.

[Note: how a sharded parameter appears] After ``shard_parameter(module, "weight", spec)``:

- ``module.weight`` (what ``forward`` reads) is the ShardedTensor, so ``F.linear(x, self.weight,
  self.bias)`` reaches the sharded implementation through ``__torch_function__``: the module's
  class is not changed. It lives in the instance ``__dict__``, which attribute lookup consults
  before ``nn.Module.__getattr__`` looks in ``_parameters``.
- ``module._parameters["weight"]`` is an ordinary ``nn.Parameter`` holding this rank's shard, and
  the ShardedTensor's local shard *is* whatever that slot holds, looked up live on every access
  (``_ParamShards``). So ``model.parameters()`` yields local shards, gradients are accumulated
  into them, and any optimizer steps them in place: no wrapper optimizer and no copies. A
  mechanism that replaces the slot's tensor (FSDP over a data axis puts its gathered copy there
  for forward and backward, its further-sharded DTensor between steps; see fsdp/tp_params.py)
  is followed without being told.
- ``state_dict()`` gives a ShardedTensor (this rank's shard, detached, with the global metadata)
  under the parameter's key; ``load_state_dict`` takes a ShardedTensor with the same layout (its
  local shard is copied in) or a whole tensor of the global size (this rank's box of it is).
  When the slot holds a DTensor (FSDP x TP: the 2D DTensor of the whole parameter), the entry
  is that DTensor, left to its owner in both directions.

Move a module to its device before sharding it: ``module.to()`` would replace the Parameters
behind the ShardedTensors' backs.
"""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardwise._compat import DTensor
from shardwise.sharded_tensor import comm
from shardwise.sharded_tensor.creation import shard_tensor
from shardwise.sharded_tensor.metadata import ShardingError, ShardMetadata
from shardwise.sharded_tensor.shard import Shard
from shardwise.sharded_tensor.sharded_tensor import ShardedTensor
from shardwise.sharded_tensor.spec import ChunkShardingSpec, ShardingSpec

_ATTR = "_shardwise_sharded"  # module attribute: {param name: ShardedTensor}


def sharded_parameters(module: nn.Module) -> dict[str, ShardedTensor]:
    """The ShardedTensors of ``module``'s own sharded parameters, by parameter name."""
    return module.__dict__.get(_ATTR, {})


def shard_parameter(module: nn.Module, param_name: str, sharding_spec: ShardingSpec,
                    src_rank: int = 0, process_group: dist.ProcessGroup | None = None
                    ) -> ShardedTensor:
    """Shard ``module.<param_name>`` in place by ``sharding_spec``, scattering the values that
    ``src_rank`` holds (one ``all_to_all_single``). See [Note: how a sharded parameter appears].
    Every rank must receive exactly one shard."""
    param = module._parameters.get(param_name)
    if param is None:
        raise ShardingError(f"{type(module).__name__} has no parameter {param_name!r} (its "
                            f"parameters: {sorted(module._parameters)})")
    if param_name in sharded_parameters(module):
        raise ShardingError(f"{type(module).__name__}.{param_name} is already sharded")
    st = shard_tensor(param.detach(), sharding_spec, src_rank, process_group)
    world = dist.get_world_size(process_group)
    counts = [len(st.metadata().on_rank(r)) for r in range(world)]
    if counts != [1] * world:
        bad = [r for r, c in enumerate(counts) if c != 1]
        raise ShardingError(f"shard_parameter({param_name!r}): {sharding_spec!r} gives ranks "
                            f"{bad} {[counts[r] for r in bad]} shards; a parameter needs "
                            "exactly one shard on every rank")
    local = nn.Parameter(st.local_tensor(), requires_grad=param.requires_grad)
    module._parameters[param_name] = local
    st._local_shards = _ParamShards(module, param_name, st.local_shards()[0].metadata)
    object.__setattr__(module, param_name, st)
    if _ATTR not in module.__dict__:
        module.__dict__[_ATTR] = {}
        module.register_state_dict_post_hook(_state_dict_hook)
        module.register_load_state_dict_pre_hook(_load_hook)
    module.__dict__[_ATTR][param_name] = st
    return st


class _ParamShards(Sequence):
    """The one local shard of a sharded parameter: ``module._parameters[name]`` at the moment
    of access, with its box. Holds the module weakly (the module holds the ShardedTensor)."""

    def __init__(self, module: nn.Module, name: str, metadata: ShardMetadata):
        self._module = weakref.ref(module)
        self._name = name
        self._metadata = metadata

    def tensor(self) -> torch.Tensor:
        module = self._module()
        if module is None:
            raise ShardingError(f"the module that held sharded parameter {self._name!r} is gone")
        return module._parameters[self._name]

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(1)[index]]
        if index not in (0, -1):
            raise IndexError(f"a sharded parameter has one local shard, not index {index}")
        t = self.tensor()
        if isinstance(t, DTensor) or tuple(t.shape) != self._metadata.shard_sizes:
            raise ShardingError(
                f"sharded parameter {self._name!r}: its local shard "
                f"{self._metadata.describe()} is sharded further ({type(t).__name__} of local "
                f"size {tuple(getattr(t, '_local_tensor', t).shape)}, e.g. by FSDP over a data "
                "axis); it is whole only while its FSDP unit is gathered (forward, backward, "
                "unshard())")
        return Shard(t, self._metadata)


def _owned_elsewhere(module: nn.Module, name: str) -> bool:
    """The slot holds a DTensor: another mechanism (FSDP x TP) owns its state-dict entry."""
    return isinstance(module._parameters.get(name), DTensor)


def _state_dict_hook(module: nn.Module, state_dict: dict, prefix: str, _meta) -> None:
    for name, st in sharded_parameters(module).items():
        key = prefix + name
        if key in state_dict and not _owned_elsewhere(module, name):
            shards = [Shard(s.tensor.detach(), s.metadata) for s in st.local_shards()]
            state_dict[key] = ShardedTensor._from_parts(shards, st.metadata(),
                                                        st.sharding_spec(), st.process_group)


def _load_hook(module: nn.Module, state_dict: dict, prefix: str, *_rest) -> None:
    for name, st in sharded_parameters(module).items():
        key = prefix + name
        value = state_dict.get(key)
        if value is None or _owned_elsewhere(module, name):
            continue
        state_dict[key] = _local_value(key, value, st)


def _local_value(key: str, value, st: ShardedTensor) -> torch.Tensor:
    mine = st.local_shards()[0].metadata
    if isinstance(value, ShardedTensor):
        theirs = [_box(m) for m in value.metadata().shards_metadata]
        ours = [_box(m) for m in st.metadata().shards_metadata]
        if value.shape != st.shape or theirs != ours:
            raise ShardingError(f"load_state_dict: {key} was saved as {value.sharding_spec()!r} "
                                f"of size {tuple(value.shape)}; the module is sharded as "
                                f"{st.sharding_spec()!r} of size {tuple(st.shape)}")
        return value.local_shards()[0].tensor
    if isinstance(value, torch.Tensor) and value.shape == st.shape:
        return value[mine.region()]
    got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    raise ShardingError(f"load_state_dict: {key} is sharded with global size {tuple(st.shape)};"
                        f" got {got} (give a ShardedTensor or a whole tensor)")


def _box(m) -> tuple:
    return m.shard_offsets, m.shard_sizes, m.rank


def _matching(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    found = [(n, m) for n, m in model.named_modules() if n and fnmatch.fnmatchcase(n, pattern)]
    if not found:
        names = [n for n, _ in model.named_modules() if n][:12]
        raise ShardingError(f"sharding plan entry {pattern!r} matches no module of "
                            f"{type(model).__name__} (module names look like {names})")
    return found


def shard_module(module: nn.Module, plan: Mapping[str, ShardingSpec | Mapping[str, ShardingSpec]],
                 *, gather_output: Iterable[str] = (), src_rank: int = 0,
                 process_group: dist.ProcessGroup | None = None) -> nn.Module:
    """Shard the submodules named by ``plan``'s glob patterns (``"blocks.*.mlp.fc1"``) in place.

    A plan value is a spec for the submodule's ``weight``, or ``{param name: spec}``. For an
    ``nn.Linear`` whose weight is chunked on dim 0 (column-wise), its bias is chunked alike, so
    each rank adds its own slice. ``gather_output`` names modules whose column-wise output is
    all-gathered back to the whole tensor (e.g. the LM head before a dense loss). Returns
    ``module``.
    """
    for pattern, value in plan.items():
        for _, sub in _matching(module, pattern):
            specs = dict(value) if isinstance(value, Mapping) else {"weight": value}
            _add_bias(sub, specs)
            for name, spec in specs.items():
                shard_parameter(sub, name, spec, src_rank, process_group)
    for pattern in gather_output:
        for name, sub in _matching(module, pattern):
            if "weight" not in sharded_parameters(sub):
                raise ShardingError(f"gather_output: {name} has no sharded weight")
            sub.register_forward_hook(_gather_hook)
    return module


def _add_bias(sub: nn.Module, specs: dict) -> None:
    spec = specs.get("weight")
    if (isinstance(sub, nn.Linear) and sub.bias is not None and "bias" not in specs
            and isinstance(spec, ChunkShardingSpec) and spec.dim in (0, -2)):
        specs["bias"] = ChunkShardingSpec(0, spec.placements)


def _gather_hook(module: nn.Module, _inputs, output: torch.Tensor) -> torch.Tensor:
    st = sharded_parameters(module)["weight"]
    world = dist.get_world_size(st.process_group)
    offsets, sizes = [0] * world, [0] * world
    for m in st.metadata().shards_metadata:
        offsets[m.rank], sizes[m.rank] = m.shard_offsets[0], m.shard_sizes[0]
    return comm.gather_from_parallel(output, -1, offsets, sizes, st.process_group)
