"""Model-state estimates on a mesh (HSDP, FSDP x TP): the arithmetic, the plan command, and the
bytes live ranks hold on the shard group of a mesh and under tensor parallelism."""

import json
import math

import pytest
import torch
import torch.distributed as dist

from shardwise import fully_shard
from shardwise.cli.main import main
from shardwise.cli.plan import tp_units
from shardwise.cli.strategy_tp import gpt_plan
from shardwise.distributed import init_device_mesh
from shardwise.memory import state_bytes
from shardwise.memory.estimate import estimate_state_bytes
from shardwise.memory.layouts import MeshLayout, ParamSize, estimate_mesh_state_bytes
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.sharded_tensor import shard_module
from tests.harness import WORLD_SIZES, run_on_ranks

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32)
UNITS = [[10, 7], [3], [25]]


def _plain(units):
    return [[ParamSize(n) for n in u] for u in units]


@pytest.mark.parametrize("optimizer", ("adamw", "sgd-momentum", "sgd"))
def test_one_replica_and_no_tp_is_plain_fsdp(optimizer):
    for n in (1, 2, 3, 4, 8):
        ours = estimate_mesh_state_bytes(_plain(UNITS), MeshLayout(n), optimizer=optimizer)
        fsdp = estimate_state_bytes([n for u in UNITS for n in u], "fsdp", n,
                                    optimizer=optimizer, units=UNITS)
        assert ours == fsdp


def test_replicas_shard_over_the_rest_of_the_world_only():
    # 8 ranks as 2 replicas x 4: every rank holds what FSDP on 4 ranks holds
    hsdp = estimate_mesh_state_bytes(_plain(UNITS), MeshLayout(8, replicas=2))
    assert hsdp == estimate_mesh_state_bytes(_plain(UNITS), MeshLayout(4))
    # units of 17, 3 and 25 elements padded per unit over 4: 5 + 1 + 7 elements of 4 bytes
    assert hsdp.params == hsdp.grads == 13 * 4 and hsdp.optimizer == 13 * 8 + 3 * 4
    every = estimate_mesh_state_bytes(_plain(UNITS), MeshLayout(4, replicas=4))
    assert every.params == 45 * 4  # one rank per replica: whole units, as DDP holds them


def test_tp_splits_marked_parameters_then_fsdp_shards_what_is_left():
    # a 6 x 4 weight split on its 6 rows, a 6-element bias split alike, a 4-element norm whole
    units = [[ParamSize(24, 6), ParamSize(6, 6), ParamSize(4)]]
    assert [p.local_numel(2) for p in units[0]] == [12, 3, 4]
    assert [p.local_numel(4) for p in units[0]] == [8, 2, 4]  # chunks of ceil(6 / 4) = 2 rows
    two_d = estimate_mesh_state_bytes(units, MeshLayout(4, tp=2), optimizer="sgd")
    assert two_d.params == math.ceil(19 / 2) * 4 == two_d.grads and two_d.optimizer == 0
    three_d = estimate_mesh_state_bytes(units, MeshLayout(8, tp=2, replicas=2), optimizer="sgd")
    assert three_d == two_d
    assert MeshLayout(8, tp=2, replicas=2).shape == (2, 2, 2)
    with pytest.raises(ValueError, match="cannot be split on a dimension of length 5"):
        ParamSize(24, 5).local_numel(2)


def test_bad_layouts_are_named():
    with pytest.raises(ValueError, match=r"6 is not divisible by replicas \(1\) x tp \(4\) = 4"):
        MeshLayout(6, tp=4)
    with pytest.raises(ValueError, match="replicas must be at least 1"):
        MeshLayout(4, replicas=0)
    with pytest.raises(ValueError, match="unknown optimizer"):
        estimate_mesh_state_bytes([], MeshLayout(1), optimizer="lamb")


def _rows(capsys):
    record = json.loads(capsys.readouterr().out)
    return {r["strategy"]: [r["params"], r["grads"], r["optimizer"], r["model_state"]]
            for r in record["rows"]}


def test_plan_prints_the_mesh_layouts_asked_for(capsys):
    base = ["plan", "--nproc", "8", "--n-layer", "4", "--d-model", "512", "--n-head", "8"]
    assert main([*base, "--json"]) == 0
    assert set(_rows(capsys)) == {"ddp", "zero1", "zero2", "fsdp"}
    assert main([*base, "--tp", "2", "--replicas", "2"]) == 0
    assert "mesh: replicate 2 x shard 2 x tp 2" in capsys.readouterr().out
    assert main([*base, "--tp", "2", "--replicas", "2", "--json"]) == 0
    rows = _rows(capsys)
    # HSDP with 2 replicas holds what FSDP on 4 ranks holds: twice plain FSDP on 8
    assert rows["hsdp"][3] == pytest.approx(2 * rows["fsdp"][3], rel=1e-3)
    # FSDP x TP over 8 ranks splits almost everything 8 ways (layer norms are TP-replicated)
    assert rows["fsdp"][3] <= rows["fsdp x tp2"][3] <= rows["fsdp"][3] * 1.01
    assert rows["hsdp x tp2"][3] == pytest.approx(rows["hsdp"][3], rel=1e-2)
    assert main([*base, "--tp", "2,4", "--json"]) == 0
    rows = _rows(capsys)
    assert rows["fsdp x tp4"][3] == pytest.approx(rows["fsdp x tp2"][3], rel=1e-2)
    for bad, message in [(["--tp", "3"], "--tp 3 must divide n_head (8)"),
                         (["--replicas", "3"], "not divisible by replicas (3)"),
                         (["--tp", "0"], "must be at least 1, got 0")]:
        with pytest.raises(SystemExit) as exit_info:
            main([*base, *bad])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def _release(mesh):
    """Destroy the mesh's own groups (never the world) so that the pool's long-lived ranks do
    not pile up a group per test."""
    for group in {id(g): g for g in mesh.get_all_groups()}.values():
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)


def _hsdp_body(ctx, shape):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = GPT(CFG)
    for block in model.blocks:
        fully_shard(block, process_group=mesh.get_group("shard"))
    fully_shard(model, process_group=mesh.get_group("shard"))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1))
    lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    opt.step()
    _release(mesh)
    return state_bytes(model, opt)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_hsdp_estimate_equals_what_ranks_sharding_over_the_shard_group_hold(world_size):
    with torch.device("meta"):
        units = tp_units(GPT(CFG))
    for replicas in [r for r in (1, 2, 4) if world_size % r == 0]:
        shape = (replicas, world_size // replicas)
        est = estimate_mesh_state_bytes(units, MeshLayout(world_size, replicas=replicas),
                                        optimizer="sgd-momentum")
        for measured in run_on_ranks(world_size, _hsdp_body, shape):
            assert (measured.params, measured.grads) == (est.params, est.grads), shape
            assert measured.optimizer <= est.optimizer, shape


def _tp_body(ctx):
    torch.manual_seed(0)
    model = GPT(CFG)
    specs, gathered = gpt_plan(ctx.world_size)
    shard_module(model, specs, gather_output=gathered)
    return state_bytes(model).params


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_tp_estimate_is_what_tp_rank_0_holds_under_the_tp_plan(world_size):
    with torch.device("meta"):
        units = tp_units(GPT(CFG))
    est = estimate_mesh_state_bytes(units, MeshLayout(world_size, tp=world_size))
    held = run_on_ranks(world_size, _tp_body)
    assert held[0] == est.params and max(held) == est.params
