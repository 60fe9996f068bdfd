"""One direct parameter's gradient exchange where the ranks read each other's rows (one host).

[Note: gradient rows read from the peers]
Where every rank of a unit's group may read the others' memory ([Note: reading a peer's memory],
dp/peer_read.py), an exchange of [Note: direct gradient reduction] moves no gradient bytes
through gloo. The ranks' notes go through the unit's ``NoteBoard`` ([Note: notes through shared
memory], dp/shm_notes.py), numbered by how many exchanges of that parameter the unit has issued
(the same on every rank). Each parameter has ``DEPTH`` slots, used in turn, because a gradient
that arrives twice in one reduction (a reentrant checkpoint) has two exchanges in flight; a
rank posts a note only once its peers have acknowledged the one posted ``DEPTH`` exchanges
before in that slot (so far in the past that it never waits in practice). For each other rank
``r``, this rank

1. when the gradient arrives (the compute thread): posts ``r`` a note saying where in this
   process the rows ``r`` owns lie, and how many bytes they are;
2. on the unit's exchange thread (``read``): waits for ``r``'s note on this rank's rows, copies
   them out of ``r``'s memory (the lowest other rank's straight into the reduced shard, further
   ones into workspaces) and acknowledges the note; when every peer's rows are in, adds this
   rank's own rows and the workspaces, as the gloo exchange does;
3. on a second thread (``release``): waits until every peer has acknowledged this rank's notes,
   and only then lets this rank's gradient go.

The reads cost one copy in this process and nothing in the peer, where gloo took a copy on each
side plus the TCP stack and its event loop. The release has its own thread because a peer may
take its exchanges in another order than this rank: were the exchange thread to wait for a
peer's acknowledgement before reading the next parameter, it could wait for a peer that waits
for this rank's read of that next parameter. Each thread waits only for what a compute thread
posts, or for what a peer's exchange thread does after waiting only for compute threads, so no
wait is circular. A note whose size differs from the rows it should describe is an error naming
the peer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from shardwise.dp import shm_notes
from shardwise.dp.peer_read import DISABLE_VAR, peer_pids, read_into
from shardwise.dp.shm_notes import NoteBoard
from shardwise.fsdp.exchange_phases import PhasedExchange, receive_buffers

_PURPOSE = "FSDP gradient exchange"
DEPTH = 4  # slots per parameter: exchanges of one parameter that may be in flight at once


class PeerRows:
    """What a unit's exchanges need to read its peers' rows: their process ids, the unit's note
    board (``DEPTH`` slots per parameter) and how many exchanges of each parameter were issued."""

    def __init__(self, group: dist.ProcessGroup, pids: Sequence[int], params: int):
        self.pids = list(pids)
        self.board = NoteBoard(params * DEPTH, group, pids, _PURPOSE, DISABLE_VAR)
        self.issued = [0] * params

    def next_seq(self, index: int) -> tuple[int, int]:
        """The next exchange of parameter ``index``: ``(slot, sequence number)``."""
        self.issued[index] += 1
        seq = self.issued[index]
        return index * DEPTH + seq % DEPTH, seq


def peer_rows(group: dist.ProcessGroup, params: int) -> PeerRows | None:
    """A unit's ``PeerRows`` where every rank may read the others (collective over ``group``,
    whose ranks all run on this host), else None."""
    world = dist.get_world_size(group)
    usable = shm_notes.supported() and shm_notes.room_for_board(params * DEPTH, world)
    pids = peer_pids(group, usable)
    return None if pids is None else PeerRows(group, pids, params)


class PulledExchange(PhasedExchange):
    """One direct parameter's exchange by reads of the peers' memory (see the Note): two
    phases, ``read`` on the unit's exchange thread and ``release`` on its release thread; it
    is done once both have run."""

    PHASES = ("read", "release")

    def __init__(self, flat: torch.Tensor, chunks: dict[int, torch.Tensor], rank: int,
                 rows: PeerRows, index: int, dest: torch.Tensor | None, into_dest: bool):
        super().__init__()
        self.rows, self.index = rows, index
        self.slot, self.seq = rows.next_seq(index)
        self.flat: torch.Tensor | None = flat  # peers read from it until they acknowledge
        self.offered = [r for r in chunks if r != rank]
        for r in self.offered:
            piece = chunks[r]
            if self.seq > DEPTH:  # the slot's last note: read by now, but make sure
                rows.board.wait_ack(self.slot, r, self.seq - DEPTH, self._what())
            rows.board.post(self.slot, r, self.seq, piece.data_ptr(),
                            piece.numel() * piece.element_size())
        self.dest = dest
        # (peer, where its copy goes), and what is added into dest once they are in
        self.reads: list[tuple[int, torch.Tensor]] = []
        self.pieces: list[torch.Tensor] = []
        own = chunks.get(rank)
        if own is not None and dest is not None:
            self.reads, self.pieces = receive_buffers(own, dest, into_dest, rank,
                                                      len(rows.pids))

    def held(self) -> list[torch.Tensor]:
        return [t for t in [*self.pieces, self.flat] if t is not None]

    def _what(self) -> str:
        return f"gradient rows of parameter {self.index}, exchange {self.seq}"

    def read(self) -> None:
        """Phase 1 (the exchange thread): copy each peer's rows of this rank, acknowledge, and
        add this rank's own rows and any further copies into ``dest``."""
        board = self.rows.board
        for peer, buf in self.reads:
            address, nbytes = board.wait_note(self.slot, peer, self.seq, self._what())
            expected = buf.numel() * buf.element_size()
            if nbytes != expected:
                raise RuntimeError(f"FSDP: rank {peer} offered {nbytes} bytes of "
                                   f"{self._what()}, this rank expected {expected}: the ranks' "
                                   "models or their backward passes differ")
            read_into(buf, self.rows.pids[peer], address)
            board.ack(self.slot, peer, self.seq)
        if self.dest is not None:
            for piece in self.pieces:
                self.dest.add_(piece)
        self.pieces, self.reads = [], []

    def release(self) -> None:
        """Phase 2 (the release thread): wait until every peer is done with this rank's rows,
        then let the gradient go."""
        for r in self.offered:
            self.rows.board.wait_ack(self.slot, r, self.seq, self._what())
        self.flat = None
