"""A rank's side of the element-wise ZeRO partition ([Note: ZeRO element partition] in
elements.py): the flat buffers, this rank's pieces, the all-gather after a step, and the
translation of the local optimizer's state to and from torch's whole-parameter state dict.

The trainable parameters of each dtype are re-pointed at consecutive slices of one flat buffer
of ``world * chunk`` elements (their values copied in), so that after a step one flat
all-gather (``all_gather_single``) per dtype, from this rank's range into the whole buffer,
leaves every parameter updated in place: no unflattening copy, and only this rank's range
(``1 / world`` of the parameters) copied as the collective's input. An all-gather rather than
broadcasts from owners: every rank contributes an equal range, and the collective moves each
range once to every other rank, ``(world - 1) / world`` of the parameter bytes sent per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardwise._compat import dist_all_gather
from shardwise.zero.elements import Piece, Segment, bucket_parts, segments_of
from shardwise.zero.partition import global_indices


class ElementShards:
    """The element partition of ``groups`` (the optimizer's param-group parameter lists) on
    rank ``rank`` of ``process_group``."""

    def __init__(self, groups: Sequence[Sequence[torch.Tensor]],
                 process_group: dist.ProcessGroup):
        self.group = process_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.groups = [list(g) for g in groups]
        self.segments: dict[torch.dtype, Segment] = segments_of(self.groups, self.world)
        self.flats: dict[torch.dtype, torch.Tensor] = {}
        self._join_into_buffers()
        # this rank's pieces with their 1-D views into the parameters, in group order
        self.pieces: list[tuple[Piece, torch.Tensor, torch.Tensor]] = []
        for segment in self.segments.values():
            for piece in segment.pieces(self.rank):
                param = self.groups[piece.group][piece.index]
                view = param.detach().view(-1)[piece.start:piece.end]
                self.pieces.append((piece, param, view))
        self.pieces.sort(key=lambda item: (item[0].group, item[0].index))
        self._taken: list[torch.Tensor] = []
        # trainable parameter -> its offset in its segment
        self.offsets = {self.groups[g][i]: offset for segment in self.segments.values()
                        for (g, i, _), offset in zip(segment.members, segment.offsets)}
        self.positions = self._positions()

    def _join_into_buffers(self) -> None:
        """Each dtype's trainable parameters become views of one padded flat buffer."""
        for dtype, segment in self.segments.items():
            params = [self.groups[g][i] for g, i, _ in segment.members]
            flat = torch.zeros(segment.chunk * self.world, dtype=dtype, device=params[0].device)
            for p, offset in zip(params, segment.offsets):
                view = flat[offset:offset + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
            self.flats[dtype] = flat

    def _positions(self) -> dict[torch.Tensor, int]:
        """Every trainable parameter -> its place in the layout (segment by segment): the order
        stage 2 lays a gradient bucket out in, so that each rank's part is contiguous."""
        bases, base = {}, 0
        for dtype, segment in self.segments.items():
            bases[dtype] = base
            base += segment.total
        return {p: bases[p.dtype] + offset for p, offset in self.offsets.items()}

    def local_groups(self) -> list[list[torch.Tensor]]:
        """Per param group, the views the local optimizer steps."""
        out: list[list[torch.Tensor]] = [[] for _ in self.groups]
        for piece, _, view in self.pieces:
            out[piece.group].append(view)
        return out

    def views_of(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's views of ``params`` (those it holds a piece of)."""
        wanted = {id(p) for p in params}
        return [view for _, param, view in self.pieces if id(param) in wanted]

    # -- step ----------------------------------------------------------------------------

    def take_grads(self) -> None:
        """Each view's ``.grad`` becomes the matching slice of its parameter's ``.grad`` where
        the parameter has one (stage 1: full, all-reduced gradients); a view whose parameter
        has none keeps what stage 2 put there (or None)."""
        self._taken = []
        for piece, param, view in self.pieces:
            if param.grad is not None:
                view.grad = param.grad.reshape(-1)[piece.start:piece.end]
                self._taken.append(view)

    def release_grads(self) -> None:
        """Drop the gradient slices ``take_grads`` set (they keep the full gradients alive)."""
        for view in self._taken:
            view.grad = None
        self._taken = []

    def all_gather(self) -> None:
        """Every rank's updated range into every rank's flat buffers: one asynchronous flat
        all-gather (``all_gather_single``) per dtype (collective: all ranks call it), then all
        waited."""
        if self.world == 1:
            return
        works = []
        for dtype, flat in self.flats.items():
            chunk = self.segments[dtype].chunk
            mine = flat[self.rank * chunk:(self.rank + 1) * chunk].clone()
            works.append(dist_all_gather(flat, mine, group=self.group, async_op=True))
        for work in works:
            work.wait()

    # -- stage 2 -------------------------------------------------------------------------

    def bucket_parts(self, params: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
        """Per rank, its part of a gradient bucket holding ``params`` in layout order."""
        if not params:
            return [(0, 0)] * self.world
        return bucket_parts([self.offsets[p] for p in params], [p.numel() for p in params],
                            self.segments[params[0].dtype])

    def piece_of(self) -> dict[torch.Tensor, tuple[Piece, torch.Tensor]]:
        """Parameter -> this rank's (piece, view) of it."""
        return {param: (piece, view) for piece, param, view in self.pieces}

    # -- state dicts ---------------------------------------------------------------------

    def to_global(self, local: dict[str, Any]) -> dict[int, list[tuple[int, int, dict]]]:
        """This rank's local optimizer state (its pieces numbered in local order) keyed by the
        global parameter index, as ``(start, end, entry)`` per piece, tensors on the CPU."""
        glob = global_indices([len(g) for g in self.groups])
        order = [p for g in self.local_groups() for p in g]  # local index -> view
        where = {id(view): piece for piece, _, view in self.pieces}
        out: dict[int, list[tuple[int, int, dict]]] = {}
        for k, entry in local["state"].items():
            piece = where[id(order[k])]
            saved = {key: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                     for key, v in entry.items()}
            out.setdefault(glob[piece.group][piece.index], []).append(
                (piece.start, piece.end, saved))
        return out

    def to_local(self, whole: dict[str, Any]) -> dict[str, Any]:
        """The local optimizer's state dict for this rank's pieces, cut out of a whole
        (torch-shaped) optimizer state dict: each element-wise state tensor (the parameter's
        shape) sliced to the piece, everything else (step counts) copied."""
        glob = global_indices([len(g) for g in self.groups])
        state, local_groups, k = {}, [], 0
        pieces_by_group: list[list[Piece]] = [[] for _ in self.groups]
        for piece, _, _ in self.pieces:
            pieces_by_group[piece.group].append(piece)
        for g, saved in enumerate(whole["param_groups"]):
            ids = []
            for piece in pieces_by_group[g]:
                param = self.groups[g][piece.index]
                entry = whole["state"].get(glob[g][piece.index])
                if entry is not None:
                    state[k] = {key: _slice(v, param, piece) for key, v in entry.items()}
                ids.append(k)
                k += 1
            local_groups.append({**{x: v for x, v in saved.items() if x != "params"},
                                 "params": ids})
        return {"state": state, "param_groups": local_groups}


def merge_pieces(per_rank: Sequence[dict[int, list[tuple[int, int, dict]]]],
                 params: Sequence[torch.Tensor]) -> dict[int, dict[str, Any]]:
    """The whole state (keyed by global index, tensors shaped like their parameters) from
    every rank's ``to_global`` output: element-wise state tensors are joined piece by piece,
    other values (step counts, equal on every piece) taken from the first piece."""
    collected: dict[int, list[tuple[int, int, dict]]] = {}
    for part in per_rank:
        for index, pieces in part.items():
            collected.setdefault(index, []).extend(pieces)
    state: dict[int, dict[str, Any]] = {}
    for index, pieces in sorted(collected.items()):
        pieces.sort(key=lambda item: item[0])
        param = params[index]
        first = pieces[0][2]
        entry: dict[str, Any] = {}
        for key, value in first.items():
            if _per_element(value, pieces[0][1] - pieces[0][0]):
                whole = torch.empty(param.numel(), dtype=value.dtype)
                for start, end, saved in pieces:
                    whole[start:end] = saved[key]
                entry[key] = whole.view(param.shape)
            else:
                entry[key] = value
        state[index] = entry
    return state


def _per_element(value: Any, numel: int) -> bool:
    """A piece's element-wise state: a 1-D tensor with one value per element of the piece
    (scalars such as a step count are 0-D)."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel


def _slice(value: Any, param: torch.Tensor, piece: Piece) -> Any:
    """``value`` (a whole parameter's state) cut to ``piece``: a tensor of the parameter's
    shape is flattened and sliced; anything else is copied as it is."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape:
        return value.detach().reshape(-1)[piece.start:piece.end].clone()
    return value.detach().clone() if isinstance(value, torch.Tensor) else value
