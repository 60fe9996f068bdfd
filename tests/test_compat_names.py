"""The torch names shardwise depends on ([Note: torch compatibility] in src/shardwise/_compat.py):
each resolves on the installed torch, and no module of src/ but _compat.py reaches a private
torch name (or a public one older torch lacks) by itself.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardwise import _compat

SRC = Path(__file__).resolve().parents[1] / "src" / "shardwise"

# What every private name we use is, by the label _compat gives it; a name added to _compat
# must be added here too (test_the_list_here_is_the_list_in_compat), with its reason there.
EXPECTED = {"DTensor", "tree_flatten", "tree_map", "TorchDispatchMode",
            "Variable._execution_engine", "torch._C.Future", "torch._C._nn.linear", "DTensorSpec",
            "TensorMeta", "_StridedShard", "compute_local_shape_and_global_offset",
            "_compute_local_shape_and_global_offset", "_get_default_store",
            "_resolve_process_group", "FSDPModule", "fully_shard",
            "all_gather_single", "reduce_scatter_single", "FakeTensorMode", "FakeTensor",
            "FakeStore", "_current_graph_task_id", "_storage_Use_Count"}


def _release() -> tuple[int, ...]:
    return _compat._release(torch.__version__)


def _module_of(function):
    return sys.modules[function.__module__]


# Private attributes of torch objects, read or written outside _compat (each has a reason in
# _compat.PRIVATE_ATTRIBUTES): the check that this torch still has each.
ATTRIBUTE_CHECKS = {
    ("DTensor", "_local_tensor"):  # the module that defines DTensor's methods uses it
        lambda: "_local_tensor" in inspect.getsource(_module_of(_compat.DTensor.to_local)),
    ("DeviceMesh", "_mesh_dim_names"): lambda: ("self._mesh_dim_names" if isinstance(
        DeviceMesh.mesh_dim_names, property) else "self.mesh_dim_names") in
        inspect.getsource(_module_of(DeviceMesh.__init__)),
    # optional: torch 2.6.0 lacks it, and tp_params then builds the 2D mesh from the groups
    ("DeviceMesh", "_concatenate"):
        lambda: callable(getattr(DeviceMesh, "_concatenate", None)) or _release() < (2, 7),
    # optional: torch 2.11.0 lacks it, and FSDP's buffer pool then lets each gather allocate
    ("UntypedStorage", "_swap_data_ptr_"):
        lambda: hasattr(torch.UntypedStorage, "_swap_data_ptr_") or _release() < (2, 13),
    ("DeviceMesh", "_flatten"): lambda: callable(getattr(DeviceMesh, "_flatten", None)),
    ("ProcessGroup", "_get_sequence_number_for_group"):
        lambda: hasattr(dist.ProcessGroup, "_get_sequence_number_for_group"),
    ("nn.Module", "_parameters / _buffers / _non_persistent_buffers_set"):
        lambda: all(hasattr(nn.Linear(1, 1), a)
                    for a in ("_parameters", "_buffers", "_non_persistent_buffers_set")),
    ("OpOverload", "_schema"): lambda: torch.ops.aten.add.Tensor._schema.name == "aten::add",
    ("UntypedStorage", "_cdata"): lambda: isinstance(torch.empty(1).untyped_storage()._cdata, int),
}

# Private names reached as attributes (not imports) that only _compat may touch.
PRIVATE_ATTRS = {"_execution_engine", "_get_default_store", "_get_sequence_number_for_group",
                 "_concatenate", "_mesh_dim_names", "_cdata", "_flatten"}
# Public names that older torch releases lack (or kept under a private module): through _compat.
NEWER_PUBLIC = {("torch.distributed.tensor", None), ("torch.distributed.fsdp", "fully_shard"),
                ("torch.distributed.fsdp", "FSDPModule")}
TORCH_ALIASES = {"torch", "dist"}  # `import torch`, `import torch.distributed as dist`


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def _chain(node: ast.Attribute) -> list[str] | None:
    """``torch.a._b`` -> ["torch", "a", "_b"]; None when the base is not a plain name."""
    parts = [node.attr]
    value = node.value
    while isinstance(value, ast.Attribute):
        parts.append(value.attr)
        value = value.value
    return [value.id, *reversed(parts)] if isinstance(value, ast.Name) else None


def _import_problem(node: ast.AST) -> str | None:
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.split(".")[0] == "torch" and any(map(_private, alias.name.split("."))):
                return f"import {alias.name}"
    elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
        module = node.module or ""
        for alias in node.names:
            if any(map(_private, module.split("."))) or _private(alias.name):
                return f"from {module} import {alias.name}"
            if (module, None) in NEWER_PUBLIC or (module, alias.name) in NEWER_PUBLIC:
                return f"from {module} import {alias.name} (older torch lacks it)"
    return None


def _attribute_problem(node: ast.AST) -> str | None:
    if not isinstance(node, ast.Attribute):
        return None
    if node.attr in PRIVATE_ATTRS:
        return f".{node.attr}"
    chain = _chain(node)
    if chain and chain[0] in TORCH_ALIASES and any(map(_private, chain[1:])):
        return ".".join(chain)
    return None


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for every private torch name ``source`` reaches by itself."""
    found = []
    for node in ast.walk(ast.parse(source)):
        problem = _import_problem(node) or _attribute_problem(node)
        if problem:
            found.append((node.lineno, problem))
    return found


