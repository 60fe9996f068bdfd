"""The direct gradient reduction ([Note: direct gradient reduction], reduction.py): large
parameters are reduce-scattered straight from autograd's gradients. Checked against the
one-process reference where it is easy to get wrong: a large parameter whose gradient arrives on
some ranks only (data-dependent control flow), a unit mixing large and packed parameters,
accumulation without sync (which must fall back to the flat buffer), and that the direct path is
really the one taken. Each runs with both transports of the exchanges: reads of the peers'
memory ([Note: gradient rows read from the peers]) and gloo's messages."""

import os

import pytest
import torch
from torch import nn

from shardwise import fully_shard
from shardwise.distributed.host.peers import DISABLE_VAR
from shardwise.fsdp import reduction
from tests.fsdp.unit_grads import assert_unit_grads
from tests.harness import WORLD_SIZES, peer_reads_permitted, run_on_ranks

RTOL = 1e-5
WIDTH = 512  # a 512 x 512 weight has chunks of at least 65536 elements at world size 4: direct
TRANSPORTS = [pytest.param("peer-read", marks=pytest.mark.skipif(
    not peer_reads_permitted(), reason="this host forbids reading a sibling's memory")), "gloo"]


def _with_transport(ctx, transport: str, fn, *args):
    """``fn(ctx, *args)`` with the exchanges' rows read from the peers or sent through gloo;
    checks that the transport asked for is the one taken."""
    reads = []
    original = reduction.PulledExchange.read

    def counting(self):
        reads.append(1)
        return original(self)

    reduction.PulledExchange.read = counting
    if transport == "gloo":
        os.environ[DISABLE_VAR] = "1"
    try:
        result = fn(ctx, *args)
    finally:
        os.environ.pop(DISABLE_VAR, None)
        reduction.PulledExchange.read = original
    if ctx.world_size > 1:
        assert bool(reads) == (transport == "peer-read"), (transport, len(reads))
    return result


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.big = nn.Linear(WIDTH, WIDTH)  # weight direct, bias packed
        self.branch = nn.Linear(WIDTH, WIDTH)  # used only when the input asks for it
        self.norm = nn.LayerNorm(WIDTH)  # packed

    def forward(self, x, use_branch: bool):
        h = torch.tanh(self.big(x))
        if use_branch:
            h = h + self.branch(h)
        return self.norm(h)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.head = Block(), nn.Linear(WIDTH, 4)

    def forward(self, x, use_branch: bool):
        return self.head(self.block(x, use_branch))


def _counting_starts():
    calls = []
    original = reduction.DirectGrads.start

    def start(self, *args):
        calls.append(1)
        return original(self, *args)

    return calls, original, start


def _train(ctx, accumulate: int):
    calls, original, counting = _counting_starts()
    reduction.DirectGrads.start = counting
    try:
        torch.manual_seed(0)
        reference, model = Net(), Net()
        model.load_state_dict(reference.state_dict())
        fully_shard(model.block)
        fully_shard(model)
        gen = torch.Generator().manual_seed(3)
        for step in range(3):
            xs = torch.randn(accumulate, ctx.world_size, 2, WIDTH, generator=gen)
            # the branch runs on rank 0 only, so its gradient arrives there alone (step 1: none)
            branch = [r == 0 and step != 1 for r in range(ctx.world_size)]
            reference.zero_grad()
            for micro in xs:
                for r, x in enumerate(micro):
                    loss = reference(x, branch[r]).square().mean()
                    (loss / ctx.world_size).backward()
            model.zero_grad()
            for k, micro in enumerate(xs):
                model.set_requires_gradient_sync(k == accumulate - 1)
                model(micro[ctx.rank], branch[ctx.rank]).square().mean().backward()
            assert_unit_grads(model, reference, f"step {step}", RTOL)
        return len(calls)
    finally:
        reduction.DirectGrads.start = original


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_direct_reduction_matches_reference_with_rank_dependent_branches(world_size, transport):
    calls = run_on_ranks(world_size, _with_transport, transport, _train, 1)
    if world_size > 1:  # two units, three steps, every reduction direct
        assert calls == [6] * world_size


