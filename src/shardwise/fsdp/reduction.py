"""The ways a unit's gradients are reduced: one class each, chosen once per unit.

``choose_reduction`` picks a unit's path when its handle is built (and again when what decides
it changes: a communication hook registered, the unit moved to another device):

- ``FlatReduceScatter``: every gradient copied into a rank-major flat buffer, one averaging
  reduce-scatter of it where the unit's backward ends ([Note: flat parameters], flat_param.py);
  NCCL, and gloo off the CPU;
- ``GlooExchange`` and ``PeerReadExchange``: the large parameters' rows sent straight from
  their gradients as they arrive, over gloo's point-to-point or by reading the peers' memory on
  one host ([Note: direct gradient reduction] and [Note: gradient rows read from the peers]
  below); gloo on the CPU with more than one rank;
- ``CommHookReduction``: FSDP1's ``register_comm_hook``, whose hook replaces the reduce-scatter
  of the flat buffer;
- ``SingleRank``: a group of one rank, where the flat buffer is the reduced gradient;
- ``AcrossReplicas``: hybrid sharding, any of the above within the shard group and then an
  all-reduce across the replicas.

Each path owns the unit's record of which gradients arrived ([Note: gradient arrival]
below). The handle (flat_param.py) hands it each gradient (``add``), asks it to take part
with zeros where none arrived (``expect``), and issues the reduction (``start``).

The direct exchanges: a unit's gradient reduce-scatter sent straight from autograd's gradients
(gloo on CPU).

[Note: direct gradient reduction]
The reduce-scatter of [Note: flat parameters] first copies every gradient into a rank-major flat
buffer: one pass over the whole model's gradients per step, on the compute thread, before a byte
moves. On gloo our reduce-scatter is point-to-point anyway ([Note: fast collectives]), and the
rows of a parameter that rank r owns are contiguous in its gradient (``Shard(0)``, see
[Note: FSDP layout]). So the large ("direct") parameters skip the buffer, and each is sent as
soon as autograd has made its gradient: each rank sends every other rank r the rows r owns,
straight out of the gradient, and receives the other ranks' copies of its own rows: the lowest
other rank's into the unit's reduced shard itself (taken at the unit's first gradient, [Note: a
reduced-gradient buffer kept across steps] in memory/kept_buffer.py), any further ones into a
workspace. As soon as an exchange's messages are in, the unit's exchange thread (``_Waiter``)
adds this rank's own rows and the further copies into the reduced shard (the same order as
``reduce_scatter_flat``) and lets the gradient go, so the compute thread does not do those adds
itself; when the next direct gradient of the unit arrives, the compute thread waits for the
exchange before it to be finished. So a unit holds its reduced shard plus one or two gradients
in flight, not all of its gradients until its backward ends. Dividing by the world size waits
for the unit's reduction to be finished. The
small ("packed") parameters still go through a rank-major buffer, only as large as the packed
region, and one ``reduce_scatter_flat`` issued where the unit's backward ends, as the gather
packs them too.

Every rank issues the same messages: one exchange per direct parameter and reduction (a
gradient that never arrived on this rank is sent as zeros when the unit's reduction is issued,
[Note: where a unit's backward ends], unit.py), each tagged with the unit's position in the
root's order and the parameter's index in the unit, so that a gradient arriving on some ranks
only (data-dependent control flow) still meets its zeros on the others and never another
unit's message. Such a peer posts its zeros only where the unit's backward ends, after the
unit's other gradients: a rank that waited for that exchange without end, when its next
gradient arrives, would wait for a peer that waits for this rank's later exchanges. So the
waits happen on a thread per reduction (``_Waiter``; gloo's point-to-point works cannot be
polled, and a wait that times out closes the connection), and an arriving gradient waits for
the exchange before it for at most ``PATIENCE_S``; one not done by then, and every exchange
after it, is finished with the unit's reduction (more gradients held, for that backward only).
A gradient that arrives twice in one reduction (used inside and outside a reentrant
checkpoint) is sent twice, its second copies received into a workspace and added: the same
sum, in another order.

Where the unit's ranks run on one host and may read each other's memory, the rows move by reads
instead of gloo's messages (``PulledExchange``, [Note: gradient rows read from the peers]
below): the same pieces, added in the same order, so the same bits; such an exchange
has two phases, each on its own thread (``_Waiter`` runs one phase of every exchange, in order).

Taken only where it is exact and simple: gloo on CPU, more than one rank, no communication hook,
gradient sync on, and no gradient left over from a backward without sync (those accumulate in
the flat buffer, which then reduces everything).

The two kinds of exchange share where each peer's copy of this rank's rows goes
(``receive_buffers``) and the bookkeeping of phases run on the unit's threads
(``PhasedExchange``): an exchange over gloo (``_Exchange``) has one phase, run on the unit's
exchange thread; one that reads the peers' memory (``PulledExchange``) has two, each on its own
thread. It is done once every phase has run; the first error any phase met is raised to the
compute thread by ``finish``.

[Note: gradient rows read from the peers]
Where every rank of a unit's group may read the others' memory ([Note: reading a peer's
memory], distributed/host/peers.py), an exchange of [Note: direct gradient reduction] moves
no gradient bytes through gloo. The ranks' notes go through the unit's ``NoteBoard`` ([Note:
notes through shared memory], distributed/host/peers.py), numbered by how many exchanges of that
parameter the unit has issued (the same on every rank). Each parameter has ``DEPTH`` slots, used
in turn, because a gradient that arrives twice in one reduction (a reentrant checkpoint) has two
exchanges in flight; a rank posts a note only once its peers have acknowledged the one posted
``DEPTH`` exchanges before in that slot (so far in the past that it never waits in practice). For
each other rank ``r``, this rank

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

[Note: gradient arrival]
One ``GradArrivals`` per unit, owned by its reduction path (reduction.py), answers the
questions a gradient raises:
- for the unit's state machine ([Note: FSDP unit states]): did any gradient arrive in this
  backward? (Where the unit's backward ends does not depend on which gradients arrived: [Note:
  where a unit's backward ends], unit.py.)
- for the handle's gradient buffers ([Note: flat parameters], [Note: direct gradient
  reduction]): is a parameter's gradient already in the buffers waiting to be reduced (a second
  one is added, a first one copied), and which never arrived (their chunks are sent as zeros)?
Both come from one map, slot index -> the backward in which that slot's gradient last arrived,
holding the gradients not yet handed to a reduction. Handing them over (``taken``) empties the
map; a new backward (``new_backward``) keeps it, since gradients accumulated without sync
(``no_sync``) stay in the buffers until a backward reduces them.

[Note: gradients of unused parameters]
Every rank reduces every parameter of a unit whose backward ended, with zeros for those it got
no gradient for ([Note: where a unit's backward ends], unit.py): the ranks' messages must pair
up although a branch or an expert ran on some ranks only. A parameter that no rank used (a
pooler that the loss never reaches, a head that is only used for evaluation) would so get a
zero gradient where plain torch and torch's FSDP2 leave ``None``, and the optimizer would not
skip it: AdamW decays its weights and moves it with its old moments, so training drifts away
from the one-process run. So at the end of backward, after every reduction has finished, the
ranks agree on which parameters any of them had a gradient for: one all-reduce (MAX) per group
of a flag per parameter (and across the replicas of hybrid sharding), and a ``.grad`` that this
backward's reductions created for a parameter no rank used is set back to ``None``. A
gradient that existed before the backward (accumulated over steps) keeps its values, which
adding zeros did not change. The all-reduce also serves as the end-of-backward barrier of a
group whose parameters are shared on one host ([Note: parameters shared on one host]), which
then issues no barrier of its own. On a GPU the flags are read on the host, so the end of each
backward waits for the device once (as DDP's ``find_unused_parameters=True`` does). Units under
``set_reduce_scatter_unused_params(True)`` keep their zero gradients, as torch's FSDP2 does with
that setting, and join no agreement (nor wait); units with gradient sync off reduce nothing and
join none. tests/fsdp/test_fsdp_unused_params.py.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shardwise.distributed.host import peers as shm_notes
from shardwise.distributed.host.peers import DISABLE_VAR, NoteBoard, peer_pids, read_into
from shardwise.dp.fast_collectives import Pending, reduce_scatter_flat, uses_fast_path
from shardwise.fsdp.collectives import (
    exchange_rows,
    max_over,
    start_reduce_scatter,
    then_average_across,
)
from shardwise.fsdp.layout import UnitLayout, chunks_of, copy_into_chunks

if TYPE_CHECKING:
    from shardwise.fsdp.flat_param import FlatParamHandle
    from shardwise.fsdp.unit import FSDPUnit

Reduced = tuple[Pending, torch.Tensor, list[torch.Tensor]]  # (pending, out, held): see start

TAG_BASE = 1 << 20  # point-to-point tags of direct exchanges start here
_TAG_END = 1 << 31  # gloo's tags are 31-bit
PATIENCE_S = 0.1  # how long an arriving gradient waits for an older exchange: _finish_older


def unit_tag_bases(slot_counts: Sequence[int]) -> list[int]:
    """The first tag of each unit's direct exchanges, given every unit's number of parameters
    in the root's (rank-independent) order: unit k's parameter i is tagged
    ``TAG_BASE + k * max(slot_counts) + i``, so no two exchanges of one backward share a tag."""
    stride = max(slot_counts, default=1) or 1
    if TAG_BASE + len(slot_counts) * stride > _TAG_END:
        raise ValueError(f"FSDP: {len(slot_counts)} units of up to {stride} parameters each "
                         "need more point-to-point tags than gloo has; use fewer units")
    return [TAG_BASE + k * stride for k in range(len(slot_counts))]


# ---- what both kinds of exchange share -----------------------------------------------------------
def receive_buffers(own: torch.Tensor, dest: torch.Tensor, into_dest: bool, rank: int,
                    world: int) -> tuple[list[tuple[int, torch.Tensor]], list[torch.Tensor]]:
    """``(reads, pieces)`` for this rank's rows ``own`` of one parameter: ``reads`` pairs each
    other rank with where its copy goes (the lowest one's straight into ``dest`` when
    ``into_dest``, the others into new workspaces); ``pieces`` are what is then added into
    ``dest``: ``own`` and the workspaces, in that order."""
    reads, pieces = [], [own]
    for k, r in enumerate(r for r in range(world) if r != rank):
        buf = dest if k == 0 and into_dest else torch.empty_like(own)
        if buf is not dest:
            pieces.append(buf)
        reads.append((r, buf))
    return reads, pieces


# ---- which gradients arrived ([Note: gradient arrival]) ---------------------------------
class GradArrivals:
    """Arrival of each slot's gradient; see [Note: gradient arrival]."""

    def __init__(self) -> None:
        self._pending: dict[int, int] = {}  # slot index -> backward of its last arrival
        self._backward = 0  # counts backward passes
        self._count = 0  # slots in `_pending` that arrived in this backward

    def record(self, index: int) -> bool:
        """Slot ``index``'s gradient arrived. Returns whether a gradient of this slot is already
        waiting (add to it, not copy)."""
        last = self._pending.get(index)
        if last != self._backward:
            self._count += 1
            self._pending[index] = self._backward
        return last is not None

    def any_now(self) -> bool:
        """Whether a gradient arrived in this backward (and was not handed over since)."""
        return self._count > 0

    def waiting(self, index: int) -> bool:
        """Whether slot ``index``'s gradient is in the buffers, waiting to be reduced."""
        return index in self._pending

    def taken(self) -> None:
        """The waiting gradients were handed to a reduction."""
        self._pending.clear()
        self._count = 0

    def new_backward(self) -> None:
        """A new backward pass: nothing has arrived in it yet."""
        self._backward += 1
        self._count = 0


