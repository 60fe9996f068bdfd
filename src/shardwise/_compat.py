"""Every torch name shardwise uses that is private, or that older torch releases lack.

[Note: torch compatibility]
torch renames and moves its private names between releases (``torch.distributed._tensor``
became the public ``torch.distributed.tensor``; the flat collectives got new names). Each such
name is resolved here, once, with the reason we need it; the rest of ``src/`` imports it from
this module (``tests/test_compat_names.py`` fails on a private torch import anywhere else, and
checks that every name below resolves on the installed torch). Where releases differ, the
resolver picks the name of the running release.

A name that the core needs (every import of shardwise reaches it) is resolved at import: a torch
without it fails there, with a ``TorchCompatError`` naming the name and the tested releases. A
name used by one optional feature resolves to a ``Missing`` placeholder that raises the same
error when the feature first uses it. Importing shardwise under a torch outside ``TESTED`` warns
once (the import itself), naming the tested range; docs/compat.md lists the runs behind it.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist

# The torch releases whose default test suite passes (docs/compat.md): (floor, ceiling).
TESTED = ("2.11.0", "2.14.1")


class TorchCompatError(ImportError):
    """A torch name shardwise needs is absent from the installed torch."""


def _known() -> str:
    return f"torch {TESTED[0]} to {TESTED[1]} are known to work"


def _missing_message(name: str, why: str) -> str:
    return (f"shardwise needs {name} ({why}), which torch {torch.__version__} does not have; "
            f"{_known()}")


class Missing:
    """Placeholder for an optional private name this torch lacks: any use raises."""

    def __init__(self, name: str, why: str) -> None:
        self._message = _missing_message(name, why)

    def _fail(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TorchCompatError(self._message)

    __call__ = _fail

    def __getattr__(self, attr: str) -> NoReturn:
        if attr.startswith("__"):
            raise AttributeError(attr)
        self._fail()

    def __bool__(self) -> bool:
        return False


def _lookup(paths: tuple[str, ...]) -> Any:
    """The first of ``module:attr.attr`` paths that resolves; None if none does."""
    for path in paths:
        module_name, _, attrs = path.partition(":")
        try:
            value: Any = importlib.import_module(module_name)
            for attr in attrs.split(".") if attrs else ():
                value = getattr(value, attr)
        except (ImportError, AttributeError):
            continue
        return value
    return None


def _essential(why: str, *paths: str) -> Any:
    value = _lookup(paths)
    if value is None:
        raise TorchCompatError(_missing_message(paths[0], why))
    return value


def _optional(why: str, *paths: str) -> Any:
    value = _lookup(paths)
    return Missing(paths[0], why) if value is None else value


# Each name below is resolved by _name from its paths (the newest spelling first, older ones
# after). TORCH_NAMES feeds tests/test_compat_names.py and docs/compat.md: (the name as
# shardwise uses it, the newest path, the reason we need it).
TORCH_NAMES: list[tuple[str, str, str]] = []


def _name(label: str, why: str, *paths: str, essential: bool = True) -> Any:
    TORCH_NAMES.append((label, paths[0], why))
    return (_essential if essential else _optional)(why, *paths)


# --- DTensor: public from torch 2.5 as torch.distributed.tensor; torch.distributed._tensor before
_WHY_DTENSOR = "FSDP2 parameters and state dicts are DTensors, as in torch"
_DTENSOR_MODULE = next((m for m in ("torch.distributed.tensor", "torch.distributed._tensor")
                        if _lookup((f"{m}:DTensor",)) is not None), "torch.distributed.tensor")
DTensor = _name("DTensor", _WHY_DTENSOR, f"{_DTENSOR_MODULE}:DTensor")
Shard = _essential(_WHY_DTENSOR, f"{_DTENSOR_MODULE}:Shard")
Replicate = _essential(_WHY_DTENSOR, f"{_DTENSOR_MODULE}:Replicate")
Partial = _essential(_WHY_DTENSOR, f"{_DTENSOR_MODULE}:Partial",
                     f"{_DTENSOR_MODULE}.placement_types:_Partial")
Placement = _essential(_WHY_DTENSOR, f"{_DTENSOR_MODULE}:Placement")

# --- private names, each with the reason shardwise needs it
tree_flatten = _name(
    "tree_flatten", "FSDP finds the tensors in a module's nested inputs and outputs",
    "torch.utils._pytree:tree_flatten")
tree_map = _name(
    "tree_map", "FSDP casts the tensors in nested inputs (mixed precision)",
    "torch.utils._pytree:tree_map")
TorchDispatchMode = _name(
    "TorchDispatchMode", "CommCounter counts the collectives a block of code runs by watching "
    "torch's dispatcher", "torch.utils._python_dispatch:TorchDispatchMode")
_ENGINE = _name(
    "Variable._execution_engine", "DDP and FSDP run their end-of-backward step (wait for the "
    "last reduction) as an autograd engine callback, as torch's DDP does",
    "torch.autograd:Variable._execution_engine")
_GRAPH_TASK_ID = _name(
    "_current_graph_task_id", "DDP and FSDP tell a forward run inside backward (an activation "
    "checkpoint's recompute) from the first forward after a backward that raised; FSDP tells "
    "one backward pass from the next where a unit's inputs get their gradients",
    "torch._C:_current_graph_task_id")
FUTURE_TYPE: type = _name(
    "torch._C.Future", "the base class of torch.futures.Future and of what .then() and "
    "collect_all return; comm hooks and async RPC functions accept either",
    "torch._C:Future")
nn_linear = _name(
    "torch._C._nn.linear", "ShardedTensor's linear is registered for F.linear's C entry point, "
    "which nn.Linear calls directly", "torch._C._nn:linear")
DTensorSpec = _name(
    "DTensorSpec", "FSDP over tensor parallelism builds a DTensor with 2D placements without "
    "a collective", f"{_DTENSOR_MODULE}._dtensor_spec:DTensorSpec",
    f"{_DTENSOR_MODULE}.placement_types:DTensorSpec", essential=False)
TensorMeta = _name(
    "TensorMeta", "the shape/stride/dtype record a DTensorSpec carries",
    f"{_DTENSOR_MODULE}._dtensor_spec:TensorMeta",
    f"{_DTENSOR_MODULE}.placement_types:TensorMeta", essential=False)
StridedShard = _name(
    "_StridedShard", "torch's placement for FSDP over tensor parallelism on the same dim "
    "(our 2D layouts and checkpoints read and write it)",
    f"{_DTENSOR_MODULE}.placement_types:_StridedShard", essential=False)
compute_local_shape_and_global_offset = _name(
    "compute_local_shape_and_global_offset", "a DTensor's local box (shape and offset in the "
    "global tensor) for checkpoints, computed as torch's DCP does",
    f"{_DTENSOR_MODULE}._utils:compute_local_shape_and_global_offset", essential=False)
local_box_at = _name(
    "_compute_local_shape_and_global_offset", "the box a DTensor's local tensor has on a given "
    "mesh coordinate: the checkpoint's save plan, and its dry run for every rank of a world",
    f"{_DTENSOR_MODULE}._utils:_compute_local_shape_and_global_offset", essential=False)
_default_store = _name(
    "_get_default_store", "RPC's rendezvous reuses the default process group's TCPStore "
    "(one MASTER_PORT for init_process_group and init_rpc, as torch)",
    "torch.distributed.distributed_c10d:_get_default_store", essential=False)
resolve_process_group = _name(
    "_resolve_process_group", "CommCounter finds the group a functional collective names by "
    "its group name", "torch.distributed.distributed_c10d:_resolve_process_group",
    essential=False)
TorchFSDPModule = _name(
    "FSDPModule", "our FSDPModule subclasses torch's so isinstance checks in third-party code "
    "hold", "torch.distributed.fsdp:FSDPModule",
    "torch.distributed._composable.fsdp:FSDPModule")
_torch_fully_shard = _name(
    "fully_shard", "benchmarks and compat tests run torch's FSDP2 beside ours",
    "torch.distributed.fsdp:fully_shard", "torch.distributed._composable.fsdp:fully_shard",
    essential=False)
FakeTensorMode = _name(
    "FakeTensorMode", "`shardwise plan --simulate` runs the library's own code on tensors that "
    "have shapes and no bytes", "torch._subclasses.fake_tensor:FakeTensorMode", essential=False)
FakeTensor = _name(
    "FakeTensor", "the dry run tells its tensors from real ones (byte accounting, counting)",
    "torch._subclasses.fake_tensor:FakeTensor", essential=False)
FakeStore = _name(
    "FakeStore", "the dry run's process group: torch's fake backend (registered when its "
    "module is imported), whose collectives complete without moving data",
    "torch.testing._internal.distributed.fake_pg:FakeStore", essential=False)
storage_use_count = _name(
    "_storage_Use_Count", "FSDP reuses a unit's reduced-gradient buffer from step to step only "
    "when nothing else holds its storage (optional: without it, each step allocates)",
    "torch._C:_storage_Use_Count", essential=False)
# torch 2.13 added all_gather_single / reduce_scatter_single, deprecating the older names
dist_all_gather = _name(
    "all_gather_single", "the flat all-gather of ZeRO and FSDP (the older name warns from 2.13)",
    "torch.distributed:all_gather_single", "torch.distributed:all_gather_into_tensor")
dist_reduce_scatter = _name(
    "reduce_scatter_single", "the flat reduce-scatter of ZeRO and FSDP (the older name warns "
    "from 2.13)", "torch.distributed:reduce_scatter_single",
    "torch.distributed:reduce_scatter_tensor")

# Private attributes of torch objects that shardwise reads or writes (the helpers below, and
# DTensor and nn.Module internals in fsdp/), each checked by tests/test_compat_names.py.
PRIVATE_ATTRIBUTES: list[tuple[str, str, str]] = [
    ("DTensor", "_local_tensor", "FSDP and checkpoints read and swap a DTensor parameter's "
     "local shard in place, without the autograd view to_local() makes"),
    ("DeviceMesh", "_mesh_dim_names", "a mesh built from several groups drops the placeholder "
     "names from_group requires (2.6.0: the plain attribute mesh_dim_names)"),
    ("DeviceMesh", "_concatenate", "FSDP over TP joins a dp and a tp slice into one 2D mesh "
     "when they come from one mesh (optional: without it, from the groups; 2.6.0 lacks it)"),
    ("DeviceMesh", "_flatten", "fully_shard's dp_mesh_dims joins several data-parallel mesh "
     "dimensions into one, as torch's fully_shard does"),
    ("ProcessGroup", "_get_sequence_number_for_group", "the launcher's progress records count "
     "the collectives a rank has entered"),
    ("nn.Module", "_parameters / _buffers / _non_persistent_buffers_set", "FSDP swaps "
     "parameters in place and builds state dicts as nn.Module does"),
    ("OpOverload", "_schema", "CommCounter reads a collective's name off the op (its .name)"),
    ("UntypedStorage", "_cdata", "the byte accounting tells a fake tensor's storages apart "
     "(they have no data pointer)"),
    ("UntypedStorage", "_swap_data_ptr_", "FSDP's unshard buffer pool hands a unit's gathered "
     "memory to the next unit without freeing it (optional: without it, each gather allocates; "
     "2.11.0 lacks it)"),
]


def queue_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward pass now running has finished (call during backward)."""
    _ENGINE.queue_callback(callback)


