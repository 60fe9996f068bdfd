"""Memory: sharded state between steps, and the unsharded bytes (parameters and gradients) alive
during forward and backward."""

import os
import sys

import pytest
import torch

from shardwise import fully_shard
from shardwise._compat import storage_use_count
from shardwise.fsdp import unit as unit_module
from shardwise.fsdp import units_of, unsharded_bytes, unsharded_grad_bytes
from shardwise.memory import state_bytes
from shardwise.memory.heap import release_free_heap
from shardwise.models import GPT, GPTConfig, lm_loss
from tests.fsdp.gathering import gathering_units
from tests.harness import WORLD_SIZES, run_on_ranks

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=2, d_model=32)


def _shard(model, forward_prefetch=False):
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model, forward_prefetch=forward_prefetch)


def _between_steps(ctx):
    torch.manual_seed(0)
    reference = GPT(CFG)
    model = _shard(GPT(CFG))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1))
    for net, o in ((reference, ref_opt), (model, opt)):
        for _ in range(2):
            o.zero_grad()
            lm_loss(net(x[:, :-1]), x[:, 1:]).backward()
            o.step()
    ours, full = state_bytes(model, opt), state_bytes(reference, ref_opt)
    n_params = len(list(reference.parameters()))
    # each parameter's chunk is padded to whole rows: at most one row per parameter, fp32
    pad = sum(p[0].numel() if p.dim() else 1 for p in reference.parameters()) * 4
    # AdamW's per-parameter `step` counters (4-byte scalars) are replicated, not sharded
    steps = n_params * 4
    assert ours.params <= full.params / ctx.world_size + pad, (ours, full)
    assert ours.grads <= full.grads / ctx.world_size + pad, (ours, full)
    assert ours.optimizer <= (full.optimizer - steps) / ctx.world_size + 2 * pad + steps
    assert unsharded_bytes(model) == 0  # nothing gathered between steps
    return ours.total, full.total


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_each_rank_holds_one_nth_of_params_grads_and_adamw_state(world_size):
    totals = run_on_ranks(world_size, _between_steps)
    full = totals[0][1]
    # together the ranks hold the whole state once (plus padding and replicated step counters)
    assert sum(t for t, _ in totals) >= full


def _unsharded_peak(ctx, forward_prefetch):
    torch.manual_seed(0)
    with gathering_units():  # the gathers' buffers are what this measures
        model = _shard(GPT(CFG), forward_prefetch)
    peaks = {"forward": 0, "backward": 0, "grads": 0}
    phase = ["forward"]

    def record(*_):
        peaks[phase[0]] = max(peaks[phase[0]], unsharded_bytes(model))
        peaks["grads"] = max(peaks["grads"], unsharded_grad_bytes(model))

    for m in model.modules():  # every module's entry and exit, forward and backward
        m.register_forward_pre_hook(record)
        m.register_forward_hook(record)
        m.register_full_backward_pre_hook(lambda *a: record())
        m.register_full_backward_hook(lambda *a: record())
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1))
    for _ in range(3):  # the first forward records the order that later ones prefetch by
        phase[0] = "forward"
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        phase[0] = "backward"
        loss.backward()
        assert unsharded_grad_bytes(model) == 0  # every reduction finished, its buffer freed
    units = units_of(model)[:2]
    root, block = (u.handle.layout.total * 4 for u in units)  # unsharded parameters, fp32
    # flat gradients are rank-major with every chunk padded to whole rows
    grad_root, grad_block = (ctx.world_size * u.handle.layout.shard_numel * 4 for u in units)
    return peaks, root, block, grad_root, grad_block