class ReducedSlots:
    """One handle's record of this backward's reductions: which slots this rank contributed a
    gradient to, and which slots' ``.grad`` the reductions created."""

    def __init__(self, count: int):
        self.count = count
        self.used = [False] * count  # a gradient of the slot arrived here and was reduced
        self.made: list[int] = []  # slots whose .grad a reduction of this backward created

    def reduced(self, arrived: Sequence[bool]) -> None:
        """A reduction was issued; ``arrived[i]``: slot i's gradient was in it on this rank."""
        self.used = [u or a for u, a in zip(self.used, arrived, strict=True)]

    def grad_made(self, index: int) -> None:
        self.made.append(index)

    def clear(self) -> None:
        self.used = [False] * self.count
        self.made = []


def _joins(unit: FSDPUnit) -> bool:
    """Whether ``unit`` takes part in the agreement: the same answer on every rank, as it
    depends only on the unit's settings."""
    return (unit.handle is not None and unit.handle.requires_grad and not unit.no_sync
            and not unit.reduce_scatter_unused_params)


def drop_unused_grads(units: Sequence[FSDPUnit]) -> set[int]:
    """Agree over each unit's group (and replicas) on the parameters no rank had a gradient
    for in this backward, and set the ``.grad`` its reductions made for them back to None. One
    all-reduce per group; returns the ids of the groups it ran over (each was a barrier)."""
    by_group: dict[tuple[int, int], list[FSDPUnit]] = {}
    for unit in units:
        if _joins(unit):
            key = (id(unit.handle.group), id(unit.handle.replicate_group))
            by_group.setdefault(key, []).append(unit)
    synced: set[int] = set()
    for members in by_group.values():
        handle = members[0].handle
        flags = torch.tensor([int(u) for m in members for u in m.handle.reduced.used],
                             dtype=torch.int32, device=handle.compute_device)
        synced |= max_over(flags, (handle.group, handle.replicate_group))
        if dist.get_backend(handle.group) == "fake":  # a dry run's flags carry no values
            continue
        used = flags.tolist()
        for member in members:
            count = member.handle.reduced.count
            member.handle.drop_grads_of_unused(used[:count])
            used = used[count:]
    return synced