def current_backward() -> int:
    """The id of the backward pass running on this thread (-1: none)."""
    return _GRAPH_TASK_ID()


def backward_running() -> bool:
    """Whether autograd's engine is running a backward pass on this thread right now."""
    return current_backward() != -1


def default_store() -> dist.Store:
    """The store the default process group rendezvoused through."""
    return _default_store()


def concatenate_meshes(meshes: list[Any]) -> Any:
    """``DeviceMesh._concatenate(meshes)``; a torch without it raises AttributeError."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh._concatenate(meshes)


def flatten_mesh(mesh: Any) -> Any:
    """``mesh._flatten()``: one dimension over all of ``mesh``'s ranks, made once per mesh."""
    return mesh._flatten()


def storage_uses(t: torch.Tensor) -> int | None:
    """References to ``t``'s storage right now (tensors, views, storage slices, each one); None
    where torch cannot count them."""
    if not storage_use_count:
        return None
    return int(storage_use_count(t.untyped_storage()._cdata))


def storage_id(storage: torch.UntypedStorage) -> int:
    """An identity of ``storage`` that a fake tensor's storage has too (it has no data pointer)."""
    return int(storage._cdata)


def sequence_number(group: dist.ProcessGroup) -> int:
    """Collectives entered on ``group`` so far (AttributeError on a torch without the count)."""
    return int(group._get_sequence_number_for_group())


