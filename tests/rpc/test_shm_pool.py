"""The shared-memory pool's bookkeeping without processes: regions, reclaiming, trimming,
and the reader's checks of descriptors."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from shardwise.rpc.wire import shm_pool
from shardwise.rpc.wire.shm_pool import PAGE, PoolError, PoolReader, PoolWriter

MB = 1 << 20


def _pool(size: int):
    mem = bytearray(PAGE + size)  # one buffer seen by both sides, as a shared mapping is
    dropped: list[tuple[int, int]] = []
    writer = PoolWriter(memoryview(mem), size, lambda off, n: dropped.append((off, n)))
    return writer, PoolReader(memoryview(mem), size), dropped


def test_regions_are_lent_until_the_reader_frees_them():
    writer, reader, _ = _pool(8 * MB)
    a = writer.alloc(3 * MB)
    b = writer.alloc(3 * MB)
    assert a == (0, 0) and b == (1, 3 * MB)
    assert writer.alloc(3 * MB) is None  # 2 MB left: the sender uses a segment instead
    writer.write(b[1], memoryview(bytes([7]) * (3 * MB)))
    arr = reader.take(*b, 3 * MB)
    assert arr.nbytes == 3 * MB and bool((arr == 7).all())
    with pytest.raises(PoolError, match="not lent"):
        reader.take(*b, 3 * MB)  # never two arrays over one region
    view = arr[10:20]
    del arr
    gc.collect()
    assert writer.alloc(3 * MB) is None  # a view of the array still holds the region
    del view
    gc.collect()
    assert writer.alloc(3 * MB) == (1, 3 * MB)  # freed: the same region again


def test_reader_refuses_regions_outside_the_pool_or_never_lent():
    writer, reader, _ = _pool(4 * MB)
    for slot, offset, n in [(0, 0, 1), (shm_pool.SLOTS, 0, 1), (0, 3, 1), (0, 0, 4 * MB + 1),
                            (0, -PAGE, 1)]:
        with pytest.raises(PoolError):
            reader.take(slot, offset, n)


def test_pages_beyond_keep_are_given_back_once_nothing_is_lent(monkeypatch):
    monkeypatch.setattr(shm_pool, "KEEP", 4 * MB)
    clock = [100.0]
    monkeypatch.setattr(shm_pool, "_now", lambda: clock[0])
    writer, reader, dropped = _pool(16 * MB)
    held = [reader.take(*writer.alloc(5 * MB), 5 * MB) for _ in range(2)]
    assert writer.alloc(PAGE) is not None and dropped == []  # regions lent: nothing dropped
    del held
    gc.collect()
    writer.alloc(PAGE)  # the page lent before is still out: nothing dropped yet
    assert dropped == []
    for slot in range(shm_pool.SLOTS):
        writer.words[8 + slot] = 0  # the reader freed everything
    assert writer.alloc(PAGE) == (0, 0) and dropped == []  # but used within IDLE: kept warm
    writer.words[8] = 0
    clock[0] += shm_pool.IDLE + 1
    assert writer.alloc(PAGE) == (0, 0)
    assert dropped == [(4 * MB, 10 * MB + PAGE - 4 * MB)]


def test_all_slots_lent_means_no_region():
    writer, _, _ = _pool(shm_pool.SLOTS * PAGE + PAGE)
    for _ in range(shm_pool.SLOTS):
        assert writer.alloc(1) is not None
    assert writer.alloc(1) is None
    assert np.frombuffer(writer.words, np.uint64)[8:8 + shm_pool.SLOTS].all()
