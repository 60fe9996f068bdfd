"""The unshard buffer pool ([Note: unshard buffer pool], fsdp/collectives.py): each step
allocates only for its first gathers of forward and of backward, every other gather reuses
memory a unit gave back, and nothing waits in the pool while backward computes or after it.
(That results do not change: the equivalence tests of test_fsdp_training.py run with the
pool.)"""

import pytest
import torch

from shardwise import fully_shard
from shardwise.fsdp import units_of, unsharded_bytes
from shardwise.fsdp.collectives import StoragePool
from shardwise.models import GPT, GPTConfig, lm_loss
from tests.fsdp.gathering import gathering_units
from tests.harness import run_on_ranks

pytestmark = pytest.mark.skipif(
    not hasattr(torch.UntypedStorage, "_swap_data_ptr_"),
    reason="this torch has no UntypedStorage._swap_data_ptr_: FSDP gathers allocate (no pool)")

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=2, d_model=32)


def _steps(ctx, forward_prefetch):
    torch.manual_seed(0)
    model = GPT(CFG)
    with gathering_units():  # the pool serves gathers
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model, forward_prefetch=forward_prefetch)
    units = units_of(model)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1))
    lm_loss(model(x[:, :-1]), x[:, 1:]).backward()  # the first step records the order
    pool = units[0].root_state.storage_pool
    phase, peak, held_in_backward = ["forward"], [0], []
    takes = {"forward": [], "backward": []}  # per unshard: whether the pool had a buffer
    take = pool.take

    def counting_take(storage, nbytes):
        got = take(storage, nbytes)
        takes[phase[0]].append((got, nbytes))
        return got

    pool.take = counting_take

    def record(*_):
        peak[0] = max(peak[0], unsharded_bytes(model) + pool.pooled_bytes())
        if phase[0] == "backward":  # while a module computes, nothing waits in the pool
            held_in_backward.append(pool.pooled_bytes())

    for m in model.modules():
        m.register_forward_pre_hook(record)
        m.register_forward_hook(record)
        m.register_full_backward_pre_hook(lambda *a: record())
        m.register_full_backward_hook(lambda *a: record())
    after = []
    for _ in range(2):
        phase[0] = "forward"
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        phase[0] = "backward"
        loss.backward()
        after.append(pool.pooled_bytes())
    root, block = (u.handle.layout.total * 4 for u in units[:2])
    return takes, after, peak[0], root, block, max(held_in_backward)


@pytest.mark.parametrize("world_size", (1, 2))
@pytest.mark.parametrize("forward_prefetch", (False, True))
def test_gathers_reuse_pooled_buffers(world_size, forward_prefetch):
    for takes, after, peak, root, block, held in run_on_ranks(world_size, _steps,
                                                               forward_prefetch):
        # per step only the first gathers of forward (the root, the running block and the
        # prefetched one) and the first prefetch of backward allocate; every other gather, in
        # forward and in backward, takes the memory a unit gave back
        for phase in ("forward", "backward"):
            assert any(got for got, _ in takes[phase]), takes
        fresh = sum(n for phase in takes.values() for got, n in phase if not got)
        assert fresh <= 2 * (root + 3 * block), takes  # two steps
        assert held == 0
        assert after == [0, 0]  # nothing pooled through the optimizer step
        # gathered plus pooled memory stays within what forward and backward gather at once:
        # the root and two blocks (the running one and the next)
        assert peak <= root + 2 * block, (peak, root, block)


def test_pool_moves_memory_without_copying_and_only_between_equal_sizes():
    pool = StoragePool()
    a = torch.arange(8, dtype=torch.float32)
    storage, pointer = a.untyped_storage(), a.data_ptr()
    assert pool.give(storage) and storage.nbytes() == 0 and pool.pooled_bytes() == 32
    other = torch.empty(0).untyped_storage()
    assert not pool.take(other, 16)  # no buffer of that size: the caller allocates
    assert pool.take(other, 32) and other.data_ptr() == pointer and pool.pooled_bytes() == 0
    assert not pool.give(torch.empty(0).untyped_storage())  # nothing to give
