"""Model-state estimates against what a live model and optimizer really hold."""

import math

import pytest
import torch

from shardwise.cli.main import main
from shardwise.memory import state_bytes
from shardwise.memory.estimate import estimate_state_bytes, parameter_sizes
from shardwise.models import GPT, GPTConfig, lm_loss

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("tied", (False, True))
def test_replicated_estimate_equals_measured_bytes_after_a_step(optimizer, tied):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**CFG.to_dict(), "tie_weights": tied}))
    model.pos_emb.weight.requires_grad_(False)  # frozen: no gradient, no optimizer state
    opt = OPTIMIZERS[optimizer]([p for p in model.parameters() if p.requires_grad])
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1))
    lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    opt.step()
    measured = state_bytes([p for p in model.parameters() if p.requires_grad], opt)
    est = estimate_state_bytes(parameter_sizes(model), "ddp", 1, optimizer=optimizer)
    assert (est.params, est.grads, est.optimizer) == (measured.params, measured.grads,
                                                      measured.optimizer)


def test_sharded_estimates_divide_by_the_world_size_and_pad_per_unit():
    sizes = [10, 7, 3]  # 20 elements
    for n in (1, 2, 3, 4):
        z1 = estimate_state_bytes(sizes, "zero1", n, optimizer="sgd-momentum")
        z2 = estimate_state_bytes(sizes, "zero2", n, optimizer="sgd-momentum")
        assert z1.params == z2.params == 20 * 4 and z1.grads == 20 * 4
        assert z2.grads == math.ceil(20 / n) * 4 == z1.optimizer == z2.optimizer
    # FSDP pads each unit on its own: units of 17 and 3 elements at N=4 -> 5 + 1 per rank
    fsdp = estimate_state_bytes(sizes, "fsdp", 4, optimizer="sgd", units=[[10, 7], [3]])
    assert (fsdp.params, fsdp.grads, fsdp.optimizer) == (6 * 4, 6 * 4, 0)
    half = estimate_state_bytes(sizes, "fsdp", 2, optimizer="sgd", param_dtype=torch.bfloat16)
    assert half.params == 10 * 2


def test_parameter_sizes_work_on_the_meta_device_and_count_tied_weights_once():
    with torch.device("meta"):
        tied = GPT(GPTConfig(**{**CFG.to_dict(), "tie_weights": True}))
        untied = GPT(CFG)
    assert sum(parameter_sizes(untied)) - sum(parameter_sizes(tied)) == CFG.vocab_size * 32


def test_bad_estimate_input_is_named():
    with pytest.raises(ValueError, match="unknown strategy 'zero3'"):
        estimate_state_bytes([4], "zero3", 2)
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
        estimate_state_bytes([4], "ddp", 2, optimizer="lamb")
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        estimate_state_bytes([4], "ddp", 0)


def test_plan_command_prints_each_strategy_per_rank(capsys):
    assert main(["plan", "--nproc", "4", "--n-layer", "4", "--d-model", "512"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: [float(v) for v in line.split()[1:5]]
            for line in out.splitlines() if line.split()[:1] in (["ddp"], ["zero1"], ["zero2"],
                                                                   ["fsdp"])}
    totals = [rows[s][3] for s in ("ddp", "zero1", "zero2", "fsdp")]
    assert totals == sorted(totals, reverse=True) and totals[0] > totals[3] * 3.5
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--nproc", "0"])
    assert exit_info.value.code == 2
    assert "--nproc must be at least 1" in capsys.readouterr().err
