"""memory/kept_buffer.py: a buffer handed out again only when nothing else holds its storage."""

from __future__ import annotations

import pytest
import torch

from shardwise._compat import storage_use_count
from shardwise.fsdp.layout import at_storage_start
from shardwise.memory.kept_buffer import KeptBuffer

pytestmark = pytest.mark.skipif(not storage_use_count, reason="this torch cannot count storage "
                                "uses: every take allocates")
CPU = torch.device("cpu")


def test_a_buffer_nobody_else_holds_is_handed_out_again():
    kept = KeptBuffer()
    first = kept.take(1000, torch.float32, CPU)
    address = first.data_ptr()
    del first
    assert kept.take(1000, torch.float32, CPU).data_ptr() == address


@pytest.mark.parametrize("hold", ["tensor", "view", "storage slice", "storage"])
def test_a_buffer_still_held_is_never_handed_out_again(hold):
    kept = KeptBuffer()
    first = kept.take(1000, torch.float32, CPU)
    first.fill_(7.0)
    holders = {"tensor": lambda t: t, "view": lambda t: t[500:],
               "storage slice": lambda t: at_storage_start(t[500:]),  # a DTensor grad's local
               "storage": lambda t: t.untyped_storage()}
    held = holders[hold](first)
    del first
    second = kept.take(1000, torch.float32, CPU)
    second.fill_(0.0)
    values = held if isinstance(held, torch.Tensor) else torch.empty(0).set_(held)
    assert bool((values == 7.0).all())  # what somebody holds keeps its values
    address = second.data_ptr()
    del second
    assert kept.take(1000, torch.float32, CPU).data_ptr() == address  # the newer one is kept


def test_another_size_or_dtype_gets_a_new_buffer():
    kept = KeptBuffer()
    kept.take(10, torch.float32, CPU)
    assert kept.take(20, torch.float32, CPU).numel() == 20
    assert kept.take(20, torch.float64, CPU).dtype == torch.float64