@pytest.mark.parametrize("label, path, why", _compat.TORCH_NAMES,
                         ids=[entry[0] for entry in _compat.TORCH_NAMES])
def test_each_torch_name_we_depend_on_resolves_on_this_torch(label, path, why):
    assert why, f"{label} needs its reason in _compat"
    value = _RESOLVED[label]  # resolved from path, or from an older spelling after it
    assert value is not None and not isinstance(value, _compat.Missing), \
        f"{label} ({path}) does not resolve on torch {torch.__version__}"


# The object _compat bound for each label (under the name the rest of src/ imports).
_RESOLVED = {
    "DTensor": _compat.DTensor, "tree_flatten": _compat.tree_flatten,
    "tree_map": _compat.tree_map, "TorchDispatchMode": _compat.TorchDispatchMode,
    "Variable._execution_engine": _compat._ENGINE, "torch._C.Future": _compat.FUTURE_TYPE,
    "torch._C._nn.linear": _compat.nn_linear, "DTensorSpec": _compat.DTensorSpec,
    "TensorMeta": _compat.TensorMeta, "_StridedShard": _compat.StridedShard,
    "compute_local_shape_and_global_offset": _compat.compute_local_shape_and_global_offset,
    "_compute_local_shape_and_global_offset": _compat.local_box_at,
    "_get_default_store": _compat._default_store,
    "_resolve_process_group": _compat.resolve_process_group, "FSDPModule": _compat.TorchFSDPModule,
    "fully_shard": _compat._torch_fully_shard, "all_gather_single": _compat.dist_all_gather,
    "reduce_scatter_single": _compat.dist_reduce_scatter,
    "FakeTensorMode": _compat.FakeTensorMode, "FakeTensor": _compat.FakeTensor,
    "FakeStore": _compat.FakeStore, "_current_graph_task_id": _compat._GRAPH_TASK_ID,
    "_storage_Use_Count": _compat.storage_use_count,
}


def test_the_list_here_is_the_list_in_compat():
    assert {label for label, _, _ in _compat.TORCH_NAMES} == EXPECTED == set(_RESOLVED)
    assert {(c, a) for c, a, _ in _compat.PRIVATE_ATTRIBUTES} == set(ATTRIBUTE_CHECKS)
    assert all(why for _, _, why in _compat.PRIVATE_ATTRIBUTES)


@pytest.mark.parametrize("key", sorted(ATTRIBUTE_CHECKS), ids=lambda k: f"{k[0]}.{k[1]}")
def test_each_private_attribute_we_use_exists_on_this_torch(key):
    assert ATTRIBUTE_CHECKS[key](), f"{key[0]}.{key[1]} is gone from torch {torch.__version__}"