# ---- the reduction paths --------------------------------------------------------------------
class PhasedExchange:
    """An exchange whose phases, the methods named in ``PHASES``, run on the unit's threads,
    one thread per phase (see the module's doc)."""

    PHASES: tuple[str, ...] = ("run",)

    def __init__(self) -> None:
        self.arrived = threading.Event()  # set once every phase has run (or failed)
        self.error: BaseException | None = None
        self.deferred = False  # waited for in vain: left to the unit's reduction
        self._lock, self._phases_left = threading.Lock(), len(self.PHASES)

    def held(self) -> list[torch.Tensor]:
        """The tensors the exchange still holds (its gradient, workspaces)."""
        raise NotImplementedError

    def held_bytes(self) -> int:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in self.held()}
        return sum(storages.values())

    def done(self) -> bool:
        return self.arrived.is_set()

    def phase_done(self, error: BaseException | None) -> None:
        """A thread ran one phase (``error``: what it raised, if anything)."""
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._phases_left -= 1
            last = self._phases_left == 0
        if last:
            self.arrived.set()

    def finish(self) -> None:
        """Wait until every phase has run; raise the first error one met."""
        self.arrived.wait()
        if self.error is not None:
            raise self.error


# ---- reads of the peers' rows (one host) ---------------------------------------------------------
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


