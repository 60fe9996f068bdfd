"""FSDP under torch.compile ([Note: FSDP under torch.compile], fsdp/collectives.py).

``fully_shard`` on each block and the root of the demo GPT, then ``torch.compile(model)`` or
``block.compile()`` on each block: dynamo must report no graph break, compile each block's
forward as one graph holding all of its operations (the gathers and frees stay in the units'
hooks, outside), and the losses and gradient shards of three AdamW steps must equal those of
one process training the unwrapped model on the whole batch. Counted with a graph-capturing
backend (``eager`` by default, ``aot_eager`` in the slow run, which also traces the backward
through AOTAutograd); torch.compile is slow on two CPUs, so the model is tiny.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwise import fully_shard
from shardwise.models import GPT, GPTConfig, lm_loss
from tests.harness import (
    assert_rel_close,
    local_part,
    rank_slice,
    run_on_ranks,
    shard0_rows,
    token_batch,
)

CFG = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16)
GLOBAL_BATCH = 4
STEPS = 3
RTOL = 1e-5
LINEARS_PER_BLOCK = 4  # qkv, proj, fc1, fc2


def _graph_break_counts() -> dict:
    from torch._dynamo.utils import counters  # dynamo's own tally of graph breaks

    return counters["graph_break"]


def _capturing(backend: str, graphs: list):
    """torch.compile's ``backend`` that also keeps every graph dynamo hands it."""
    from torch._dynamo import lookup_backend

    inner = lookup_backend(backend)

    def compiler(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return inner(gm, example_inputs)

    return compiler


def _reference(steps: int) -> tuple[list[float], GPT]:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = token_batch(step, 1, GLOBAL_BATCH, CFG.seq_len, CFG.vocab_size)
        loss = lm_loss(model(x[0]), y[0])
        loss.backward()
        losses.append(loss.item())
        if step < steps - 1:
            opt.step()
            opt.zero_grad()
    return losses, model


def _compiled_fsdp(ctx, how: str, backend: str):
    torch.compiler.reset()
    _graph_break_counts().clear()
    graphs: list = []
    compiler = _capturing(backend, graphs)
    torch.manual_seed(0)
    model = GPT(CFG)
    for block in model.blocks:
        fully_shard(block, process_group=ctx.group)
    fully_shard(model, process_group=ctx.group)
    if how == "model":
        run = torch.compile(model, backend=compiler)
    else:
        for block in model.blocks:
            block.compile(backend=compiler)
        run = model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = token_batch(step, 1, GLOBAL_BATCH, CFG.seq_len, CFG.vocab_size)
        x, y = (rank_slice(t[0], ctx.rank, ctx.world_size) for t in (x, y))
        loss = lm_loss(run(x), y)
        loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=ctx.group)
        losses.append(mean.item() / ctx.world_size)
        if step < STEPS - 1:
            opt.step()
            opt.zero_grad()
    ref_losses, reference = _reference(STEPS)
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        assert got == pytest.approx(want, rel=RTOL), f"{how}: step {step} loss"
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert_rel_close(local_part(p.grad), shard0_rows(ref[name].grad, ctx.rank,
                                                         ctx.world_size), RTOL, name)
    linears = [sum(1 for n in g.graph.nodes if "linear" in str(n.target)) for g in graphs]
    return dict(_graph_break_counts()), linears


def _check(results) -> None:
    for breaks, linears in results:
        assert breaks == {}, f"graph breaks: {list(breaks)}"
        # every block forward in one graph with all its operations (the two blocks share it)
        assert linears and all(n == LINEARS_PER_BLOCK for n in linears), linears


def test_compiled_fsdp_has_no_graph_break_and_matches_the_reference():
    _check(run_on_ranks(2, _compiled_fsdp, "model", "eager"))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["model", "blocks"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_compiled_fsdp_each_way_and_world_size(how, world_size):
    _check(run_on_ranks(world_size, _compiled_fsdp, how, "eager"))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["model", "blocks"])
def test_compiled_fsdp_through_aot_autograd(how):
    _check(run_on_ranks(2, _compiled_fsdp, how, "aot_eager"))