def test_no_module_but_compat_reaches_a_private_torch_name():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "_compat.py" and path.parent == SRC:
            continue
        rel = path.relative_to(SRC.parent.parent).as_posix()
        bad += [f"{rel}:{line} {what}" for line, what in private_uses(path.read_text())]
    assert not bad, "private torch names outside shardwise/_compat.py:\n" + "\n".join(bad)


@pytest.mark.parametrize("source", [
    "from torch.utils._pytree import tree_map",
    "import torch._dynamo",
    "from torch.distributed.tensor import DTensor",
    "from torch.distributed.fsdp import fully_shard",
    "from torch.distributed.tensor.placement_types import _StridedShard",
    "x = torch._C.Future",
    "dist.distributed_c10d._get_default_store()",
    "torch.autograd.Variable._execution_engine.queue_callback(f)",
    "mesh._mesh_dim_names = None",
])
def test_the_scan_catches_each_kind_of_private_use(source):
    assert private_uses(source), source


def test_the_scan_lets_public_and_dunder_names_through():
    assert not private_uses("import torch\nfrom torch.distributed.device_mesh import DeviceMesh\n"
                            "from torch.distributed.tensor.parallel import ColwiseParallel\n"
                            "v = torch.__version__\nx = self._local\n")


def test_a_missing_optional_name_raises_naming_it_and_the_tested_releases():
    placeholder = _compat._optional("a reason", "torch.no_such_module:thing")
    assert isinstance(placeholder, _compat.Missing)
    with pytest.raises(_compat.TorchCompatError, match="torch.no_such_module:thing") as err:
        placeholder(1)
    assert f"{_compat.TESTED[0]} to {_compat.TESTED[1]}" in str(err.value)
    with pytest.raises(_compat.TorchCompatError, match="no_such_module"):
        _ = placeholder.some_attribute


def test_a_missing_essential_name_raises_at_once():
    with pytest.raises(_compat.TorchCompatError, match="torch.utils:_no_such_name"):
        _compat._essential("a reason", "torch.utils:_no_such_name")


def test_an_older_spelling_is_taken_when_the_newest_is_absent():
    assert _compat._lookup(("torch.no_such:x", "torch.utils._pytree:tree_map")) is \
        _compat.tree_map


@pytest.mark.parametrize("version, inside", [
    (_compat.TESTED[0], True), (_compat.TESTED[1], True), (_compat.TESTED[1] + "+cu126", True),
    ("2.99.0", False), ("1.13.1", False), ("2.15.0.dev20260101", False)])
def test_a_torch_outside_the_tested_range_warns_naming_the_range(version, inside):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compat.warn_if_untested(version)
    assert len(caught) == (0 if inside else 1)
    if not inside:
        text = str(caught[0].message)
        assert f"{_compat.TESTED[0]} to {_compat.TESTED[1]}" in text and version in text


@pytest.mark.slow
def test_importing_shardwise_under_an_untested_torch_warns_once():
    code = ("import warnings; warnings.simplefilter('always')\n"
            "import torch; torch.__version__ = '2.99.0'\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    import shardwise, shardwise.fsdp, shardwise.rpc\n"
            "    import importlib; importlib.import_module('shardwise')\n"
            "print(sum('tested with torch' in str(x.message) for x in w))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip().splitlines()[-1] == "1"


def test_pyproject_readme_and_docs_state_the_tested_range_and_names():
    root = SRC.parent.parent
    floor, newest = _compat.TESTED
    assert f'"torch>={floor}"' in (root / "pyproject.toml").read_text()
    assert f"torch {floor} to {newest}" in " ".join((root / "README.md").read_text().split())
    doc = (root / "docs" / "compat.md").read_text()
    assert f"{floor} to {newest}" in doc
    missing = [label for label, _, _ in _compat.TORCH_NAMES if f"`{label}`" not in doc]
    missing += [f"{c}.{a}" for c, a, _ in _compat.PRIVATE_ATTRIBUTES if f"`{c}.{a}`" not in doc]
    assert not missing, f"docs/compat.md does not list {missing}"