def clear_mesh_dim_names(mesh: Any) -> None:
    """Drop the dim names of a mesh (torch's public API cannot unname one)."""
    if isinstance(getattr(type(mesh), "mesh_dim_names", None), property):
        mesh._mesh_dim_names = None  # a read-only property over _mesh_dim_names (2.13.0)
    else:
        mesh.mesh_dim_names = None  # a plain attribute (2.6.0)


def torch_fully_shard() -> Callable[..., Any]:
    """torch's own FSDP2 ``fully_shard`` (benchmarks and compat tests compare against it)."""
    if isinstance(_torch_fully_shard, Missing):
        _torch_fully_shard()  # raises TorchCompatError
    return _torch_fully_shard


def _release(version: str) -> tuple[int, ...]:
    """``"2.14.1+cu126"`` -> ``(2, 14, 1)``; pre-releases count as their release."""
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts)


def in_tested_range(version: str) -> bool:
    return _release(TESTED[0]) <= _release(version) <= _release(TESTED[1])


def warn_if_untested(version: str = torch.__version__) -> None:
    """Warn under a torch outside ``TESTED``."""
    if not in_tested_range(version):
        warnings.warn(f"shardwise is tested with torch {TESTED[0]} to {TESTED[1]}; torch "
                      f"{version} is outside that range (docs/compat.md)", stacklevel=3)


_warned = False  # whether this process has warned about its torch version


def warn_once_if_untested() -> None:
    """``warn_if_untested``, at most one warning per process. It runs when this module is
    first imported (every mechanism that uses torch imports it, so importing
    ``shardwise.fsdp`` directly checks too) and on the first public name looked up through
    the lazy ``shardwise`` package."""
    global _warned
    if not _warned and not in_tested_range(torch.__version__):
        _warned = True
        warn_if_untested()


warn_once_if_untested()
