"""One process: ``Stateful`` entries in save / load, and ``format_utils`` (issue 26 point 3).
The torch-vs-shardwise recipe at world size 2 is tests/compat/test_dcp_stateful.py."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from torch import nn

from shardwise.checkpoint import CheckpointError, async_save, load, save
from shardwise.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
from shardwise.checkpoint.validate import digest_of


def _trained():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


class Counter:
    """A Stateful that is neither a module nor an optimizer; records the calls."""

    def __init__(self, n: int):
        self.n, self.calls = n, []

    def state_dict(self):
        self.calls.append("state_dict")
        return {"n": self.n, "t": torch.full((2,), float(self.n))}

    def load_state_dict(self, sd):
        self.calls.append("load_state_dict")
        self.n = sd["n"]
        assert torch.equal(sd["t"], torch.full((2,), float(sd["n"])))


@pytest.mark.parametrize("asynchronous", [False, True])
def test_stateful_entries_save_and_load(tmp_path, asynchronous):
    model, opt = _trained()
    saving = {"model": model, "optim": opt, "counter": Counter(7), "step": 12}
    if asynchronous:
        async_save(saving, checkpoint_id=tmp_path / "ck").result(timeout=60)
    else:
        save(saving, checkpoint_id=tmp_path / "ck")
    assert saving["counter"].calls == ["state_dict"]
    assert isinstance(saving["model"], nn.Module)  # the caller's dict is not changed
    stored = json.loads((tmp_path / "ck" / "metadata.json").read_text())
    assert "model.0.weight" in stored["tensors"] and "optim.state.0.exp_avg" in stored["tensors"]

    torch.manual_seed(1)
    other, other_opt = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), None
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.5)
    other(torch.randn(5, 4)).sum().backward()
    other_opt.step()
    target = {"model": other, "optim": other_opt, "counter": Counter(0), "step": 0}
    load(target, checkpoint_id=tmp_path / "ck")
    assert target["counter"].calls == ["state_dict", "load_state_dict"]
    assert target["counter"].n == 7 and target["step"] == 12
    for (k, v), w in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(v, w), k
    assert other_opt.param_groups[0]["lr"] == 0.1
    for p, q in zip(model.parameters(), other.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], other_opt.state[q][key]), key


def test_dcp_to_torch_save_rebuilds_the_nesting(tmp_path):
    model, opt = _trained()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3,
             "mixed": [torch.ones(2), "label", {5: torch.zeros(1)}]}
    save(state, checkpoint_id=tmp_path / "ck")
    dcp_to_torch_save(tmp_path / "ck", tmp_path / "one.pt")
    whole = torch.load(tmp_path / "one.pt", weights_only=True)
    assert whole["step"] == 3
    assert whole["mixed"][1] == "label" and torch.equal(whole["mixed"][0], torch.ones(2))
    assert list(whole["mixed"][2]) == [5]  # an int dict key stays an int
    assert sorted(whole["optim"]["state"]) == [0, 1, 2, 3]  # the optimizer's int keys too
    assert whole["optim"]["param_groups"][0]["params"] == [0, 1, 2, 3]
    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    plain.load_state_dict(whole["model"])
    fresh_opt = torch.optim.AdamW(plain.parameters())
    fresh_opt.load_state_dict(whole["optim"])
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg"], fresh_opt.state[q]["exp_avg"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "one.pt"]  # no temp left


def test_torch_save_to_dcp_round_trip(tmp_path):
    model, opt = _trained()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "in.pt")
    torch_save_to_dcp(tmp_path / "in.pt", tmp_path / "ck")
    target = {"model": nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).state_dict()}
    load(target, checkpoint_id=tmp_path / "ck")
    for k, v in model.state_dict().items():
        assert torch.equal(target["model"][k], v), k
    dcp_to_torch_save(tmp_path / "ck", tmp_path / "out.pt")
    back = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(back["model"]["2.weight"], model.state_dict()["2.weight"])


class _Payload:
    def __reduce__(self):
        return (print, ("pickle ran code",))


def test_torch_save_to_dcp_loads_weights_only(tmp_path, capsys):
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"x": _Payload()}, f, protocol=2)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch_save_to_dcp(tmp_path / "evil.pt", tmp_path / "ck")
    assert "pickle ran code" not in capsys.readouterr().out
    assert not (tmp_path / "ck").exists()


def _resign(ck, change):
    meta_file = ck / "metadata.json"
    meta = json.loads(meta_file.read_text())
    change(meta)
    meta["digest"] = digest_of(meta)
    meta_file.write_text(json.dumps(meta))


@pytest.mark.parametrize(("change", "says"), [
    (lambda m: m["paths"].update({"a.b": ["a", "c"]}), r"paths\['a\.b'\].*spells 'a\.c'"),
    (lambda m: m["paths"].pop("a.b"), r"'paths': its keys are not"),
    (lambda m: m["paths"].update({"a.b": ["a", True]}), r"expected a list of keys"),
])
def test_bad_paths_are_named(tmp_path, change, says):
    save({"a": {"b": torch.ones(2)}}, checkpoint_id=tmp_path / "ck")
    _resign(tmp_path / "ck", change)
    with pytest.raises(CheckpointError, match=says):
        dcp_to_torch_save(tmp_path / "ck", tmp_path / "o.pt")
    assert not (tmp_path / "o.pt").exists()


def test_conflicting_paths_and_huge_index_are_named(tmp_path):
    save({"a": [torch.ones(2), torch.ones(1)]}, checkpoint_id=tmp_path / "ck")
    _resign(tmp_path / "ck", lambda m: m["paths"].update({"a.1": ["a", "1"]}))
    with pytest.raises(CheckpointError, match="list or a dict"):
        dcp_to_torch_save(tmp_path / "ck", tmp_path / "o.pt")

    def far(m):
        m["paths"]["a.1"] = ["a", 10 ** 12]
        m["paths"]["a.1000000000000"] = m["paths"].pop("a.1")
        m["tensors"]["a.1000000000000"] = m["tensors"].pop("a.1")

    _resign(tmp_path / "ck", lambda m: m["paths"].update({"a.1": ["a", 1]}))
    _resign(tmp_path / "ck", far)
    with pytest.raises(CheckpointError, match="too large a gap"):
        dcp_to_torch_save(tmp_path / "ck", tmp_path / "o.pt")
    assert not (tmp_path / "o.pt").exists()
