"""The checkpoint dry run ([Note: checkpoint dry run], sim/checkpoint_plan.py) against real saves
and loads on gloo, and against chunk counts computed here from the parameter shapes.

At world size 4 (and resharding 2 -> 4, 4 -> 2) the demo GPT is wrapped with the dry run's own
strategy code on a real gloo world, trained two steps, saved with ``checkpoint.save``, and
loaded at the other world size with ``checkpoint.load`` counting the blocks each rank reads.
The dry run's figures equal what is on disk: the number of chunks and files, the data bytes,
and the metadata file's size once the real CRC-32s are written at the dry run's 10 digits
(a CRC is data; the dry run counts each at its widest, so its size is an upper bound).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from shardwise import checkpoint as ckpt
from shardwise.checkpoint import reader as reader_mod
from shardwise.models import GPTConfig
from shardwise.sim import step as sim_step
from shardwise.sim.checkpoint_plan import (
    CRC_BOUND,
    Reshard,
    checkpoint_state,
    simulate_checkpoint,
)
from shardwise.sim.fake_group import SimulationError
from shardwise.sim.models import demo_gpt, hf_model
from shardwise.sim.step import DryRun, simulate_step
from tests.harness import run_on_ranks
from tests.sim.configs import DEMO, llama_file

CFG = GPTConfig(n_layer=2, d_model=64, n_head=4, vocab_size=128, seq_len=16)


def _meta():
    return demo_gpt(CFG)


def _wrapped(ctx, strategy: str):
    torch.manual_seed(0)
    from shardwise.models import GPT

    run = DryRun(strategy, ctx.world_size, rank=ctx.rank,
                 replicas=2 if strategy == "hsdp" else 1)
    meshes = sim_step._meshes(run, dist.group.WORLD)
    return sim_step.WRAPPERS[strategy](GPT(CFG), run, dist.group.WORLD, meshes)


def _real_save(ctx, strategy: str, path: str) -> None:
    wrapped = _wrapped(ctx, strategy)
    ids = torch.zeros((1, CFG.seq_len), dtype=torch.long)
    for _ in range(2):
        sim_step._step(wrapped, ids)
    ckpt.save(checkpoint_state(wrapped), checkpoint_id=path)


def _real_load(ctx, strategy: str, path: str) -> dict:
    """Load into this rank's state, counting the stored chunks it reads from and the blocks
    and bytes it reads (the reader's own calls)."""
    state = checkpoint_state(_wrapped(ctx, strategy))
    seen = {"chunks_read": 0, "blocks_read": 0, "bytes_read": 0}
    block, copy = reader_mod.BlockReader._block, reader_mod.BlockReader.copy_overlap

    def counted_block(self, name, dtype, rec, b):
        rows = block(self, name, dtype, rec, b)
        seen["blocks_read"] += 1
        seen["bytes_read"] += rows.numel() * rows.element_size()
        return rows

    def counted_copy(self, *args):
        before = seen["blocks_read"]
        copy(self, *args)
        seen["chunks_read"] += seen["blocks_read"] > before

    reader_mod.BlockReader._block, reader_mod.BlockReader.copy_overlap = counted_block, \
        counted_copy
    try:
        ckpt.load(state, checkpoint_id=path)
    finally:
        reader_mod.BlockReader._block, reader_mod.BlockReader.copy_overlap = block, copy
    return seen


def _on_disk(path) -> dict:
    text = (path / "metadata.json").read_text()
    meta = json.loads(text)
    for entry in meta["tensors"].values():
        for rec in entry["chunks"]:
            rec["crc32"] = [CRC_BOUND] * len(rec["crc32"])
    return {"bytes": (path / "metadata.json").stat().st_size,
            "bytes_widest_crcs": len(json.dumps(meta, allow_nan=True)),
            "chunks": sum(len(e["chunks"]) for e in meta["tensors"].values()),
            "tensors": len(meta["tensors"]), "files": len(list(path.glob("rank_*.bin"))),
            "data_bytes": sum(f.stat().st_size for f in path.glob("rank_*.bin"))}


def _dry(strategy: str, n: int, m: int, rank: int = 0) -> dict:
    run = DryRun(strategy, n, rank=rank, replicas=2 if strategy == "hsdp" else 1)
    load_rank = min(rank, m - 1)
    hook = simulate_checkpoint(_meta, run, Reshard(m, load_rank))
    return simulate_step(_meta, run, after=hook).extra["checkpoint"]


@pytest.mark.parametrize("strategy, n, m", [
    ("fsdp", 4, 4), ("fsdp", 2, 4), ("fsdp", 4, 2),
    *(pytest.param(s, 4, 2, marks=pytest.mark.slow) for s in ("ddp", "zero2", "hsdp"))])
def test_dry_run_plans_what_a_real_save_writes_and_a_real_load_reads(strategy, n, m,
                                                                    tmp_path):
    path = tmp_path / "ckpt"
    run_on_ranks(n, _real_save, strategy, str(path), timeout=300)
    real_reads = run_on_ranks(m, _real_load, strategy, str(path), timeout=300)
    disk = _on_disk(path)
    for rank in sorted({0, n - 1}):
        plan = _dry(strategy, n, m, rank)
        save = plan["save"]
        assert save["metadata_bytes"] == disk["bytes_widest_crcs"] >= disk["bytes"], (save,
                                                                                      disk)
        for field in ("chunks", "tensors", "files", "data_bytes"):
            assert save[field] == disk[field], (field, save, disk)
        load = plan["load"]
        want = real_reads[load["rank"]]
        assert {k: load[k] for k in want} == want, (load, want)


def _sharded_chunks(shape, n: int) -> int:
    """Distinct chunks of a tensor sharded on dim 0 over n ranks as torch.chunk cuts it:
    ceil(rows / n) rows per rank; ranks past the end hold an empty chunk, all at one offset
    (one chunk, written once)."""
    rows = shape[0]
    per = -(-rows // n)
    full = -(-rows // per)
    return full + (1 if full < n else 0)


def _analytic(model, n: int, strategy: str) -> int:
    """Chunks of the saved model and AdamW state: FSDP shards every parameter and its two
    moments on dim 0 and keeps one step counter per parameter replicated (saved once); DDP
    saves every tensor once."""
    shapes = [tuple(p.shape) for p in model.parameters()]
    if strategy == "ddp":
        return len(shapes) * 4  # parameter, exp_avg, exp_avg_sq, step
    return sum(3 * _sharded_chunks(s, n) + 1 for s in shapes)


@pytest.mark.parametrize("world", [64, pytest.param(1024, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["demo", "llama"])
def test_chunk_counts_at_scale_equal_the_count_from_the_shapes(world, kind, tmp_path):
    if kind == "demo":
        def build():
            return demo_gpt(DEMO)
    else:
        path = llama_file(tmp_path)

        def build():
            return hf_model(path)
    for strategy in ("fsdp", "ddp"):
        run = DryRun(strategy, world)
        plan = simulate_step(build, run, after=simulate_checkpoint(build, run, None)).extra
        save = plan["checkpoint"]["save"]
        assert save["chunks"] == _analytic(build(), world, strategy), (strategy, save)
        assert save["files"] == world
        assert save["tensors"] == 4 * len(list(build().parameters()))  # AdamW: 3 + step


def test_fsdp_saved_at_64_and_loaded_at_8_reads_exactly_the_rank_s_share():
    """Resharding 64 -> 8: each of the 8 ranks' boxes covers 8 of the saved row bands of
    every sharded tensor (rows divisible by 64), so rank 0 reads 8 chunks per sharded tensor
    and the replicated step counters once each, and exactly its share of the bytes."""
    def build():
        return demo_gpt(DEMO)

    run = DryRun("fsdp", 64)
    plan = simulate_step(build, run, after=simulate_checkpoint(build, run, Reshard(8, 0)))
    load = plan.extra["checkpoint"]["load"]
    params = list(build().parameters())
    assert all(p.shape[0] % 64 == 0 for p in params)
    assert load["chunks_read"] == len(params) * (3 * 8 + 1)
    share = sum(3 * 4 * p.numel() // 8 + 4 for p in params)  # fp32: params and moments
    assert load["bytes_read"] == share
    assert plan.extra["checkpoint"]["save"]["data_bytes"] == sum(3 * 4 * p.numel() + 4
                                                                 for p in params)


def test_a_load_rank_outside_the_target_world_is_a_one_line_error():
    with pytest.raises(SimulationError, match="--rank 9 is outside the --reshard-to world of 8"):
        Reshard(8, 9)


def test_plan_json_rows_gain_the_checkpoint_plan(capsys, tmp_path):
    from shardwise.cli.main import main

    assert main(["plan", "--simulate", "--json", "--hf-config", str(llama_file(tmp_path)),
                 "--nproc", "8", "--strategy", "fsdp", "--reshard-to", "16", "--rank", "3"]) == 0
    record = json.loads(capsys.readouterr().out)
    rows = {r["strategy"]: r for r in record["rows"]}
    plan = rows["fsdp"]["checkpoint"]
    assert set(plan) == {"save", "load", "cpu_seconds"}
    assert plan["save"]["files"] == 8 and plan["save"]["rank"]["rank"] == 3
    assert plan["load"]["world_size"] == 16 and plan["load"]["rank"] == 3
    assert plan["save"]["metadata_bytes"] > 0 and plan["load"]["bytes_read"] > 0
    assert rows["ddp"]["checkpoint"] is None  # not simulated: --strategy fsdp
    assert "checkpoint" not in rows["fsdp"]["simulated"]