# ---- the gloo exchange and one unit's direct reduction -------------------------------------------
class _Exchange(PhasedExchange):
    """One direct parameter's sends and receives in flight, and what completing it adds to its
    rows of the reduced shard. The unit's ``_Waiter`` thread waits for its works and completes
    it (its one phase, ``run``), never the compute thread: gloo's point-to-point works cannot
    be polled (``is_completed`` stays False until a wait) and a wait that times out closes the
    connection."""

    def __init__(self, works: list, dest: torch.Tensor | None, pieces: list[torch.Tensor]):
        super().__init__()
        self.works, self.dest, self.pieces = works, dest, pieces

    def held(self) -> list[torch.Tensor]:
        return list(self.pieces)

    def run(self) -> None:
        """On the waiter thread: wait for every work, then add this rank's rows and any further
        copies into ``dest`` (the lowest other rank's copy was received straight into it), and
        let the gradient and workspaces go."""
        for work in self.works:
            work.wait()
        if self.dest is not None:
            for piece in self.pieces:
                self.dest.add_(piece)
        self.works, self.pieces = [], []


class _Waiter:
    """A thread that runs one phase of each of one reduction's exchanges, in the order they
    were posted (``_Exchange.run``, or ``PulledExchange.read`` or ``.release``) and tells the
    exchange (``phase_done``), which is done once all its phases have run: the compute thread
    can then ask, or wait with a timeout."""

    _END = None

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="shardwise-fsdp-exchange",
                                       daemon=True)
        self.thread.start()

    def submit(self, exchange: _Exchange) -> None:
        self.queue.put(exchange)

    def close(self) -> None:
        """No more exchanges: the thread ends after the ones submitted."""
        self.queue.put(self._END)

    def join(self) -> None:
        """Wait for the thread's end (after ``close`` and every exchange's ``finish``), so that
        it holds no work of the process group past the reduction."""
        self.thread.join()

    def _run(self) -> None:
        while (exchange := self.queue.get()) is not self._END:
            error = None
            try:
                getattr(exchange, self.phase)()
            except BaseException as err:  # handed to the compute thread by finish()
                error = err
            exchange.phase_done(error)
            exchange = error = None  # no reference kept while waiting for more


