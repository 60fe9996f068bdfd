"""`shardwise plan`: the ZeRO paper's Table 1, Hugging Face configs, precisions, the plan's
predictions against what live ranks hold, and bad input."""

import json

import pytest
import torch

from shardwise.cli.main import main
from shardwise.cli.strategies import get_builder
from shardwise.cli.train_args import TrainConfig
from shardwise.memory import state_bytes
from shardwise.memory.estimate import element_bytes, estimate_state_bytes, parameter_sizes
from shardwise.memory.hf_config import HFConfigError, spec_from_config
from shardwise.models import GPT, lm_loss
from tests.harness import run_on_ranks

# Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
# (SC 2020), Table 1, the 7.5B-parameter column, K = 12, in GB as printed: world size ->
# (baseline, P_os, P_os+g, P_os+g+p).
TABLE_1_7_5B = {
    1: ("120", "120", "120", "120"),
    4: ("120", "52.5", "41.3", "30"),
    16: ("120", "35.6", "21.6", "7.5"),
    64: ("120", "31.4", "16.6", "1.88"),
    256: ("120", "30.4", "15.4", "0.47"),
    1024: ("120", "30.1", "15.1", "0.12"),
}


@pytest.mark.parametrize("world", sorted(TABLE_1_7_5B))
def test_every_7_5b_cell_of_the_zero_papers_table_1(world):
    for strategy, printed in zip(("ddp", "zero1", "zero2", "fsdp"), TABLE_1_7_5B[world]):
        est = estimate_state_bytes([7_500_000_000], strategy, world, optimizer="adam",
                                   precision="mixed")
        decimals = len(printed.partition(".")[2])
        assert round(est.total / 1e9, decimals) == float(printed), (world, strategy)


def _rows(out):
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if parts[:1] and parts[0] in ("ddp", "zero1", "zero2", "fsdp", "hsdp"):
            rows[parts[0]] = parts[1:]
    return rows


def test_plan_prints_table_1_at_64_gpus_in_gb(capsys):
    argv = ["plan", "--params", "7.5e9", "--nproc", "64", "--precision", "mixed", "--units", "gb"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "GB per rank" in out and "2 + 2 + 12 bytes per parameter" in out
    totals = {name: cells[3] for name, cells in _rows(out).items()}
    assert totals == {"ddp": "120", "zero1": "31.4", "zero2": "16.6", "fsdp": "1.88"}
    assert main(argv[:-2]) == 0  # GiB by default, labelled: 120e9 bytes are 111.8 GiB
    out = capsys.readouterr().out
    assert "GiB per rank" in out and _rows(out)["ddp"][3] == "112"


def test_memory_marks_what_fits_and_names_the_cheapest_and_json_holds_it(capsys):
    argv = ["plan", "--params", "7.5B", "--nproc", "64", "--precision", "mixed",
            "--memory-gib", "20", "--replicas", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    fits = {name: "fits" in cells for name, cells in _rows(out).items()}
    assert "cheapest strategy that fits in 20 GiB per rank: zero2" in out
    assert main([*argv, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["cheapest_fit"] == "zero2" and record["parameters"] == 7_500_000_000
    by_name = {r["strategy"]: r for r in record["rows"]}
    assert {n: r["fits"] for n, r in by_name.items()} == {
        "ddp": False, "zero1": False, "zero2": True, "fsdp": True, "hsdp": True}
    assert all(fits[n] == by_name[n]["fits"] for n in fits)
    assert by_name["zero2"]["total"] == 2 * 7.5e9 + 14 * 7.5e9 / 64 + 4  # + Adam's step counter
    # HSDP over 8 replicas shards over 8 ranks: what FSDP on 8 ranks holds
    assert by_name["hsdp"]["params"] == 2 * 7.5e9 / 8


def test_precisions_price_each_part():
    assert element_bytes("fp32", "adamw") == (4, 4, 8, 4)
    assert element_bytes("bf16", "adamw") == (2, 2, 4, 4)
    assert element_bytes("mixed", "adamw") == (2, 2, 12, 4)
    assert element_bytes("mixed", "sgd") == (2, 2, 4, 0)  # the master copy alone
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        element_bytes("fp8")


def test_bf16_estimate_equals_what_a_bf16_model_and_adamw_hold():
    torch.manual_seed(0)
    cfg = TrainConfig(n_layer=2, d_model=32, n_head=2, seq_len=16).model_config()
    model = GPT(cfg).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1))
    lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    opt.step()
    live = state_bytes(model, opt)
    est = estimate_state_bytes(parameter_sizes(model), "ddp", 1, precision="bf16")
    assert (est.params, est.grads, est.optimizer) == (live.params, live.grads, live.optimizer)


GPT2_SMALL = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 768,
              "n_head": 12, "n_layer": 12, "n_positions": 1024, "vocab_size": 50257,
              "n_inner": None}
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
             "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
             "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32000,
             "tie_word_embeddings": False, "max_position_embeddings": 4096}