@pytest.mark.parametrize("world_size", [2, 4])
def test_accumulation_without_sync_uses_the_flat_buffer_and_matches(world_size):
    calls = run_on_ranks(world_size, _train, 2)
    assert calls == [0] * world_size  # the synced backward adds to gradients kept unsynced


class TwoBlockNet(nn.Module):
    """Two units before the root's head; ``branch_of[k]`` says whether block k runs its branch."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x, branch_of: tuple[bool, bool]):
        for block, branch in zip(self.blocks, branch_of):
            x = block(x, branch)
        return self.head(x)


def _train_two_units(ctx, direct: bool):
    original = reduction.direct_possible
    if not direct:  # every unit reduces through its flat buffer (as with NCCL)
        reduction.direct_possible = lambda handle: False
    try:
        _two_units_steps(ctx, steps=2)
    finally:
        reduction.direct_possible = original


def _two_units_steps(ctx, steps: int):
    torch.manual_seed(0)
    reference, model = TwoBlockNet(), TwoBlockNet()
    model.load_state_dict(reference.state_dict())
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    gen = torch.Generator().manual_seed(5)
    for step in range(steps):
        xs = torch.randn(ctx.world_size, 2, WIDTH, generator=gen)
        # the later block's branch runs on rank 0 only: its gradient arrives there alone, and
        # in backward the earlier block's exchanges come after it on every rank
        branches = [(True, r == 0) for r in range(ctx.world_size)]
        reference.zero_grad()
        for r, x in enumerate(xs):
            (reference(x, branches[r]).square().mean() / ctx.world_size).backward()
        model.zero_grad()
        model(xs[ctx.rank], branches[ctx.rank]).square().mean().backward()
        assert_unit_grads(model, reference, f"step {step}", RTOL)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("path", [*TRANSPORTS, "flat-buffer"])
def test_a_gradient_missing_on_some_ranks_does_not_stall_the_units_after_it(world_size, path):
    """The later unit cannot wait for its whole set of gradients on the ranks that miss one:
    those ranks would move on to the earlier unit, and the ranks' reductions would pair up
    the wrong units (seen: gradients 0.6 of their scale off) or wait for each other."""
    if path == "flat-buffer":
        run_on_ranks(world_size, _train_two_units, False, timeout=60)
    else:
        run_on_ranks(world_size, _with_transport, path, _train_two_units, True, timeout=60)


class DeepBlock(nn.Module):
    """Three large layers, then a branch that runs only when asked: in backward the branch's
    gradient comes first, followed by three large gradients that every rank gets."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(3)])
        self.branch = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, use_branch: bool):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x + self.branch(x) if use_branch else x


def _train_deep_unit(ctx):
    torch.manual_seed(0)
    reference, model = DeepBlock(), DeepBlock()
    model.load_state_dict(reference.state_dict())
    fully_shard(model)
    xs = torch.randn(ctx.world_size, 2, WIDTH, generator=torch.Generator().manual_seed(7))
    for r, x in enumerate(xs):
        (reference(x, r == 0).square().mean() / ctx.world_size).backward()
    model(xs[ctx.rank], ctx.rank == 0).square().mean().backward()
    assert_unit_grads(model, reference, "deep unit", RTOL)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_rank_without_a_gradient_does_not_deadlock_the_exchanges_after_it(world_size,
                                                                            transport):
    """Rank 0 sends the branch's rows first and, when the next gradient arrives, waits for that
    exchange, which the other ranks complete (with zeros) only where the unit's backward ends;
    they, meanwhile, wait for exchanges that rank 0 posts after its wait. Waiting without end
    there would hang every rank."""
    run_on_ranks(world_size, _with_transport, transport, _train_deep_unit, timeout=60)