class DirectGrads:
    """One unit's reduction in direct mode, from its first gradient until it is issued."""

    def __init__(self, layout: UnitLayout, rank: int, global_ranks: Sequence[int],
                 group: dist.ProcessGroup, out: torch.Tensor, tag_base: int = TAG_BASE,
                 peer_rows: PeerRows | None = None):
        self.layout, self.rank, self.world = layout, rank, len(global_ranks)
        self.tag_base = tag_base  # this unit's first tag: see unit_tag_bases
        self.global_ranks, self.group = global_ranks, group
        self.reduce_dtype, self.device = out.dtype, out.device
        # the reduced shard (1D, shard_numel, the reduce dtype): the direct parameters' rows are
        # received into it, and the waiter adds the rest
        self.out = out
        # issued, not yet waited for (oldest first)
        self.inflight: list[_Exchange | PulledExchange] = []
        self.sent: set[int] = set()  # direct parameters whose exchange was issued
        self.packed: torch.Tensor | None = None  # (world, packed_numel), rank-major
        # where the ranks read each other's rows ([Note: gradient rows read from the peers]),
        # else None: gloo carries the rows
        self.peer_rows = peer_rows
        self.waiters: list[_Waiter] = []  # one per phase, started by the first exchange

    def add(self, index: int, grad: torch.Tensor, accumulate: bool) -> None:
        """Take parameter ``index``'s gradient: a direct one is sent at once and the older
        exchanges of the unit are finished (``_finish_older``: so one gradient is in flight,
        see the Note); a packed one is copied, or added (``accumulate``), into the packed
        buffer."""
        param = self.layout.params[index]
        if param.packed:
            self._add_packed(index, grad, accumulate)
            return
        flat = grad.to(self.reduce_dtype).reshape(-1)
        # arrived again (a reentrant checkpoint): received into a workspace, added after the first
        self.inflight.append(self._exchange(flat, index, param, into_dest=index not in self.sent))
        self.sent.add(index)
        self._finish_older()

    def _finish_older(self) -> None:
        """Finish the exchanges before the newest, waiting up to ``PATIENCE_S`` for the oldest.
        A peer that never got that gradient posts its zeros only where the unit's backward ends
        (see the Note), so a wait without end here could wait for a rank that waits for this
        one: an exchange not done in time is left to the unit's reduction, and so are the ones
        after it (the waiter thread finishes them in order)."""
        older = self.inflight[:-1]
        if older and not older[0].deferred and not older[0].arrived.wait(PATIENCE_S):
            older[0].deferred = True
        while len(self.inflight) > 1 and self.inflight[0].done():
            self.inflight.pop(0).finish()

    def _add_packed(self, index: int, grad: torch.Tensor, accumulate: bool) -> None:
        layout = self.layout
        if self.packed is None:
            self.packed = torch.empty(self.world, layout.packed_numel, dtype=self.reduce_dtype,
                                      device=self.device)
        param = layout.params[index]
        start = param.shard_offset - layout.packed_offset
        copy_into_chunks(self.packed[:, start : start + param.chunk_numel], grad, param,
                         accumulate=accumulate)

    def held_bytes(self) -> int:
        """Bytes of gradients and workspaces in flight, plus the packed buffer (the reduced
        shard, which becomes the sharded gradient, is not counted)."""
        held = sum(e.held_bytes() for e in self.inflight)
        return held + (0 if self.packed is None else self.packed.untyped_storage().nbytes())

    def start(self, arrived: Callable[[int], bool]
              ) -> tuple[Pending, torch.Tensor, list[torch.Tensor]]:
        """Issue what is left: zeros for each direct parameter whose gradient never arrived
        here, and the packed reduce-scatter. ``(pending, out, held)``: ``out`` (1D,
        ``shard_numel``) holds this rank's averaged shard once ``pending`` is waited for;
        ``held`` must stay alive until then. ``arrived(index)``: whether that parameter's
        gradient was added (packed ones that did not are sent as zeros)."""
        layout = self.layout
        for index, param in layout.direct():
            if index not in self.sent:  # never arrived here: this rank contributes zeros
                zeros = torch.zeros(param.numel, dtype=self.reduce_dtype, device=self.device)
                self.inflight.append(self._exchange(zeros, index, param, into_dest=True))
        waiters = self.waiters
        for waiter in waiters:
            waiter.close()
        inflight, self.inflight, self.sent, self.waiters = self.inflight, [], set(), []
        out, world, direct_end = self.out, self.world, layout.packed_offset
        works = []
        packed_work = self._start_packed(out, arrived)
        if packed_work is not None:
            works.append(packed_work)

        def finish() -> None:
            for exchange in inflight:
                exchange.finish()
            for waiter in waiters:
                waiter.join()
            out[:direct_end].div_(world)

        held = [t for e in inflight for t in e.held()]
        return Pending(works, finish), out, held

    def abandon(self) -> None:
        """Wait for the exchanges posted so far and drop them, issuing nothing more (the
        backward raised: [Note: a backward that raised], root.py). Raises the first error a
        wait met (a peer that did not post the same exchanges fails at the group's timeout)."""
        inflight, waiters = self.inflight, self.waiters
        self.inflight, self.sent, self.waiters, self.packed = [], set(), [], None
        for waiter in waiters:
            waiter.close()
        for exchange in inflight:
            exchange.arrived.wait()
        for waiter in waiters:
            waiter.join()
        errors = [e.error for e in inflight if e.error is not None]
        if errors:
            raise errors[0]

    def _exchange(self, flat: torch.Tensor, index: int, param, into_dest: bool
                  ) -> _Exchange | PulledExchange:
        """Post one parameter's sends and receives, tagged with its index so that ranks whose
        gradients arrive in different orders still pair them up. ``into_dest``: the first
        exchange of this parameter in the reduction receives the lowest other rank's rows
        straight into its rows of ``out``; a later one receives into a workspace."""
        tag = self.tag_base + index
        chunks = dict(chunks_of(flat, param))
        own = chunks.get(self.rank)
        dest = None if own is None else self.out[param.shard_offset :
                                                 param.shard_offset + own.numel()]
        if self.peer_rows is not None:
            return self._submit(PulledExchange(flat, chunks, self.rank, self.peer_rows, index,
                                               dest, into_dest))
        if own is None:  # this rank owns none of its rows: only the sends, kept alive
            works = exchange_rows(chunks, self.rank, (), self.global_ranks, self.group, tag)
            return self._submit(_Exchange(works, None, [flat]))
        reads, pieces = receive_buffers(own, dest, into_dest, self.rank, self.world)
        works = exchange_rows(chunks, self.rank, reads, self.global_ranks, self.group, tag)
        return self._submit(_Exchange(works, dest, pieces))

    def _submit(self, exchange: _Exchange | PulledExchange) -> _Exchange | PulledExchange:
        if not self.waiters:  # every exchange of a reduction is of one kind
            self.waiters = [_Waiter(phase) for phase in exchange.PHASES]
        for waiter in self.waiters:
            waiter.submit(exchange)
        return exchange

    def _start_packed(self, out: torch.Tensor, arrived: Callable[[int], bool]):
        layout = self.layout
        if not layout.packed_numel:
            return None
        if self.packed is None:  # no small gradient arrived here: contribute zeros
            self.packed = torch.zeros(self.world, layout.packed_numel, dtype=self.reduce_dtype,
                                      device=self.device)
        for index, param in layout.packed():
            if not arrived(index):
                start = param.shard_offset - layout.packed_offset
                self.packed[:, start : start + param.chunk_numel].zero_()
        packed, self.packed = self.packed, None
        pending = reduce_scatter_flat(out[layout.packed_offset :], packed.view(-1), self.group,
                                      average=True, async_op=True)
        return _KeepAlive(pending, packed)