def test_hf_configs_count_the_published_parameters():
    assert spec_from_config(GPT2_SMALL).n_params == 124_439_808
    assert spec_from_config(LLAMA2_7B).n_params == 6_738_415_616
    # grouped key/value heads: 8 of 32 heads shrink k and v to a quarter
    gqa = spec_from_config({**LLAMA2_7B, "num_key_value_heads": 8})
    assert spec_from_config(LLAMA2_7B).n_params - gqa.n_params == 32 * 2 * 4096 * 4096 * 3 // 4


def test_plan_reads_an_hf_config_file(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA2_7B))
    assert main(["plan", "--hf-config", str(path), "--nproc", "8", "--precision", "mixed",
                 "--batch-size", "1", "--seq-len", "4096", "--tp", "2", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    rows = {r["strategy"]: r for r in record["rows"]}
    assert record["parameters"] == 6_738_415_616
    assert rows["fsdp"]["params"] == pytest.approx(2 * 6_738_415_616 / 8, rel=1e-6)
    assert rows["fsdp x tp2"]["activations"] < rows["fsdp"]["activations"]
    assert record["activations"]["with"] < record["activations"]["without"]


@pytest.mark.parametrize("config, message", [
    ({**GPT2_SMALL, "architectures": ["BertModel"], "model_type": "bert"},
     "architectures ['BertModel'] is not a causal LM"),
    ({"model_type": "t5", "d_model": 512}, "model_type 't5' is not a causal LM family"),
    ({k: v for k, v in LLAMA2_7B.items() if k != "hidden_size"}, "missing field 'hidden_size'"),
    ({k: v for k, v in GPT2_SMALL.items() if k != "n_layer"}, "missing field 'n_layer'"),
    ({**LLAMA2_7B, "num_key_value_heads": 5}, "not divisible by num_key_value_heads (5)"),
    ({**GPT2_SMALL, "n_embd": "768"}, "field 'n_embd' must be a positive integer"),
])
def test_bad_hf_configs_are_named(config, message):
    with pytest.raises(HFConfigError, match=__import__("re").escape(message)):
        spec_from_config(config)


@pytest.mark.parametrize("argv, message", [
    (["--params", "seven"], "'seven' is not a number of parameters"),
    (["--params", "0"], "must be at least 1"),
    (["--hf-config", "/nonexistent/config.json"], "cannot read /nonexistent/config.json"),
    (["--params", "1e9", "--n-layer", "4"], "--n-layer shapes the demo GPT"),
    (["--params", "1e9", "--batch-size", "4"], "a bare --params count has none"),
    (["--tp", "2,x"], "is not a tensor-parallel degree"),
])
def test_bad_plan_input_is_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_hf_config_file_is_an_error_naming_the_field(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
    with pytest.raises(SystemExit):
        main(["plan", "--hf-config", str(path)])
    assert "not a causal LM" in capsys.readouterr().err
    path.write_text(json.dumps({k: v for k, v in LLAMA2_7B.items() if k != "vocab_size"}))
    with pytest.raises(SystemExit):
        main(["plan", "--hf-config", str(path)])
    assert "missing field 'vocab_size'" in capsys.readouterr().err


# The demo GPT under each strategy, as `shardwise train` builds it, against the plan.
LIVE = dict(n_layer=8, d_model=32, n_head=2, seq_len=16, batch_size=4)


def _live_body(ctx, strategy):
    cfg = TrainConfig(strategy=strategy, **LIVE)
    torch.manual_seed(0)
    model = GPT(cfg.model_config())
    prepared = get_builder(strategy)(model, cfg, ctx.group, torch.device("cpu"))
    x = torch.randint(0, 256, (2, cfg.seq_len + 1))
    for _ in range(2):  # the second backward leaves gradients next to the optimizer state
        prepared.optimizer.zero_grad(set_to_none=True)
        lm_loss(prepared.model(x[:, :-1]), x[:, 1:]).backward()
        if _ == 0:
            prepared.optimizer.step()
    return state_bytes(model, prepared.optimizer)


@pytest.mark.parametrize("world_size", (2, 4))
def test_plan_predicts_what_live_ranks_hold_within_5_percent(world_size, capsys):
    flags = ["--n-layer", "8", "--d-model", "32", "--n-head", "2", "--seq-len", "16"]
    assert main(["plan", "--nproc", str(world_size), *flags, "--json"]) == 0
    rows = {r["strategy"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    for strategy in ("ddp", "zero1", "zero2", "fsdp"):
        held = run_on_ranks(world_size, _live_body, strategy)
        for part in ("params", "grads", "optimizer"):
            most = max(getattr(h, part) for h in held)
            assert most == pytest.approx(rows[strategy][part], rel=0.05), (strategy, part)
