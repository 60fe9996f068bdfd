"""Every environment variable read in src/ goes through the readers in distributed/env.py.

The scan parses each file (``ast``, so strings and comments cannot fool it) and reports any use
of ``os.environ`` / ``os.environb`` / ``os.getenv`` outside env.py that is not a write: a write
is an item assigned or deleted (``os.environ[K] = V``, ``del os.environ[K]``) or a call of
``update`` / ``pop`` / ``setdefault`` / ``clear`` whose result is discarded (a statement of its
own). Anything else is a read: ``.get``, ``[K]`` as a value, ``K in os.environ``, ``.copy()``,
``dict(os.environ)``, ``{**os.environ}``, iteration, passing it to a function or as a default.
A child's environment is built from ``env.child_environment()``. ``from os import environ`` and
``from os import getenv`` are refused outright, so a reader cannot hide behind a bare name; ``os``
is recognised under any alias.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from shardwise.distributed.env import EnvError, child_environment, choice_var, is_set, str_var

SRC = Path(__file__).resolve().parents[1] / "src" / "shardwise"
READERS = SRC / "distributed" / "env.py"
_OS_NAMES = {"environ", "environb", "getenv", "getenvb"}
_WRITES = {"update", "pop", "setdefault", "clear"}


def _os_attribute(node: ast.AST, os_names: set[str]) -> str | None:
    """``environ`` for the expression ``os.environ`` (and so on; ``os`` under any alias)."""
    if isinstance(node, ast.Attribute) and node.attr in _OS_NAMES \
            and isinstance(node.value, ast.Name) and node.value.id in os_names:
        return node.attr
    return None


def _is_write(node: ast.Attribute, parents: dict[ast.AST, ast.AST]) -> bool:
    parent = parents.get(node)
    if isinstance(parent, ast.Subscript) and parent.value is node:
        return isinstance(parent.ctx, (ast.Store, ast.Del))
    if isinstance(parent, ast.Attribute) and parent.attr in _WRITES:
        call = parents.get(parent)
        return isinstance(call, ast.Call) and call.func is parent \
            and isinstance(parents.get(call), ast.Expr)
    return False


def raw_reads(source: str, name: str = "<source>") -> list[str]:
    """``name:line what`` for every raw read of the environment in ``source``."""
    tree = ast.parse(source, name)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    os_names = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for a in node.names if a.name == "os"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [f"{name}:{node.lineno} from os import {a.name}" for a in node.names
                      if a.name in _OS_NAMES]
        what = _os_attribute(node, os_names)
        if what and not (what == "environ" and _is_write(node, parents)):
            found.append(f"{name}:{node.lineno} reads os.{what} (use distributed/env.py)")
    return found


def test_no_raw_environment_read_outside_env_py():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        if path != READERS:
            bad += raw_reads(path.read_text(), str(path.relative_to(SRC.parents[1])))
    assert bad == []


def test_env_py_itself_reads_the_environment():
    assert raw_reads(READERS.read_text())  # the scan sees reads where they are meant to be


@pytest.mark.parametrize("line", [
    "x = os.environ.get('A')",
    "x = os.environ['A']",
    "x = os.getenv('A', '1')",
    "x = 'A' in os.environ",
    "x = os.environ.copy()",
    "x = dict(os.environ)",
    "x = {**os.environ, 'A': '1'}",
    "x = [k for k in os.environ]",
    "x = os.environ.pop('A')",
    "subprocess.run(['true'], env=os.environ)",
    "def f(environ=os.environ): pass",
    "from os import environ",
    "from os import getenv as g",
    "x = os.environb[b'A']",
    "import os as o; x = o.environ.get('A')",
])
def test_the_scan_finds_a_raw_read(line):
    assert raw_reads(f"import os\nimport subprocess\n{line}\n")


@pytest.mark.parametrize("line", [
    "os.environ['A'] = '1'",
    "del os.environ['A']",
    "os.environ.update(A='1', B='2')",
    "os.environ.pop('A', None)",
    "os.environ.setdefault('A', '1')",
    "x = 'os.environ.get(\"A\")'  # a string is not a read",
    "environ = {}; x = environ.get('A')  # a dict of one's own is not the environment",
])
def test_the_scan_allows_writes(line):
    assert raw_reads(f"import os\n{line}\n") == []


# -- the readers that replaced the raw reads -------------------------------------------------

def test_str_var_and_is_set_treat_an_empty_value_as_unset(monkeypatch):
    monkeypatch.setenv("SHARDWISE_T_STR", "")
    assert str_var("SHARDWISE_T_STR", "d") == "d" and not is_set("SHARDWISE_T_STR")
    monkeypatch.setenv("SHARDWISE_T_STR", " x ")
    assert str_var("SHARDWISE_T_STR") == " x " and is_set("SHARDWISE_T_STR")
    monkeypatch.delenv("SHARDWISE_T_STR")
    assert str_var("SHARDWISE_T_STR") is None and not is_set("SHARDWISE_T_STR")


def test_choice_var_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv("SHARDWISE_T_CHOICE", " SHM ")
    assert choice_var("SHARDWISE_T_CHOICE", ("tcp", "shm"), "tcp") == "shm"
    monkeypatch.setenv("SHARDWISE_T_CHOICE", "udp")
    with pytest.raises(EnvError, match="^environment variable SHARDWISE_T_CHOICE must be one "
                                       "of tcp, shm, got 'udp'$"):
        choice_var("SHARDWISE_T_CHOICE", ("tcp", "shm"), "tcp")
    monkeypatch.delenv("SHARDWISE_T_CHOICE")
    assert choice_var("SHARDWISE_T_CHOICE", ("tcp", "shm"), "tcp") == "tcp"


def test_child_environment_is_a_copy_with_the_extra_variables(monkeypatch):
    monkeypatch.setenv("SHARDWISE_T_PARENT", "p")
    child = child_environment(SHARDWISE_T_CHILD="c")
    assert child["SHARDWISE_T_PARENT"] == "p" and child["SHARDWISE_T_CHILD"] == "c"
    child["SHARDWISE_T_PARENT"] = "changed"
    assert str_var("SHARDWISE_T_PARENT") == "p" and str_var("SHARDWISE_T_CHILD") is None
