"""The unshard buffer pool ([Note: unshard buffer pool], fsdp/buffer_pool.py): after the first
step every gather reuses memory a unit gave back, and the pool never holds more than the most
that was gathered at once. (That results do not change: the equivalence tests of
test_fsdp_training.py run with the pool.)"""

import pytest
import torch

from shardwise import fully_shard
from shardwise.fsdp import units_of, unsharded_bytes
from shardwise.fsdp.buffer_pool import StoragePool
from shardwise.models import GPT, GPTConfig, lm_loss
from tests.harness import run_on_ranks

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=4, n_head=2, d_model=32)


def _pooled_pointers(pool: StoragePool) -> set[int]:
    return {s.data_ptr() for free in pool._free.values() for s in free}


def _steps(ctx, forward_prefetch):
    torch.manual_seed(0)
    model = GPT(CFG)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model, forward_prefetch=forward_prefetch)
    units = units_of(model)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1))
    lm_loss(model(x[:, :-1]), x[:, 1:]).backward()  # the first step fills the pool
    pool = units[0].root_state.storage_pool
    after_first = pool.pooled_bytes()
    pooled = _pooled_pointers(pool)
    peak, fresh = [0], []

    def record(*_):
        held = unsharded_bytes(model) + pool.pooled_bytes()
        peak[0] = max(peak[0], held)
        for unit in units:  # every buffer gathered now is one the pool held before the step
            storage = unit.handle.full_data.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in pooled:
                fresh.append(storage.data_ptr())

    for m in model.modules():
        m.register_forward_pre_hook(record)
        m.register_forward_hook(record)
        m.register_full_backward_pre_hook(lambda *a: record())
        m.register_full_backward_hook(lambda *a: record())
    for _ in range(2):
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    root, block = (u.handle.layout.total * 4 for u in units[:2])
    return after_first, pool.pooled_bytes(), peak[0], fresh, root, block


@pytest.mark.parametrize("world_size", (1, 2))
@pytest.mark.parametrize("forward_prefetch", (False, True))
def test_gathers_after_the_first_step_reuse_pooled_buffers(world_size, forward_prefetch):
    for after_first, after, peak, fresh, root, block in run_on_ranks(world_size, _steps,
                                                                      forward_prefetch):
        assert fresh == []  # no gather allocated: each took a buffer from the pool
        assert after == after_first > 0  # the pool does not grow from step to step
        # gathered plus pooled memory stays within what forward and backward gather at once:
        # the root and two blocks (the running one and the next)
        assert after <= peak <= root + 2 * block, (after, peak, root, block)


def test_pool_moves_memory_without_copying_and_only_between_equal_sizes():
    pool = StoragePool()
    a = torch.arange(8, dtype=torch.float32)
    storage, pointer = a.untyped_storage(), a.data_ptr()
    assert pool.give(storage) and storage.nbytes() == 0 and pool.pooled_bytes() == 32
    other = torch.empty(0).untyped_storage()
    assert not pool.take(other, 16)  # no buffer of that size: the caller allocates
    assert pool.take(other, 32) and other.data_ptr() == pointer and pool.pooled_bytes() == 0
    assert not pool.give(torch.empty(0).untyped_storage())  # nothing to give
