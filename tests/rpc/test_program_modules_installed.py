"""A library under the working directory is not "the program" (issue 46 point 3): rule 2 of
[Note: allow-list] (rpc/trust/callables.py) counts a module as the program's only if its file lies
under the script's directory or the working directory, is part of no installed distribution
(its top-level name provided by none, no ``*.dist-info`` / ``*.egg-info`` in a directory above
it), lies under no ``PYTHONPATH`` entry but the script's own, and the directory is not ``/``, a
home directory or a temporary directory's root.

The attack: a victim started from a directory whose ``PYTHONPATH`` entry holds a library (the
layout ``pip install --target ~/pylibs numpy`` leaves) let a member call that library's
``fromfile`` and ``save`` without registration. Here a fake library of that layout, a vendored
copy of an installed distribution inside the project, and an ``.egg-link`` style editable
project are each refused, while the module beside the script still resolves.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

from shardwise.rpc.trust import callables
from shardwise.rpc.trust.callables import ForbiddenCallable, resolve

LIBRARY = "import os\n\ndef fromfile(path):\n    return open(path, 'rb').read()\n"
MINE = "def double(x):\n    return 2 * x\n"
NAMES = ("h46_mine", "h46_fakenp", "h46_fakenp.io", "h46_bare", "h46_vendlib", "h46_editable",
         "h46_editable.tasks")


def _dist_info(site: Path, name: str, files: list[str]) -> None:
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
    (info / "top_level.txt").write_text(f"{name}\n")


@pytest.fixture
def layout(tmp_path, monkeypatch):
    """``work/`` (the working directory) holding ``proj/`` (the script's directory, with
    ``h46_mine``), ``pylibs/`` (a PYTHONPATH entry: ``h46_fakenp`` with its dist-info, as
    ``pip install --target`` writes it), ``morelibs/`` (another, ``h46_bare`` without a
    dist-info), ``proj/third_party/``
    (a copy of ``h46_vendlib``, which a distribution in ``site/`` provides) and ``editable/``
    (a project with its ``.egg-info``, as ``setup.py develop`` leaves it)."""
    work = tmp_path / "work"
    proj, pylibs, vendor = work / "proj", work / "pylibs", work / "proj" / "third_party"
    bare = work / "morelibs"
    site, editable = tmp_path / "site", work / "editable"
    for d in (proj, bare, pylibs / "h46_fakenp", vendor / "h46_vendlib", site / "h46_vendlib",
              editable / "h46_editable", editable / "h46_editable.egg-info"):
        d.mkdir(parents=True)
    (proj / "h46_mine.py").write_text(MINE)
    (pylibs / "h46_fakenp" / "__init__.py").write_text("")
    (pylibs / "h46_fakenp" / "io.py").write_text(LIBRARY)
    _dist_info(pylibs, "h46_fakenp", ["h46_fakenp/__init__.py", "h46_fakenp/io.py"])
    (bare / "h46_bare.py").write_text(LIBRARY)
    (vendor / "h46_vendlib" / "__init__.py").write_text(LIBRARY)
    (site / "h46_vendlib" / "__init__.py").write_text(LIBRARY)
    _dist_info(site, "h46_vendlib", ["h46_vendlib/__init__.py"])
    (editable / "h46_editable" / "__init__.py").write_text("")
    (editable / "h46_editable" / "tasks.py").write_text(LIBRARY)
    for d in (site, editable, vendor, bare, pylibs, proj):  # the vendored copy ahead of site's
        monkeypatch.syspath_prepend(str(d))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(pylibs), str(bare), str(proj)]))
    monkeypatch.chdir(work)
    for name in ("_program", "_program_modules", "_metadata_dirs"):
        monkeypatch.setattr(callables, name, type(getattr(callables, name))(
            getattr(callables, name)))
    callables.set_program_roots([str(proj), str(work)], script_dir=str(proj))
    mods = {n: importlib.import_module(n) for n in NAMES}
    yield work, mods
    for n in NAMES:
        sys.modules.pop(n, None)


def test_the_module_beside_the_script_is_the_program(layout):
    _, mods = layout
    assert resolve("h46_mine:double") is mods["h46_mine"].double


@pytest.mark.parametrize(("name", "why"), [
    ("h46_fakenp.io:fromfile", r"lies under the PYTHONPATH entry \S+pylibs"),
    ("h46_bare:fromfile", r"lies under the PYTHONPATH entry \S+morelibs"),
    ("h46_vendlib:fromfile", "provides the package h46_vendlib"),
    ("h46_editable.tasks:fromfile", r"editable, where it is imported from, holds an installed "
                                    "distribution's metadata"),
], ids=["target-layout", "pythonpath-entry", "vendored", "egg-info"])
def test_a_library_under_the_working_directory_is_refused(layout, name, why):
    with pytest.raises(ForbiddenCallable, match=rf"never resolves .*is not the program's own: "
                                                rf"[^;]*{why}.*allowed_modules"):
        resolve(name)


def test_the_script_directory_on_pythonpath_is_still_the_program(layout, monkeypatch):
    """``PYTHONPATH`` naming the script's directory, or a directory holding it (``.``, the
    project), does not take the modules beside the script out of the program."""
    work, mods = layout
    monkeypatch.setenv("PYTHONPATH", str(work))
    callables.set_program_roots([str(work / "proj"), str(work)], script_dir=str(work / "proj"))
    assert resolve("h46_mine:double") is mods["h46_mine"].double
    with pytest.raises(ForbiddenCallable):
        resolve("h46_bare:fromfile")  # under work, not beside the script


def test_home_temp_and_root_directories_are_never_roots(tmp_path, monkeypatch):
    home, proj = tmp_path / "home", tmp_path / "proj"
    home.mkdir()
    proj.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(callables, "_program", dict(callables._program))
    monkeypatch.setattr(callables, "_program_modules", {})
    callables.set_program_roots([str(home), tempfile.gettempdir(), "/", str(proj)])
    assert callables.program_roots() == (os.path.realpath(proj),)


def test_the_issue_layout_refuses_every_numpy_function(tmp_path, monkeypatch):
    """numpy itself (the venv's), whatever the roots: never the program."""
    import numpy as np

    monkeypatch.setattr(callables, "_program", dict(callables._program))
    monkeypatch.setattr(callables, "_program_modules", {})
    callables.set_program_roots([os.path.dirname(os.path.dirname(np.__file__)), str(tmp_path)])
    for name in ("numpy:fromfile", "numpy:save", "numpy:savetxt", "numpy:load"):
        with pytest.raises(ForbiddenCallable):
            resolve(name)


VICTIM = '''
import json
import sys

import numpy as np
import torch

import h46_mine
import h46_tlib.io
import shardwise.rpc as rpc

rank, port, out, secret = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=60)
rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
if rank == 0:
    got = {}
    for name, fn, args in (("library", h46_tlib.io.fromfile, (secret,)),
                           ("numpy.fromfile", np.fromfile, (secret,)),
                           ("numpy.save", np.save, (secret + ".npy", np.zeros(1))),
                           ("torch.save", torch.save, (torch.zeros(1), secret + ".pt")),
                           ("torch.load", torch.load, (secret,)),
                           ("mine", h46_mine.double, (21,))):
        try:
            got[name] = ["ok", repr(rpc.rpc_sync("w1", fn, args=args))]
        except Exception as exc:
            got[name] = [type(exc).__name__, str(exc)]
    with open(out, "w") as f:
        json.dump(got, f)
rpc.shutdown()
'''


def test_a_peer_reaches_no_library_of_the_target_layout(tmp_path):
    """The issue's layout as two programs: started in ``work/`` with ``PYTHONPATH`` naming
    ``work/pylibs`` (a library and its dist-info, as ``pip install --target`` leaves them),
    the script in ``work/proj`` beside ``h46_mine``. The library's function, numpy's and
    torch's are refused over RPC (no file read or written); the module beside the script
    answers."""
    import secrets
    import socket

    from tests.harness import procs

    work = tmp_path / "work"
    proj, pylibs = work / "proj", work / "pylibs"
    (pylibs / "h46_tlib").mkdir(parents=True)
    proj.mkdir()
    (proj / "h46_mine.py").write_text(MINE)
    (proj / "victim.py").write_text(VICTIM)
    (pylibs / "h46_tlib" / "__init__.py").write_text("")
    (pylibs / "h46_tlib" / "io.py").write_text(LIBRARY)
    _dist_info(pylibs, "h46_tlib", ["h46_tlib/__init__.py", "h46_tlib/io.py"])
    secret_file = tmp_path / "secret"
    secret_file.write_text("the victim's own data")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    out = tmp_path / "got.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", SHARDWISE_RPC_SECRET=secrets.token_hex(16),
               PYTHONPATH=os.pathsep.join([str(procs.ROOT), str(procs.ROOT / "src"),
                                           str(pylibs)]))
    programs = [procs.start([str(proj / "victim.py"), str(r), port, str(out),
                             str(secret_file)], env, work) for r in (0, 1)]
    try:
        logs = [p.communicate(timeout=120)[0] for p in programs]
    finally:
        for p in programs:
            p.kill()
    assert [p.returncode for p in programs] == [0, 0], logs
    got = json.loads(out.read_text())
    for name in ("library", "numpy.fromfile", "numpy.save", "torch.save", "torch.load"):
        assert got[name][0] == "ForbiddenCallable" and "never resolves" in got[name][1], got
    assert got["mine"] == ["ok", "42"], got
    assert sorted(p.name for p in tmp_path.iterdir()) == ["got.json", "secret", "work"]
