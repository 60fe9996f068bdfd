"""The layering of the design document's "Layout" (../shared/DESIGN.md, beside the checkout),
checked on every import in src/ (top-level and inside functions): nothing imports
``shardwise.cli`` but the command's entry point; ``distributed/`` imports no other shardwise
package (not ``launch/``, no mechanism); ``launch/`` imports only ``distributed/``; each mechanism
imports only ``distributed/`` and the mechanisms below it in ALLOWED; ``models/`` and ``data/``
serve the CLI, tests and benchmarks, never a mechanism.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "shardwise"

# What each subpackage of src/shardwise may import from the others (its own files aside).
# Bottom to top: distributed; the launcher (launch) and the data-parallel core (dp) beside
# the leaf mechanisms; zero (over ddp: DDP + ZeRO stage 1); fsdp (may use sharded tensors for 2D
# layouts, and memory's heap release); pipeline (stages over rpc, replicated with ddp or
# sharded with fsdp); checkpoint (saves and reshards every strategy's state).
ALLOWED: dict[str, set[str]] = {
    "distributed": set(),
    "launch": {"distributed"},
    "dp": {"distributed"},
    "models": set(),
    "data": set(),
    "memory": {"distributed"},
    "sharded_tensor": {"distributed"},
    "rpc": {"distributed", "dp"},
    "ddp": {"distributed", "dp"},
    # zero raises the C heap's thresholds so freed gradients' pages stay resident (memory/heap.py)
    "zero": {"distributed", "dp", "ddp", "memory"},
    # fsdp returns the C heap's free pages to the OS once per backward (memory/heap.py)
    "fsdp": {"distributed", "dp", "memory", "sharded_tensor"},
    "pipeline": {"distributed", "rpc", "ddp", "fsdp"},
    "checkpoint": {"distributed", "ddp", "zero", "fsdp", "sharded_tensor"},
    # a tool beside the CLI (`shardwise bench`): runs every mechanism on the demo models
    "bench": {"distributed", "dp", "launch", "models", "data", "memory", "sharded_tensor",
              "rpc", "ddp", "zero", "fsdp", "pipeline", "checkpoint"},
    # a tool beside the CLI (`shardwise plan --simulate`): dry runs of the mechanisms
    "sim": {"distributed", "dp", "models", "memory", "sharded_tensor", "ddp", "zero", "fsdp",
            "checkpoint"},
    # glue for training frameworks (optional extras): the public API ("" is the package's
    # __init__) and the mechanisms; nothing in src imports it (test below)
    "integrations": {"", "distributed", "dp", "ddp", "zero", "fsdp", "checkpoint"},
}
MECHANISMS = set(ALLOWED) - {"distributed", "launch", "models", "data", "bench", "sim",
                             "integrations"}
ENTRY_POINT = "__main__.py"  # `python -m shardwise` is the command: it may import the CLI


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file; relative imports are refused."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                found.append((node.lineno, "<relative import>"))
            else:
                found.append((node.lineno, node.module or ""))
                found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                          if node.module == "shardwise"]
    return found


def _package(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "shardwise":
        return None
    return parts[1] if len(parts) > 1 else ""


def _violations(root: Path = SRC) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        here = rel.parts[0] if len(rel.parts) > 1 else ""
        for line, module in _imports(path):
            where = f"src/shardwise/{rel.as_posix()}:{line} imports {module}"
            if module == "<relative import>":
                bad.append(f"{where} (use absolute imports)")
                continue
            target = _package(module)
            if target is None or target == here or target in ("_compat", "_lazy"):  # for all
                continue
            if target == "cli" and str(rel) != ENTRY_POINT:
                bad.append(f"{where}: nothing imports the CLI")
            elif here in ALLOWED and target not in ALLOWED[here]:
                bad.append(f"{where}: {here}/ may import only {sorted(ALLOWED[here])}")
    return bad


def test_layering_holds():
    assert _violations() == []


def test_distributed_uses_nothing_above_it_and_the_launcher_only_distributed():
    assert ALLOWED["distributed"] == set()
    assert ALLOWED["launch"] == {"distributed"}
    assert not [pkg for pkg in MECHANISMS if "launch" in ALLOWED[pkg]], "no mechanism starts ranks"


@pytest.mark.parametrize("here,line,allowed", [
    ("distributed", "from shardwise.launch import launch", False),
    ("distributed", "import shardwise.ddp.data_parallel", False),
    ("distributed", "from shardwise import rpc", False),
    ("launch", "from shardwise.checkpoint import save", False),
    ("launch", "from shardwise.distributed.env import int_var", True),
    ("ddp", "from shardwise.launch.progress import SCOPE", False),
])
def test_the_check_refuses_an_import_the_graph_does_not_allow(tmp_path, here, line, allowed):
    (tmp_path / here).mkdir()
    (tmp_path / here / "m.py").write_text(f"def f():\n    {line}\n")
    assert (_violations(tmp_path) == []) == allowed


def test_every_subpackage_has_a_place_in_the_graph():
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages - {"cli"} == set(ALLOWED), "add the new subpackage to ALLOWED"


def test_the_graph_has_no_cycle_and_no_mechanism_uses_models_or_data():
    for mech in MECHANISMS:
        assert not ALLOWED[mech] & {"models", "data", "cli"}

    def visit(pkg: str, path: tuple[str, ...]) -> None:
        assert pkg not in path, f"cycle: {' -> '.join(path + (pkg,))}"
        for dep in ALLOWED.get(pkg, ()):  # "" (the public API) is above the graph
            visit(dep, path + (pkg,))

    for pkg in ALLOWED:
        visit(pkg, ())


@pytest.mark.parametrize("module,line", [("shardwise.cli.main", "import shardwise.cli.main"),
                                         ("shardwise.cli", "from shardwise import cli")])
def test_the_check_sees_an_import_of_the_cli(tmp_path, module, line):
    path = tmp_path / "m.py"
    path.write_text(f"def f():\n    {line}\n")
    assert any(_package(m) == "cli" for _, m in _imports(path))


DOCS = Path(__file__).resolve().parents[1] / "docs"
README = Path(__file__).resolve().parents[1] / "README.md"
NOTES = {"dp": "data_parallel.md", "ddp": "ddp.md", "zero": "zero.md",
         "fsdp": "fsdp.md", "sharded_tensor": "sharded_tensor.md", "pipeline": "pipeline.md",
         "rpc": "rpc.md", "checkpoint": "checkpoint.md"}


def test_each_mechanism_has_a_design_note_linked_from_the_readme():
    readme = README.read_text()
    for package, note in {**NOTES, "launcher": "launcher.md"}.items():
        assert (DOCS / note).is_file(), f"{package}: docs/{note} is missing"
        assert f"](docs/{note})" in readme, f"README does not link docs/{note}"


def test_no_code_points_outside_the_repository_for_its_notes():
    for path in SRC.rglob("*.py"):
        assert "shared/notes" not in path.read_text(), path


def test_the_data_parallel_core_knows_no_mechanism():
    """dp/ holds what DDP, ZeRO and FSDP share; their own rules plug into it as policies, so it
    imports none of them (nor rpc/, which hands it gradients)."""
    core = SRC / "dp"
    bad = [f"dp/{path.relative_to(core).as_posix()}:{line} imports {module}"
           for path in sorted(core.rglob("*.py")) for line, module in _imports(path)
           if _package(module) in {"ddp", "zero", "fsdp", "rpc"}]
    assert bad == []


def test_the_core_check_sees_a_mechanism_import(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from shardwise.ddp.unused import UnusedMap\n")
    assert [_package(m) for _, m in _imports(path)] == ["ddp"]


def test_nothing_in_src_imports_the_integrations():
    """shardwise.integrations.* import optional frameworks; the library never reaches them."""
    bad = [f"{path.relative_to(SRC).as_posix()}:{line} imports {module}"
           for path in sorted(SRC.rglob("*.py")) if path.relative_to(SRC).parts[0] !=
           "integrations" for line, module in _imports(path)
           if _package(module) == "integrations"]
    assert bad == []


@pytest.mark.parametrize("line,allowed", [
    ("import shardwise", True),
    ("from shardwise.ddp.data_parallel import DistributedDataParallel", True),
    ("from shardwise.cli.main import main", False),
    ("from shardwise.bench import ddp", False),
    ("from shardwise.models import GPT", False),
])
def test_the_integrations_use_the_public_api_and_mechanisms_only(tmp_path, line, allowed):
    (tmp_path / "integrations").mkdir()
    (tmp_path / "integrations" / "m.py").write_text(f"def f():\n    {line}\n")
    assert (_violations(tmp_path) == []) == allowed


# torch.distributed's collectives and point-to-point calls: inside fsdp/, only its communication
# module calls them (fsdp/collectives.py: each function says what it sends and why)
COLLECTIVES = {"all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce",
               "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast",
               "broadcast_object_list", "gather", "gather_object", "irecv", "isend",
               "monitored_barrier", "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor",
               "scatter", "scatter_object_list", "send", "_all_gather_base",
               "_reduce_scatter_base"}
FSDP_COMMUNICATION = {"collectives.py"}


def _collective_calls(path: Path) -> list[str]:
    """``line: name`` of each use of a torch.distributed collective in the file: calls through
    an alias of the module (``import torch.distributed as dist``, ``from torch import
    distributed``) or its full name, and names imported from it."""
    tree = ast.parse(path.read_text(), str(path))
    aliases, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            found += [f"{node.lineno}: {a.name}" for a in node.names if a.name in COLLECTIVES]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            owner = ast.unparse(node.value)
            if owner in aliases or owner == "torch.distributed":
                found.append(f"{node.lineno}: {owner}.{node.attr}")
    return found


def _fsdp_collective_violations(root: Path = SRC / "fsdp") -> list[str]:
    return [f"fsdp/{path.relative_to(root).as_posix()}:{call}"
            for path in sorted(root.rglob("*.py")) if path.relative_to(root).as_posix()
            not in FSDP_COMMUNICATION for call in _collective_calls(path)]


def test_inside_fsdp_only_the_communication_module_calls_collectives():
    assert _fsdp_collective_violations() == []


@pytest.mark.parametrize("source,calls", [
    ("import torch.distributed as dist\ndef f(t):\n    dist.all_reduce(t)\n", 1),
    ("import torch.distributed as c10d\ndef f(t):\n    return c10d.isend(t, 1)\n", 1),
    ("import torch\ndef f(t):\n    torch.distributed.barrier()\n", 1),
    ("from torch import distributed\ndef f(t):\n    distributed.broadcast(t, 0)\n", 1),
    ("from torch.distributed import all_gather\n", 1),
    ("import torch.distributed as dist\ndef f(g):\n    return dist.get_world_size(g)\n", 0),
])
def test_the_collective_check_sees_each_way_of_calling_one(tmp_path, source, calls):
    (tmp_path / "collectives.py").write_text(source)  # the communication module may
    (tmp_path / "fsdp1").mkdir()
    (tmp_path / "fsdp1" / "m.py").write_text(source)  # any other file may not
    assert len(_fsdp_collective_violations(tmp_path)) == calls


# The same-host layer (distributed/host/): only its segment module creates shared-memory
# segments (a ``mmap`` of a shared file, or a path in /dev/shm), and only its libc module binds
# the C library through ``ctypes``; every mechanism keeps its own protocol over them.
SEGMENT_MODULE = "distributed/host/segment.py"
LIBC_MODULE = "distributed/host/libc.py"


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (of a module, class or function)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _same_host_uses(path: Path) -> tuple[list[str], list[str]]:
    """(``line: what`` of each segment made, ``line: what`` of each libc binding) in the file:
    a call of ``mmap.mmap`` (or of ``mmap`` imported from it), a path in /dev/shm (assigned or
    passed to a call); an import of ``ctypes`` (binding a library needs it)."""
    tree = ast.parse(path.read_text(), str(path))
    docs, segments, bindings = _docstrings(tree), [], []
    mmap_names = {"mmap.mmap"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "mmap":
            mmap_names |= {a.asname or a.name for a in node.names if a.name == "mmap"}
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "ctypes"
                                                for a in node.names):
            bindings.append(f"{node.lineno}: import ctypes")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ctypes":
            bindings.append(f"{node.lineno}: from ctypes")
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in mmap_names:
            segments.append(f"{node.lineno}: {ast.unparse(node.func)}")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and "/dev/shm" in node.value and id(node) not in docs
              and _used_as_path(node, parents)):
            segments.append(f"{node.lineno}: {node.value!r}")
    return segments, bindings


def _used_as_path(node: ast.AST, parents: dict[int, ast.AST]) -> bool:
    """Whether a string (or the f-string or sum it is part of) is assigned to a name or passed
    to a call: a path about to be opened, not a directory named in a list of them."""
    parent = parents.get(id(node))
    while isinstance(parent, (ast.JoinedStr, ast.FormattedValue, ast.BinOp)):
        node, parent = parent, parents.get(id(parent))
    return isinstance(parent, (ast.Call, ast.Assign, ast.AnnAssign, ast.keyword))


def _same_host_violations(root: Path = SRC) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        segments, bindings = _same_host_uses(path)
        found += [f"{name}:{s} (a shared segment)" for s in segments if name != SEGMENT_MODULE]
        found += [f"{name}:{b} (libc through ctypes)" for b in bindings if name != LIBC_MODULE]
    return found


def test_only_the_same_host_layer_makes_segments_and_binds_libc():
    assert _same_host_violations() == []


@pytest.mark.parametrize("source,kind", [
    ("import mmap\ndef f(fd):\n    return mmap.mmap(fd, 8)\n", "segment"),
    ("from mmap import mmap as m\ndef f(fd):\n    return m(fd, 8)\n", "segment"),
    ("import os\ndef f():\n    return os.open('/dev/shm/x', os.O_RDWR)\n", "segment"),
    ("from pathlib import Path\nDIR = Path('/dev/shm')\n", "segment"),
    ("import ctypes\n", "libc"),
    ("import ctypes.util\n", "libc"),
    ("from ctypes import CDLL\n", "libc"),
    ("import os\ndef f(n):\n    return os.path.join('/dev/shm', n)\n", "segment"),
    ("def f(n):\n    return open(f'/dev/shm/{n}', 'rb')\n", "segment"),
    ("'''Segments live in /dev/shm.'''\nimport mmap\nPAGE = mmap.PAGESIZE\n", None),
    ("ROOTS = {'/tmp', '/dev/shm'}\n", None),
])
def test_the_same_host_check_sees_each_way_of_making_a_segment(tmp_path, source, kind):
    home = {"segment": SEGMENT_MODULE, "libc": LIBC_MODULE, None: "distributed/host/x.py"}
    for module in (home[kind], "dp/m.py"):
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).write_text(source)
    found = _same_host_violations(tmp_path)  # its own module may; any other may not
    assert [v.split(":")[0] for v in found] == (["dp/m.py"] if kind else []), found
    if kind:
        assert ("libc" if kind == "libc" else "segment") in found[0]