class _KeepAlive:
    """A ``Pending`` used as a work item, holding the buffer it sends from."""

    def __init__(self, pending: Pending, buffer: torch.Tensor):
        self.pending, self.buffer = pending, buffer

    def wait(self) -> bool:
        return self.pending.wait()


# ---- the reduction paths, one class each ----------------------------------------------------
class Reduction:
    """One way a unit's gradients are reduced (see the module's doc). Between a unit's first
    gradient of a backward and ``start`` it holds what that backward's reduction needs;
    ``arrivals`` is the unit's one record of which gradients are in."""

    def __init__(self, handle: FlatParamHandle, arrivals: GradArrivals | None = None):
        self.handle = handle
        self.arrivals = arrivals if arrivals is not None else GradArrivals()

    def add(self, index: int, grad: torch.Tensor, sync: bool) -> None:
        """Take parameter ``index``'s gradient (this rank's local tensor); ``sync``: this
        backward reduces (off under ``no_sync``)."""
        raise NotImplementedError

    def has_gradient(self) -> bool:
        """Whether gradients wait to be reduced (the next ``start`` issues a reduction)."""
        raise NotImplementedError

    def expect(self) -> None:
        """Make the next ``start`` issue a reduction although no gradient arrived here: the
        peers' did ([Note: where a unit's backward ends], unit.py), so this rank takes part
        with zeros, through this path."""
        raise NotImplementedError

    def start(self) -> Reduced:
        """Issue the averaging reduction of the gradients held (zero where none arrived) in the
        reduce dtype and let go of them: ``(pending, out, held)``, ``out`` (1D,
        ``shard_numel``) holding this rank's reduced shard once ``pending`` is waited for,
        ``held`` kept alive until then."""
        raise NotImplementedError

    def drop(self) -> None:
        """Let go of the gradients held, after waiting for what was already posted ([Note: a
        backward that raised], root.py)."""
        raise NotImplementedError

    def held_bytes(self) -> int:
        """Bytes of unreduced gradients held right now."""
        raise NotImplementedError