@pytest.mark.parametrize("world_size", (1, 2))
@pytest.mark.parametrize("forward_prefetch", (False, True))
def test_unsharded_bytes_during_forward_stay_within_the_prefetch_limit(world_size,
                                                                       forward_prefetch):
    peaks, root, block, grad_root, grad_block = run_on_ranks(world_size, _unsharded_peak,
                                                             forward_prefetch)[0]
    # forward: the root and the running block, plus one prefetched block with forward_prefetch;
    # never all four blocks
    assert peaks["forward"] == root + (2 if forward_prefetch else 1) * block, peaks
    # backward: the same bound (a prefetch waits until the block before it has freed its own)
    assert peaks["backward"] <= root + 2 * block, peaks
    # flat gradients (fp32, as the parameters): the root's, whose head gets the first gradient of
    # backward, and one block's; a block's reduction is finished before the next block's first
    # gradient arrives, so two blocks' flat gradients are never alive together
    assert grad_block <= peaks["grads"] <= grad_root + grad_block, peaks


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not release_free_heap(), reason="the C library has no malloc_trim")
def test_release_free_heap_returns_freed_heap_pages_to_the_os():
    # 64 KiB blocks are under glibc's smallest mmap threshold: they come from the heap. Freeing
    # every other one leaves free blocks between live ones, which glibc keeps resident
    blocks = [torch.ones(16 * 1024) for _ in range(512)]  # 32 MiB
    freed = blocks[::2]
    del blocks[::2]
    release_free_heap()
    before = _rss()
    freed.clear()
    kept = _rss()
    release_free_heap()
    after = _rss()
    assert after <= kept - 8 * 2**20, (before, kept, after)  # most of 16 MiB left the RSS
    assert all(float(b[0]) == 1.0 for b in blocks)  # the live blocks are untouched


def _heap_releases(ctx):
    torch.manual_seed(0)
    model = _shard(GPT(CFG))
    calls = []
    original = unit_module.release_free_heap
    unit_module.release_free_heap = lambda: calls.append(1) or True
    try:
        x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1))
        counts = []
        for _ in range(2):
            lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
            counts.append(len(calls))
    finally:
        unit_module.release_free_heap = original
    return counts, len(units_of(model))


def test_free_heap_is_released_once_per_backward_where_it_starts():
    counts, n_units = run_on_ranks(2, _heap_releases)[0]
    # one release per backward ([Note: allocator slack]): at its first unit, before anything
    # is gathered or a gradient made; none when forward starts, not per unit, gradient or hook
    assert n_units > 1 and counts == [1, 2]


WIDE = 512  # a 512 x 512 weight has chunks of 131072 elements at world size 2: sent directly


def _wide_unit_backward(ctx):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(WIDE, WIDE) for _ in range(4)]
    model = torch.nn.Sequential(torch.nn.Sequential(*layers), torch.nn.Linear(WIDE, 2))
    with gathering_units():  # the gathered rows' release is what this watches
        fully_shard(model[0])
        fully_shard(model)
    handle = units_of(model[0])[0].handle
    weights = [i for i, s in enumerate(handle.slots) if s.shape == (WIDE, WIDE)]
    seen = {"held": 0, "rows_at_second": None}
    arrived = []

    def after_grad(index, leaf):  # runs after the unit's own hook on the same leaf
        seen["held"] = max(seen["held"], handle.unsharded_grad_bytes())
        arrived.append(index)
        if len(arrived) == 2:  # two more weights to come: the unit's backward goes on
            first = handle.slots[arrived[0]]
            rows = handle.full_data[first.offset : first.offset + first.numel]
            inner = rows[4096 : -4096]  # whole pages: the ends may share a page with another
            assert handle.unsharded_bytes() > 0  # the unit's parameters are still gathered
            seen["rows_at_second"] = (float(inner.abs().max()), float(first.local.abs().max()))

    for i in weights:
        handle.leaves[i].register_post_accumulate_grad_hook(lambda leaf, i=i: after_grad(i, leaf))
    x = torch.randn(3, WIDE, generator=torch.Generator().manual_seed(ctx.rank))
    for _ in range(2):
        arrived.clear()
        model(x).square().mean().backward()
    return seen, WIDE * WIDE * 4, WIDE * 4 * len(handle.slots)


