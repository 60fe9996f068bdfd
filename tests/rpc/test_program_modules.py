"""Rule 2 of [Note: allow-list] (rpc/trust/callables.py): the program's own modules resolve like
``__main__`` (issue 26.4), and nothing else does because of it.

A module of the program is one already imported whose file, links resolved, lies under the
script's directory or init_rpc's working directory and not under the interpreter's trees
(site-packages included) nor in shardwise or torch. Each test below sets the program's root to
a temporary directory and imports modules from it, from a site-packages directory inside it,
through a link and from outside it.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys

import numpy as np
import pytest
import torch

import shardwise
import shardwise.checkpoint
from shardwise.rpc.trust import callables
from shardwise.rpc.trust.callables import ForbiddenCallable, resolve, resolve_global
from shardwise.rpc.trust.methods import ForbiddenMethod, resolve_method

SIBLING = '''
import os
from os import system
import numpy as np
from torch import save, nn

def double(x):
    return 2 * x

class Net(nn.Module):
    borrowed = save  # a library function in the class body: not the class's own method

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        return self.lin(x)

    def scale(self, x):
        return 3 * x

class Plain:
    def get(self):
        return 1
'''
WRITES = "def save(path):\n    open(path, 'w').close()\n"


@pytest.fixture
def program(tmp_path, monkeypatch):
    """A program root with ``h1prog_sibling`` (the program's module), a site-packages inside
    it, a link to a library file, a module outside the root and one never imported."""
    root, outside = tmp_path / "prog", tmp_path / "elsewhere"
    lib = root / ".venv" / "lib" / "python3" / "site-packages"
    for d in (root, outside, lib):
        d.mkdir(parents=True)
    (root / "h1prog_sibling.py").write_text(SIBLING)
    (root / "h1prog_unimported.py").write_text(WRITES)
    (lib / "h1prog_vendored.py").write_text(WRITES)
    (lib / "h1prog_target.py").write_text(WRITES)
    (root / "h1prog_linked.py").symlink_to(lib / "h1prog_target.py")
    (outside / "h1prog_outside.py").write_text(WRITES)
    for d in (root, lib, outside):
        monkeypatch.syspath_prepend(str(d))
    monkeypatch.setattr(callables, "_program", dict(callables._program))
    monkeypatch.setattr(callables, "_program_modules", {})
    callables.set_program_roots([str(root)])
    names = ("h1prog_sibling", "h1prog_vendored", "h1prog_linked", "h1prog_outside")
    mods = {n: importlib.import_module(n) for n in names}
    yield mods
    for n in (*names, "h1prog_target", "h1prog_unimported"):
        sys.modules.pop(n, None)


def test_program_module_resolves_its_own_definitions(program):
    sibling = program["h1prog_sibling"]
    assert resolve("h1prog_sibling:double") is sibling.double
    assert resolve("h1prog_sibling:Net") is sibling.Net
    assert resolve("h1prog_sibling:Net.scale") is sibling.Net.scale
    assert callables.is_allowed_class(sibling.Net)
    net = sibling.Net()
    assert torch.equal(resolve_method(net, "scale")(torch.ones(1)), torch.full((1,), 3.0))
    assert resolve_method(net, "forward")(torch.ones(1, 2)).shape == (1, 2)
    assert resolve_method(sibling.Plain(), "get")() == 1


def test_names_a_program_module_imported_stay_refused(program):
    for name in ("os", "os.system", "system", "save", "np", "np.load", "nn", "Net.borrowed",
                 "double.__globals__", "Net.__init__", "__builtins__", "Net.mro"):
        with pytest.raises(ForbiddenCallable):
            resolve(f"h1prog_sibling:{name}")
    with pytest.raises(ForbiddenCallable):
        resolve_global("h1prog_sibling.os", "system")
    with pytest.raises(ForbiddenMethod, match="borrowed"):  # torch.save in the class body
        resolve_method(program["h1prog_sibling"].Net(), "borrowed")


def test_library_site_packages_links_and_outside_modules_are_not_the_program(program,
                                                                             tmp_path):
    for module in ("h1prog_vendored", "h1prog_linked", "h1prog_outside"):
        assert program[module].save is not None  # imported, and it defines save(path)
        with pytest.raises(ForbiddenCallable, match="never resolves"):
            resolve(f"{module}:save")
    # a module of the program that nobody imported is not imported because a peer named it
    with pytest.raises(ForbiddenCallable):
        resolve("h1prog_unimported:save")
    assert "h1prog_unimported" not in sys.modules
    assert list(tmp_path.glob("**/marker*")) == []


@pytest.mark.parametrize("func", [np.load, np.save, np.fromfile, np.ndarray.tofile,
                                  np.ndarray.dump, torch.save, torch.load,
                                  torch.serialization.save, torch.UntypedStorage.from_file,
                                  os.system, shutil.rmtree, shardwise.checkpoint.save,
                                  importlib.import_module],
                         ids=lambda f: f"{getattr(f, '__module__', '?')}.{f.__qualname__}")
def test_library_functions_stay_refused_whatever_the_root(program, func):
    """Even with the filesystem, the checkout (which holds the venv) and the interpreter's
    prefix as roots, library code is not the program's."""
    module = getattr(func, "__module__", None) or "numpy"
    for roots in ([os.sep], [callables.program_roots()[0]], [os.getcwd()],
                  [os.path.dirname(sys.prefix)], [os.path.dirname(shardwise.__file__)]):
        callables.set_program_roots(roots)
        with pytest.raises(ForbiddenCallable):
            resolve_global(module, func.__qualname__)
        with pytest.raises(ForbiddenCallable):
            resolve_global("numpy", func.__qualname__)


def test_program_roots_are_the_script_dir_and_cwd_never_library_trees(monkeypatch, tmp_path):
    monkeypatch.setattr(callables, "_program", dict(callables._program))
    monkeypatch.setattr(callables, "_program_modules", {})
    script = tmp_path / "app" / "train.py"
    script.parent.mkdir()
    script.write_text("")
    monkeypatch.setattr(sys.modules["__main__"], "__file__", str(script), raising=False)
    monkeypatch.chdir(tmp_path)
    callables.set_program_roots()
    assert set(callables.program_roots()) == {os.path.realpath(script.parent),
                                              os.path.realpath(tmp_path)}
    callables.set_program_roots([os.sep, sys.prefix, os.path.dirname(torch.__file__)])
    assert callables.program_roots() == ()
