"""The logical bytes of each collective kind (pure): 4 ranks as 2 nodes x 2 ranks."""

import pytest

from shardwise.distributed.comm_patterns import CommStats, even_parts, sends, traffic

RANKS = (0, 1, 2, 3)


def _node(rank):
    return rank // 2  # 2 nodes of 2 ranks


def _at(kind, me, ranks=RANKS, **sizes):
    return traffic(kind, ranks, me, node_of=_node, **sizes)


def test_all_gather_sends_the_shard_to_every_other_rank():
    for me in range(4):  # 2 other ranks are on the other node
        assert _at("all_gather", me, nbytes=100) == CommStats(1, 100, 300, 200)


def test_reduce_scatter_sends_part_i_to_rank_i():
    for me in range(4):
        assert _at("reduce_scatter", me, nbytes=400, element_size=4) == CommStats(1, 400, 300, 200)
    # uneven parts: rank 0 keeps 10, sends 20 to rank 1, 30 and 40 to the other node
    assert _at("reduce_scatter", 0, parts=[10, 20, 30, 40]) == CommStats(1, 100, 90, 70)


def test_all_reduce_is_a_reduce_scatter_plus_an_all_gather():
    for me in range(4):  # 2 (n-1)/n B leave each rank; half of the destinations are remote
        assert _at("all_reduce", me, nbytes=400, element_size=4) == CommStats(1, 400, 600, 400)
    # 10 elements of 4 bytes on 4 ranks: parts of 3, 3, 2, 2 elements
    assert even_parts(40, 4, 4) == [12, 12, 8, 8]
    # rank 3 sends parts 0, 1, 2 (12 + 12 + 8) then its own part (8) three times
    assert _at("all_reduce", 3, nbytes=40, element_size=4) == CommStats(1, 40, 56, 40)
    # a group inside one node sends nothing across nodes; one across nodes sends everything
    assert _at("all_reduce", 0, ranks=(0, 1), nbytes=400, element_size=4).cross_node_bytes == 0
    assert _at("all_reduce", 0, ranks=(0, 2), nbytes=400, element_size=4) == CommStats(
        1, 400, 400, 400)


def test_rooted_kinds_send_from_or_to_the_root_only():
    assert _at("broadcast", 1, nbytes=48, peer=1) == CommStats(1, 48, 144, 96)
    assert _at("broadcast", 0, nbytes=48, peer=1) == CommStats(1, 0, 0, 0)
    assert _at("reduce", 0, nbytes=48, peer=0) == CommStats(1, 48, 0, 0)
    assert _at("reduce", 1, nbytes=48, peer=0) == CommStats(1, 48, 48, 0)
    assert _at("gather", 3, nbytes=48, peer=0) == CommStats(1, 48, 48, 48)
    assert _at("scatter", 0, parts=[1, 2, 3, 4], peer=0) == CommStats(1, 10, 9, 7)
    assert _at("scatter", 2, parts=[1, 2, 3, 4], peer=0) == CommStats(1, 0, 0, 0)
    with pytest.raises(ValueError, match="root or peer"):
        _at("broadcast", 0, nbytes=4)


def test_point_to_point_and_all_to_all():
    assert _at("send", 1, nbytes=48, peer=2) == CommStats(1, 48, 48, 48)
    assert _at("send", 0, nbytes=48, peer=1) == CommStats(1, 48, 48, 0)
    assert _at("recv", 2, peer=1) == CommStats(1, 0, 0, 0)
    assert _at("all_to_all", 2, parts=[1, 2, 3, 4]) == CommStats(1, 10, 7, 3)
    assert _at("barrier", 0) == CommStats(1, 0, 0, 0)


def test_fast_all_gather_by_broadcasts_adds_up_to_the_all_gather():
    # rank r broadcasts its shard: summed over the n broadcasts, each rank's bytes are the
    # all-gather's, whatever the node layout
    for me in range(4):
        parts = [_at("broadcast", me, nbytes=100, peer=r) for r in range(4)]
        total = sum(parts[1:], parts[0])
        assert (total.bytes, total.sent_bytes, total.cross_node_bytes) == (100, 300, 200)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="unknown collective kind 'allgather'"):
        sends("allgather", 0, 2)
    with pytest.raises(ValueError, match="outside a group of 2"):
        sends("all_gather", 2, 2)
    with pytest.raises(ValueError, match="3 parts for a group of 4"):
        sends("all_to_all", 0, 4, parts=[1, 2, 3])
