"""`shardwise train` says what it will run, in one line, before any rank starts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardwise.cli.main import main
from shardwise.cli.train_args import TrainConfig, gpt_parameters
from shardwise.cli.train_plan import batch_ways, count, plan_line
from shardwise.models import GPT


@pytest.mark.parametrize("shape", [{}, {"n_layer": 1, "n_head": 2, "d_model": 8, "seq_len": 4},
                                   {"n_layer": 3, "n_head": 3, "d_model": 96, "seq_len": 33}],
                         ids=str)
def test_the_closed_form_count_is_the_real_models(shape):
    cfg = dataclasses.replace(TrainConfig(), **shape)
    with torch.device("meta"):
        model = GPT(cfg.model_config())
    assert gpt_parameters(cfg) == sum(p.numel() for p in model.parameters())


def test_the_count_reads_as_people_say_it():
    assert [count(n) for n in (812, 5_300, 874_496, 7_500_000_000)] == \
        ["812", "5.3K", "874K", "7.5B"]


@pytest.mark.parametrize("change,world,ways", [
    ({}, 4, 4), ({"strategy": "tp"}, 4, 1), ({"strategy": "fsdp", "tp": 2}, 4, 2),
    ({"strategy": "pipeline", "dp": 2}, 4, 2), ({"strategy": "hsdp"}, 4, 4),
])
def test_the_batch_is_split_as_the_strategy_splits_it(change, world, ways):
    assert batch_ways(dataclasses.replace(TrainConfig(), **change), world) == ways


def test_the_line_names_strategy_ranks_model_batch_steps_and_places():
    cfg = dataclasses.replace(TrainConfig(), strategy="zero2", nproc=2, batch_size=12, steps=7,
                              checkpoint_dir="ck", checkpoint_every=5, log_dir="logs")
    line = plan_line(cfg, nnodes=3)
    for part in ("zero2 on 6 ranks (3 nodes x 2)", f"GPT of {count(gpt_parameters(cfg))} "
                 "parameters (4 layers, 4 heads, d_model 128, seq_len 128)",
                 "batch 12 (2 per rank)", "7 steps", "checkpoints: ck (every 5 steps)",
                 "metrics: logs"):
        assert part in line, (part, line)
    assert "\n" not in line


def test_train_prints_the_plan_before_the_launcher_starts(capsys, monkeypatch, tmp_path):
    seen = []

    def launch(nproc, argv, **options):
        seen.append(capsys.readouterr().out)  # what was on screen when ranks would start
        return 0

    monkeypatch.setattr("shardwise.cli.launch_args.launch", launch)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--nproc", "2", "--strategy", "tp", "--steps", "3"]) == 0
    assert seen and seen[0].startswith("shardwise train: tp on 2 ranks (1 node x 2)")
    assert "every rank the whole batch" in seen[0] and len(seen[0].splitlines()) == 1


def test_the_plan_comes_before_the_corpus_is_read(capsys, monkeypatch, tmp_path):
    """Reading the corpus imports torch and reads megabytes: the plan is on screen first."""
    seen = []

    def corpus_check(cfg, world_size):
        seen.append(capsys.readouterr().out)

    monkeypatch.setattr("shardwise.cli.train_args._check_corpus", corpus_check)
    monkeypatch.setattr("shardwise.cli.launch_args.launch", lambda *a, **k: 0)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--steps", "3"]) == 0
    assert seen and seen[0].startswith("shardwise train: ddp on 2 ranks")
