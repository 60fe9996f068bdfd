import torch
from torch import nn

from shardwise.memory import state_bytes


def test_counts_params_grads_and_adam_state_once():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2, bias=False))
    n = 4 * 3 + 3 + 3 * 2
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    counted = state_bytes(model, opt)
    assert counted.params == n * 4
    assert counted.grads == n * 4
    # exp_avg and exp_avg_sq per parameter, plus a 0-dim fp32 step counter per parameter
    assert counted.optimizer == 2 * n * 4 + 3 * 4


def test_views_into_one_buffer_and_tied_weights_count_once():
    flat = torch.zeros(10)
    views = [flat[:4], flat[4:10], flat[:4]]
    assert state_bytes(views).params == 40
    emb = nn.Embedding(8, 4)
    head = nn.Linear(4, 8, bias=False)
    head.weight = emb.weight
    assert state_bytes(nn.ModuleList([emb, head])).params == 8 * 4 * 4


def test_views_of_one_storage_count_the_union_of_their_ranges():
    base = torch.zeros(1000)
    # two separate runs (FSDP's host-shared rows of two parameters) and one overlapping both
    head, tail = base[:100], base[900:]
    assert state_bytes([head, tail]).params == 200 * 4
    assert state_bytes([head, tail, base[50:150]]).params == 250 * 4
    assert state_bytes([base, head]).params == 1000 * 4
    assert state_bytes([base[::10]]).params == 991 * 4  # a strided view spans its hull
