"""Bytes that one rank's part in a collective sends, and to whom (pure functions).

[Note: counting communication]
A collective is counted by its logical pattern, not by the algorithm the backend picks (ring,
tree, ...): what data of this rank must reach which other rank for the result to exist.

    kind            this rank's input     sent to each other rank j of the group
    all_gather      shard (s bytes)       s
    reduce_scatter  full buffer           part j of the buffer (parts: the n equal slices)
    all_reduce      buffer (B bytes)      part j, then its own reduced part i: a reduce-scatter
                                          plus an all-gather, 2 (n-1)/n B in all
    broadcast       B on the root         B from the root; nothing from the others
    reduce, gather  B                     B to the root only (the root sends nothing)
    scatter         parts on the root     part j from the root
    all_to_all      parts                 part j
    send / recv     B / -                 B to the peer / nothing
    barrier         -                     nothing (counted as a call)

A rank's ``sent_bytes`` sums what it sends to other ranks (its own part stays put);
``cross_node_bytes`` is the share whose destination is on another node, the node of a global
rank being ``rank // local_world_size`` (torchrun's numbering). Summed over the ranks of a
group, ``sent_bytes`` is the traffic of the collective. A collective built from other ones is
counted by its pieces, and the pieces add up to the logical collective's bytes: an all-gather
made of ``n`` broadcasts (rank r broadcasts its shard: the shard reaches every other rank)
sends ``(n-1) s`` from each rank as an all-gather does; a reduce-scatter made of point-to-point
sends ships part j to rank j, as a reduce-scatter does. Such pieces are listed under their own
kind (broadcast, send), since that is what c10d ran.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "gather",
         "scatter", "all_to_all", "send", "recv", "barrier")


@dataclass(frozen=True)
class CommStats:
    """What one rank handed to collectives and sent; see [Note: counting communication]."""

    calls: int = 0
    bytes: int = 0  # bytes of this rank's own data put into the collectives
    sent_bytes: int = 0  # bytes that leave this rank for other ranks (logical pattern)
    cross_node_bytes: int = 0  # the part of sent_bytes that goes to ranks on other nodes

    def __add__(self, other: CommStats) -> CommStats:
        return CommStats(self.calls + other.calls, self.bytes + other.bytes,
                         self.sent_bytes + other.sent_bytes,
                         self.cross_node_bytes + other.cross_node_bytes)


def even_parts(nbytes: int, n: int, element_size: int = 1) -> list[int]:
    """``nbytes`` split into ``n`` parts of whole elements, the first ones one element larger
    when the elements do not divide evenly (how a ring reduce-scatter splits a buffer)."""
    if n < 1:
        raise ValueError(f"cannot split into {n} parts")
    elements, extra = divmod(nbytes // element_size, n)
    return [(elements + (1 if j < extra else 0)) * element_size for j in range(n)]


def sends(kind: str, me: int, n: int, *, nbytes: int = 0, parts: Sequence[int] | None = None,
          peer: int | None = None, element_size: int = 1) -> tuple[int, list[tuple[int, int]]]:
    """``(bytes handed in, [(group rank, bytes sent to it), ...])`` for group rank ``me`` of a
    group of ``n`` ranks. ``nbytes``: this rank's buffer; ``parts``: bytes per destination
    (reduce_scatter, scatter, all_to_all; default: ``nbytes`` split evenly); ``peer``: the root
    (broadcast, reduce, gather, scatter) or the other end (send, recv)."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; known: {list(KINDS)}")
    if not 0 <= me < n:
        raise ValueError(f"group rank {me} is outside a group of {n}")
    others = [j for j in range(n) if j != me]
    if parts is None:
        parts = even_parts(nbytes, n, element_size)
    elif len(parts) != n:
        raise ValueError(f"{kind}: {len(parts)} parts for a group of {n} ranks")
    if kind == "all_gather":
        return nbytes, [(j, nbytes) for j in others]
    if kind in ("reduce_scatter", "all_to_all"):
        return sum(parts), [(j, parts[j]) for j in others]
    if kind == "all_reduce":
        return nbytes, [(j, parts[j]) for j in others] + [(j, parts[me]) for j in others]
    if kind in ("barrier", "recv"):
        return 0, []
    return _rooted(kind, me, others, nbytes, parts, peer)


def _rooted(kind: str, me: int, others: list[int], nbytes: int, parts: Sequence[int],
            peer: int | None) -> tuple[int, list[tuple[int, int]]]:
    if peer is None:
        raise ValueError(f"{kind}: the root or peer rank is required")
    if kind == "send":
        return nbytes, [(peer, nbytes)]
    if kind == "broadcast":
        return (nbytes, [(j, nbytes) for j in others]) if me == peer else (0, [])
    if kind == "scatter":
        return (sum(parts), [(j, parts[j]) for j in others]) if me == peer else (0, [])
    return nbytes, ([] if me == peer else [(peer, nbytes)])  # reduce, gather


def traffic(kind: str, group_ranks: Sequence[int], me: int, *,
            node_of: Callable[[int], int], **sizes: object) -> CommStats:
    """One call of ``kind`` by group rank ``me`` of the group whose global ranks are
    ``group_ranks``, as a ``CommStats`` (``sizes``: the keywords of ``sends``)."""
    handed, out = sends(kind, me, len(group_ranks), **sizes)  # type: ignore[arg-type]
    home = node_of(group_ranks[me])
    sent = sum(b for _, b in out)
    cross = sum(b for j, b in out if node_of(group_ranks[j]) != home)
    return CommStats(1, handed, sent, cross)
