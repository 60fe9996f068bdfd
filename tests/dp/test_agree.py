"""check_same_model: ranks with the same model pass; any difference raises on every rank, naming
the first difference and the ranks that differ."""

import pytest
import torch
from torch import nn

from shardwise.dp.agree import (
    ModelMismatchError,
    check_same_model,
    first_difference,
    model_signature,
)
from tests.harness import run_on_ranks


def _model(width=8, dtype=torch.float32, freeze=False, extra=False, swap=False):
    layers = [nn.LayerNorm(4), nn.Linear(4, width)] if swap else [nn.Linear(4, width),
                                                                   nn.LayerNorm(width)]
    if extra:
        layers.append(nn.Linear(width, 2))
    model = nn.Sequential(*layers).to(dtype)
    model.register_buffer("steps", torch.zeros(1))
    if freeze:
        model[0].weight.requires_grad_(False)
    return model


def _check(ctx, odd_ranks, **odd):
    model = _model(**odd) if ctx.rank in odd_ranks else _model()
    try:
        check_same_model(model, ctx.group, what="DistributedDataParallel")
    except ModelMismatchError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("world_size", [2, 4])
def test_same_model_passes(world_size):
    assert run_on_ranks(world_size, _check, []) == [None] * world_size


@pytest.mark.parametrize(("world_size", "odd_ranks", "odd", "says"), [
    (2, [1], {"width": 6}, "parameter '0.weight' (8, 4) float32, requires_grad=True on rank 0 "
                           "but parameter '0.weight' (6, 4) float32"),
    (4, [3], {"dtype": torch.float64}, "(8, 4) float64"),
    (4, [1, 2], {"freeze": True}, "requires_grad=False on rank 1"),
    (4, [2], {"extra": True}, "entry 4 is buffer 'steps' (1,) float32 on rank 0 but parameter "
                              "'2.weight' (2, 8) float32, requires_grad=True on rank 2"),
    (2, [1], {"swap": True}, "entry 0 is parameter '0.weight'"),
])
def test_a_difference_raises_on_every_rank_naming_it(world_size, odd_ranks, odd, says):
    messages = run_on_ranks(world_size, _check, odd_ranks, **odd)
    assert all(m is not None for m in messages), messages
    assert len(set(messages)) == 1  # every rank says the same
    assert messages[0].startswith(f"DistributedDataParallel: the ranks hold different models; "
                                  f"rank(s) {odd_ranks} differ from rank 0: "), messages[0]
    assert says in messages[0], messages[0]


def test_signature_lists_parameters_then_buffers_in_order():
    rows = model_signature(_model())
    assert [r[1] for r in rows] == ["0.weight", "0.bias", "1.weight", "1.bias", "steps"]
    assert rows[-1] == ["buffer", "steps", [1], "float32", False]


def test_first_difference_of_a_buffer_has_no_requires_grad():
    a = [["buffer", "b", [1], "float32", False]]
    b = [["buffer", "b", [2], "float32", False]]
    assert first_difference(a, b, 0, 1) == ("entry 0 is buffer 'b' (1,) float32 on rank 0 but "
                                            "buffer 'b' (2,) float32 on rank 1")


def test_first_difference_of_a_longer_signature_names_the_extra_entry():
    a = model_signature(_model())
    assert first_difference(a, a[:3], 0, 3) == (
        "rank 0 has 5 entries, rank 3 has 3; the first extra one, on rank 0, is parameter "
        "'1.bias' (8,) float32, requires_grad=True")