def test_a_unit_holds_one_large_gradient_in_flight_not_all_of_its_gradients():
    for seen, weight, small in run_on_ranks(2, _wide_unit_backward):
        # each weight gradient is sent as it arrives and the one before it let go then
        # ([Note: direct gradient reduction]): at most two weights' gradients (and the small
        # parameters' packed buffer) at once, never the four
        assert 0 < seen["held"] <= 2 * weight + 2 * small, (seen, weight)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_a_parameters_gathered_rows_are_released_once_its_gradient_is_in():
    for seen, _, _ in run_on_ranks(2, _wide_unit_backward):
        released, shard = seen["rows_at_second"]
        # before the unit's backward ends, the rows of the weight whose gradient came first no
        # longer hold its values: their pages went back to the OS ([Note: releasing a dead
        # parameter's rows]) and read as zeros; the weight itself is nonzero
        assert shard > 0 and released == 0.0, seen


def _wide_root_only(ctx):
    torch.manual_seed(0)
    model = torch.nn.Linear(WIDE, WIDE)
    reference = torch.nn.Linear(WIDE, WIDE)
    reference.load_state_dict(model.state_dict())
    fully_shard(model)  # the root is its only unit: gathered in forward, never resharded before
    xs = [torch.randn(3, WIDE, generator=torch.Generator().manual_seed(r))
          for r in range(ctx.world_size)]
    model(xs[ctx.rank]).square().mean().backward()  # its weight's rows released mid-backward
    for x in xs:
        reference(x).square().mean().backward()
    grad = model.weight.grad.full_tensor() if hasattr(model.weight.grad, "full_tensor") \
        else model.weight.grad
    return float((grad - reference.weight.grad / ctx.world_size).abs().max())


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_a_root_units_rows_are_released_in_its_first_backward(world):
    # the root is gathered from its first forward on: a release before any reshard must work
    for err in run_on_ranks(world, _wide_root_only):
        assert err < 1e-6, err


def _grad_addresses(ctx, keep: bool):
    """Three steps; ``keep``: the user holds each step's sharded gradients (clones of their
    values beside them) after zero_grad. Returns each step's gradient addresses, whether every
    held gradient kept its values, and the final parameters."""
    torch.manual_seed(0)
    model = _shard(GPT(CFG))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    held, addresses = [], []
    for step in range(3):
        x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=torch.Generator()
                          .manual_seed(100 * step + ctx.rank))
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        addresses.append([g.data_ptr() for g in grads])
        if keep:
            held.append([(g, g.clone()) for g in grads])
        opt.step()
        opt.zero_grad(set_to_none=True)
        del grads
    intact = all(torch.equal(g, copy) for step in held for g, copy in step)
    return addresses, intact, [p.full_tensor().detach() for p in model.parameters()]


@pytest.mark.skipif(not storage_use_count, reason="this torch cannot count storage uses: each "
                    "step allocates the reduced shards")
@pytest.mark.parametrize("world", [2, 4])
def test_reduced_gradients_reuse_their_memory_unless_somebody_holds_them(world):
    # [Note: a reduced-gradient buffer kept across steps] (memory/kept_buffer.py)
    dropped = run_on_ranks(world, _grad_addresses, False)
    held = run_on_ranks(world, _grad_addresses, True)
    for rank in range(world):
        addresses, _, params = dropped[rank]
        assert addresses[0] == addresses[1] == addresses[2]  # the same memory, step after step
        kept_addresses, intact, kept_params = held[rank]
        assert intact  # a gradient the user holds is never written over
        assert not set(kept_addresses[0]) & set(kept_addresses[1])
        for ours, theirs in zip(params, kept_params, strict=True):
            assert torch.equal(ours, theirs)  # reused or not, training is the same
