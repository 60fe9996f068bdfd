"""Whether boxes tile a tensor exactly, in O(n log n) for n boxes whichever dims they split
([Note: exact tiling by corner counts]).

[Note: exact tiling by corner counts]
Boxes ``[a, b)`` (``a`` the offsets, ``b = a + sizes``) inside a tensor ``T = [0, s)`` tile it
exactly (every element held once: no overlap, no gap) if and only if the function
``f = sum_i 1[box_i] - 1[T]`` is zero on ``T``. Claim: that is decided by counting corners.

On one dim, restricted to ``[0, s)``: ``1[a <= x < b] = u_a(x) - u_b(x)`` with the step
``u_c(x) = 1[x >= c]``, and ``u_s`` is zero there. A box is a product over dims, so expanding
the product writes ``1[box]`` on ``T`` as a signed sum of orthants ``O_v = {x : x >= v}``, one
per corner ``v`` (each coordinate ``a_d`` or ``b_d``; sign ``(-1)^(number of b's)``), corners
with a coordinate equal to ``s_d`` dropped (their orthant misses ``T``). So on ``T``,
``f = sum_v c(v) 1[O_v]`` over points ``v`` of ``T`` with integer weights ``c(v)``. The
orthants of distinct points are linearly independent: if some ``c(v) != 0``, let ``v`` be the
lexicographically smallest such point; every other ``u <= v`` (componentwise) is smaller
lexicographically, so ``f(v) = sum_{u <= v} c(u) = c(v) != 0``. Hence: the boxes tile ``T``
exactly iff every weight is zero, and when one is not, the lexicographically first such corner
``v`` is itself an element held ``1 + c(v)`` times: twice or more (an overlap there) when
``c(v) > 0``, by nothing (a gap there) when ``c(v) < 0``.

The weights are summed one dim at a time: group the signed boxes by the coordinate where they
start (sign kept) and end (sign flipped; skipped at ``s_d``), then do the same on the rest of
the dims within each group, smallest coordinate first, so the first nonzero weight found is
the lexicographically first. Identical remaining boxes are merged (their signs summed) before
going deeper, which is what keeps the common layouts cheap: in a column tiling of ``[1, N]``
the N chunks give 2N events on dim 1, each coordinate's two cancel; row bands, grids and
staggered "brick" layouts cancel the same way at each shared boundary. The work per box is at
most ``2^k`` group entries for ``k`` dims it splits, and each level sorts its coordinates:
``O(2^k n log n)``, that is ``O(n log n)`` for a tensor of a given number of dims, whichever
dims the chunks split (the sweep along dim 0 that it replaces compared every box with every
box whose rows it reached: quadratic for a column tiling). The grouping uses an explicit
stack, so a tensor of many dims cannot exhaust the recursion limit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)
_Key = tuple[tuple[int, ...], tuple[int, ...]]  # (starts, ends) of the dims not yet grouped


@dataclass(frozen=True)
class Fault:
    """Why boxes do not tile a tensor: ``dims`` / ``outside`` (box ``first``), ``overlap``
    (boxes ``first`` and ``second`` both hold the element ``point``), ``gap`` (no box holds
    ``point``; ``covered`` of ``total`` elements are held, counting overlaps)."""

    kind: str
    first: int = -1
    second: int = -1
    point: tuple[int, ...] = ()
    covered: int = 0
    total: int = 0


def tiling_fault(shape: Sequence[int], boxes: Sequence[Box]) -> Fault | None:
    """None when ``boxes`` lie inside ``shape`` and tile it exactly; else the first fault found:
    a box with the wrong number of dims or reaching outside, else the lexicographically first
    element held twice or by nothing (see the Note). Pure."""
    shape = tuple(shape)
    for i, (offsets, sizes) in enumerate(boxes):
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            return Fault("dims", i)
        if any(o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape)):
            return Fault("outside", i)
    signed: dict[_Key, int] = {}
    for offsets, sizes in boxes:
        if all(sizes):  # an empty box holds nothing
            key = (tuple(offsets), tuple(o + n for o, n in zip(offsets, sizes)))
            signed[key] = signed.get(key, 0) + 1
    if all(shape):
        whole = ((0,) * len(shape), shape)
        signed[whole] = signed.get(whole, 0) - 1
    found = first_nonzero_corner(shape, signed)
    if found is None:
        return None
    point, weight = found
    if weight > 0:
        holders = [i for i, (o, n) in enumerate(boxes)
                   if all(a <= x < a + m for a, m, x in zip(o, n, point))]
        return Fault("overlap", holders[0], holders[1], point)
    covered = sum(math.prod(sizes) for _, sizes in boxes)
    return Fault("gap", point=point, covered=covered, total=math.prod(shape))


def first_nonzero_corner(shape: tuple[int, ...], signed: dict[_Key, int]
                         ) -> tuple[tuple[int, ...], int] | None:
    """The lexicographically first corner with a nonzero weight, and the weight (the Note);
    ``signed`` maps each box ``(starts, ends)`` (inside ``shape``) to its signed count."""
    stack: list[tuple[tuple[int, ...], dict[_Key, int]]] = [((), signed)]
    while stack:
        point, level = stack.pop()
        dim = len(point)
        if dim == len(shape):
            weight = sum(level.values())
            if weight:
                return point, weight
            continue
        events: dict[int, dict[_Key, int]] = {}
        for (starts, ends), count in level.items():
            rest = (starts[1:], ends[1:])
            group = events.setdefault(starts[0], {})
            group[rest] = group.get(rest, 0) + count
            if ends[0] < shape[dim]:
                group = events.setdefault(ends[0], {})
                group[rest] = group.get(rest, 0) - count
        for x in sorted(events, reverse=True):  # popped smallest first
            left = {key: count for key, count in events[x].items() if count}
            if left:
                stack.append(((*point, x), left))
    return None
