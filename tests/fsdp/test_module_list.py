"""``fully_shard([norm, head])``: one unit over several modules (torch FSDP2's list form, which
torchtitan uses for a model's final norm and output head). Training is compared with a
one-process reference at world sizes 1, 2 and 4, and with torch's FSDP2 doing the same; the
unit gathers once per forward for all its modules; state dicts keep each module's own names
(both modules here have a parameter named ``weight``); a parameter tied across the list's
modules is one parameter of the unit; bad lists are refused by name."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwise import FSDPModule, fully_shard
from shardwise.fsdp import full_state_dict, load_full_state_dict
from shardwise.fsdp.unit import units_of
from tests.fsdp.gathering import gathering_units
from tests.fsdp.unit_grads import assert_unit_grads
from tests.harness import WORLD_SIZES, assert_rel_close, run_on_ranks

RTOL = 1e-5
VOCAB, WIDTH = 16, 8


class Net(nn.Module):
    def __init__(self, tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.norm(self.blocks(self.embed(tokens))))


def _shard(model: Net, shard_fn, group_of: str = "norm_head", **kwargs) -> None:
    shard_fn(model.blocks, **kwargs)
    if group_of == "norm_head":
        shard_fn([model.norm, model.head], **kwargs)
    else:  # the tied embedding and head in one unit
        shard_fn([model.embed, model.head], **kwargs)
    shard_fn(model, **kwargs)


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _train(ctx, reshard: bool, tied: bool) -> list[float]:
    torch.manual_seed(0)
    reference, model = Net(tied), Net(tied)
    model.load_state_dict(reference.state_dict())
    _shard(model, fully_shard, "embed_head" if tied else "norm_head",
           reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(3):
        tokens = torch.randint(0, VOCAB, (ctx.world_size, 2, 6), generator=gen)
        ref_opt.zero_grad()
        opt.zero_grad()
        for r in range(ctx.world_size):
            (_loss(reference, tokens[r]) / ctx.world_size).backward()
        loss = _loss(model, tokens[ctx.rank])
        loss.backward()
        assert_unit_grads(model, reference, f"step {step}", RTOL)
        ref_opt.step()
        opt.step()
        losses.append(loss.item())
    mine = full_state_dict(model)
    for name, value in reference.state_dict().items():
        assert_rel_close(mine[name], value, RTOL, name)
    return losses


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("reshard", [True, False])
def test_one_unit_over_norm_and_head_trains_as_the_reference(world_size, reshard):
    run_on_ranks(world_size, _train, reshard, False)


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_parameter_tied_across_the_lists_modules_is_one_parameter_of_the_unit(world_size):
    run_on_ranks(world_size, _train, True, True)


def _structure(ctx):
    torch.manual_seed(0)
    model = Net()
    _shard(model, fully_shard)
    unit = model.norm._shardwise_fsdp_unit
    return (unit is model.head._shardwise_fsdp_unit,
            isinstance(model.norm, FSDPModule) and isinstance(model.head, FSDPModule),
            len(units_of(model)), len(unit.handle.slots),
            sorted(model.state_dict()) == sorted(Net().state_dict()))


def test_both_modules_are_fsdp_modules_of_one_unit_and_keep_their_names():
    same, both, units, slots, keys = run_on_ranks(2, _structure)[0]
    assert same and both and keys
    assert units == 3  # blocks, [norm, head], the root
    assert slots == 3  # norm.weight, norm.bias, head.weight


def _gathers_in_forward(ctx, reshard: bool) -> int:
    torch.manual_seed(0)
    model = Net()
    with gathering_units():
        _shard(model, fully_shard, reshard_after_forward=reshard)
    path = model.norm._shardwise_fsdp_unit.handle.gather_path  # the unit's gather path
    calls = []
    start_gather = path.start

    def counted():
        calls.append(1)
        return start_gather()

    path.start = counted
    tokens = torch.randint(0, VOCAB, (2, 6))
    for _ in range(2):
        before = len(calls)
        loss = _loss(model, tokens)
        in_forward = len(calls) - before
        loss.backward()
    model.reshard()
    return in_forward


@pytest.mark.parametrize("reshard", [True, False])
def test_the_unit_gathers_once_per_forward_for_all_its_modules(reshard):
    assert run_on_ranks(2, _gathers_in_forward, reshard) == [1, 1]


def _losses_with(ctx, which: str) -> list[float]:
    torch.manual_seed(0)
    model = Net()
    if which == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        _shard(model, torch_fully_shard)
    else:
        _shard(model, fully_shard)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(5 + ctx.rank)
    losses = []
    for _ in range(3):
        loss = _loss(model, torch.randint(0, VOCAB, (2, 6), generator=gen))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_the_same_losses_as_torchs_fsdp2_list_form():
    ours = run_on_ranks(2, _losses_with, "shardwise")
    theirs = run_on_ranks(2, _losses_with, "torch")
    for mine, torch_losses in zip(ours, theirs, strict=True):
        assert_rel_close(torch.tensor(mine), torch.tensor(torch_losses), 1e-6, "losses")


def _load_full(ctx, meta: bool) -> bool:
    torch.manual_seed(0)
    plain = Net()
    full = {k: v.clone() for k, v in plain.state_dict().items()}
    torch.manual_seed(1)  # other values, so that a load that does nothing is seen
    if meta:
        with torch.device("meta"):
            model = Net()
    else:
        model = Net()
    _shard(model, fully_shard)
    load_full_state_dict(model, full)
    mine = full_state_dict(model)
    for name, value in full.items():
        assert_rel_close(mine[name], value, 0.0, name)
    tokens = torch.randint(0, VOCAB, (2, 6))
    assert_rel_close(_loss(model, tokens).detach(), _loss(plain, tokens).detach(), RTOL, "loss")
    return dist.get_world_size() > 0


@pytest.mark.parametrize("meta", [False, True])
def test_a_full_state_dict_loads_each_module_under_its_own_name(meta):
    assert run_on_ranks(2, _load_full, meta) == [True, True]


def _refusal(ctx, case: str) -> str:
    model = Net()
    lists = {"empty": [], "twice": [model.norm, model.norm], "nested": [model, model.norm],
             "not a module": [model.norm, "head"]}
    try:
        fully_shard(lists[case])
    except (TypeError, ValueError) as e:
        return str(e)
    return "accepted"


@pytest.mark.parametrize("case, words", [("empty", "empty list"), ("twice", "twice"),
                                         ("nested", "is inside"), ("not a module", "str")])
def test_bad_lists_are_refused_by_name(case, words):
    message = run_on_ranks(1, _refusal, case)[0]
    assert words in message and "fully_shard" in message