class _FlatBuffer(Reduction):
    """The paths that reduce the unit's rank-major flat gradient (1D, ``world *
    shard_numel``, the compute dtype): each gradient is copied (or added, when accumulating)
    into its chunks as it arrives; what ``start`` does with the buffer is ``_reduce``."""

    def __init__(self, handle: FlatParamHandle, arrivals: GradArrivals | None = None):
        super().__init__(handle, arrivals)
        self.grad_buffer: torch.Tensor | None = None

    def add(self, index: int, grad: torch.Tensor, sync: bool) -> None:
        self.add_to_buffer(index, grad, self.arrivals.record(index))

    def add_to_buffer(self, index: int, grad: torch.Tensor, accumulate: bool) -> None:
        handle = self.handle
        if self.grad_buffer is None:
            self.grad_buffer = torch.empty(handle.world * handle.layout.shard_numel,
                                           dtype=handle.param_dtype,
                                           device=handle.compute_device)
        param = handle.layout.params[index]
        if param.numel:
            copy_into_chunks(self._chunks(self.grad_buffer, index), grad, param,
                             accumulate=accumulate)

    def _chunks(self, grad: torch.Tensor, index: int) -> torch.Tensor:
        """The (world, chunk_numel) view of parameter ``index``'s chunks in ``grad``."""
        param = self.handle.layout.params[index]
        start = param.shard_offset
        return grad.view(self.handle.world, -1)[:, start : start + param.chunk_numel]

    def has_gradient(self) -> bool:
        return self.grad_buffer is not None

    def expect(self) -> None:
        handle = self.handle
        if self.grad_buffer is None:
            self.grad_buffer = torch.zeros(handle.world * handle.layout.shard_numel,
                                           dtype=handle.param_dtype,
                                           device=handle.compute_device)

    def start(self) -> Reduced:
        grad, self.grad_buffer = self.grad_buffer, None
        for index in range(len(self.handle.layout.params)):
            if not self.arrivals.waiting(index):
                self._chunks(grad, index).zero_()
        return self._reduce(grad.to(self.handle.reduce_dtype))

    def _reduce(self, full_grad: torch.Tensor) -> Reduced:
        raise NotImplementedError

    def drop(self) -> None:
        self.grad_buffer = None

    def held_bytes(self) -> int:
        return 0 if self.grad_buffer is None else self.grad_buffer.untyped_storage().nbytes()


class FlatReduceScatter(_FlatBuffer):
    """One averaging reduce-scatter of the flat gradient (``reduce_scatter_flat``: the fastest
    equivalent per backend), issued asynchronously where the unit's backward ends."""

    def _reduce(self, full_grad: torch.Tensor) -> Reduced:
        out = self.handle.reduced_out()
        return start_reduce_scatter(out, full_grad, self.handle.group), out, [full_grad]


class SingleRank(_FlatBuffer):
    """A shard group of one rank: the flat gradient is the reduced shard; nothing is sent."""

    def _reduce(self, full_grad: torch.Tensor) -> Reduced:
        return Pending([]), full_grad, [full_grad]


class CommHookReduction(_FlatBuffer):
    """FSDP1's ``register_comm_hook``: ``hook(state, full_grad, out)`` replaces the
    reduce-scatter and leaves this rank's reduced shard in ``out``; it runs synchronously, as
    torch's hooks do."""

    def __init__(self, handle: FlatParamHandle, hook: tuple[Any, Callable[..., None]],
                 arrivals: GradArrivals | None = None):
        super().__init__(handle, arrivals)
        self.state, self.hook = hook

    def _reduce(self, full_grad: torch.Tensor) -> Reduced:
        out = torch.empty(self.handle.layout.shard_numel, dtype=self.handle.reduce_dtype,
                          device=full_grad.device)
        self.hook(self.state, full_grad, out)
        return Pending([]), out, [full_grad]


class _Direct(Reduction):
    """[Note: direct gradient reduction]: each large parameter's rows are exchanged as soon as
    its gradient arrives (``DirectGrads``, one per backward). A backward without sync, and the
    backward that then reduces what it accumulated, go through the flat buffer instead
    (``flat``), which keeps gradients across backward passes."""

    peer_reads = False  # the rows move by reads of the peers' memory, not gloo's messages

    def __init__(self, handle: FlatParamHandle, arrivals: GradArrivals | None = None):
        super().__init__(handle, arrivals)
        self.flat = FlatReduceScatter(handle, self.arrivals)
        self.direct: DirectGrads | None = None

    def _new_direct(self) -> DirectGrads:
        handle = self.handle
        return DirectGrads(handle.layout, handle.rank, handle.global_ranks, handle.group,
                           handle.reduced_out(), handle.tag_base,
                           handle.peer_rows if self.peer_reads else None)

    def add(self, index: int, grad: torch.Tensor, sync: bool) -> None:
        accumulate = self.arrivals.record(index)
        direct = self.direct
        if direct is None and sync and self.flat.grad_buffer is None:
            direct = self.direct = self._new_direct()
        if direct is None:
            self.flat.add_to_buffer(index, grad, accumulate)
        elif self.handle.layout.params[index].numel:
            direct.add(index, grad, accumulate)

    def has_gradient(self) -> bool:
        return self.direct is not None or self.flat.grad_buffer is not None

    def expect(self) -> None:
        if not self.has_gradient():
            self.direct = self._new_direct()

    def start(self) -> Reduced:
        if self.direct is None:
            return self.flat.start()
        direct, self.direct = self.direct, None
        return direct.start(self.arrivals.waiting)

    def drop(self) -> None:
        direct, self.direct = self.direct, None
        self.flat.drop()
        if direct is not None:
            direct.abandon()

    def held_bytes(self) -> int:
        return (0 if self.direct is None else self.direct.held_bytes()) + self.flat.held_bytes()


class GlooExchange(_Direct):
    """The direct exchange over gloo's point-to-point sends and receives."""


class PeerReadExchange(_Direct):
    """The direct exchange by reads of the peers' rows on one host ([Note: gradient rows read
    from the peers])."""

    peer_reads = True


class AcrossReplicas(Reduction):
    """Hybrid sharding: ``within`` reduces inside the shard group, then its result is averaged
    across the replicate group (``then_average_across``). Every other call goes straight to
    ``within``'s own methods (bound here, so a gradient costs no extra call)."""

    def __init__(self, within: Reduction, replicate_group: dist.ProcessGroup):
        super().__init__(within.handle, within.arrivals)
        self.within, self.replicate_group = within, replicate_group
        self.add = within.add  # type: ignore[method-assign]
        self.has_gradient = within.has_gradient  # type: ignore[method-assign]
        self.expect = within.expect  # type: ignore[method-assign]
        self.drop = within.drop  # type: ignore[method-assign]
        self.held_bytes = within.held_bytes  # type: ignore[method-assign]

    def start(self) -> Reduced:
        pending, out, held = self.within.start()
        return then_average_across(pending, out, self.replicate_group), out, held


def direct_possible(handle: FlatParamHandle) -> bool:
    """Whether the unit may reduce by direct exchanges: more than one rank, no communication
    hook, and gloo with the gradients on the CPU ([Note: direct gradient reduction])."""
    probe = torch.empty(0, dtype=handle.param_dtype, device=handle.compute_device)
    return (handle.world > 1 and handle.comm_hook is None
            and uses_fast_path(handle.group, probe, "auto"))


def choose_reduction(handle: FlatParamHandle,
                     arrivals: GradArrivals | None = None) -> Reduction:
    """The unit's reduction path (see the module's doc); ``arrivals``: the record to keep, when
    the path is chosen again."""
    if handle.comm_hook is not None:
        path: Reduction = CommHookReduction(handle, handle.comm_hook, arrivals)
    elif direct_possible(handle):
        kind = GlooExchange if handle.peer_rows is None else PeerReadExchange
        path = kind(handle, arrivals)
    elif handle.world == 1:
        path = SingleRank(handle, arrivals)
    else:
        path = FlatReduceScatter(handle, arrivals)
    if handle.replicate_group is not None:
        path = AcrossReplicas(path, handle.replicate_group)
    return path
