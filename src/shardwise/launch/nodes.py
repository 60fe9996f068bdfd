"""Launchers on several nodes agreeing on one job (``--nnodes``, ``--node-rank``,
``--rdzv-endpoint``, with torchrun's meaning).

The launcher of node 0 hosts the rendezvous TCPStore at the endpoint; the others connect to it.
Each launcher claims its node rank, writes a record ``shardwise/nodes/<k>`` (its --nnodes,
ranks per node, --max-restarts) and waits for the other nodes' records, checking every one it
sees against its own, so that launchers that disagree stop at once with an error naming both
values. Then they agree on the job's identity through the store (distributed/job_identity.py)
and write the same record again under it (``shardwise/job_nodes/<k>``), from which the layout
is taken. Global ranks are numbered node by node.

Every attempt begins with the nodes agreeing on the attempt's identity (the barrier that says
every node is ready for it); then every launcher connects to node 0's over the node link
(node_link.py, node_peers.py): beats, failure reports, the job's stop notice and "finished"
travel there, never through the store ([Note: node link]). A node is lost when its connection
closes without a goodbye or stays silent for the timeout. A node whose ranks failed sends its
report, so the others stop their own ranks and repeat the cause instead of blaming their ranks'
broken connections.

Restarts with a lost node (``--max-restarts``): the surviving launchers write the attempt to run
next (``shardwise/next_attempt``) and mark the node lost (``shardwise/node_lost/<k>``); a launcher
started again for that node finds its node rank already claimed, asks node 0's launcher over
the node link whether the first one is still connected (then it is a duplicate) and what the
job's identity is, waits for the mark, takes it (so that a third launcher for the node is again
a duplicate) and joins that attempt. When node 0 itself was lost, its store went with it: the
other launchers connect to the store of node 0's new launcher and join again; every record
carries the attempt its launcher is about to run and all take the largest, so node 0's new
launcher (which knows nothing) continues the job's count.

Every record here is signed under the job's secret ([Note: launcher records] in job_secret.py)
and, from the job's agreement on, under the job's identity: a record that fails its MAC,
copied from another job with the same secret included, is ignored and logged. Nothing in the
store is evidence that a node is gone: a missing record makes a wait time out with an error
that names the store, never a node declared lost.
"""

from __future__ import annotations

import json
import secrets
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from shardwise.distributed import signed_store
from shardwise.distributed.job_identity import JobIdentityError, agree
from shardwise.launch.node_link import LinkError
from shardwise.launch.node_peers import Hub, Member, probe
from shardwise.launch.progress import SCOPE

_PLAN = "shardwise/nodes/"  # each node's flags, before the job has an identity
_NODE = "shardwise/job_nodes/"  # the same, signed under the job's identity
_CLAIM = "shardwise/node_claims/"
_LOST = "shardwise/node_lost/"
_NEXT = "shardwise/next_attempt"
_LINK = "shardwise/node_link"  # node 0's launcher's port for the others (node_link.py)
_STORE_ERRORS = (RuntimeError, dist.DistError, OSError)


class NodeError(RuntimeError):
    """The launchers of a multi-node job cannot agree, or a node was lost."""


@dataclass(frozen=True)
class Layout:
    rank_offset: int  # global rank of this node's local rank 0
    world_size: int


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise NodeError(f"--rdzv-endpoint must be host:port with a port in 1..65535, "
                        f"got {endpoint!r}")
    return host.strip("[]"), int(port)


def open_store(endpoint: str, node_rank: int, nnodes: int, timeout: float) -> dist.TCPStore:
    """Node 0 hosts the store at ``endpoint``; the others connect to it (within ``timeout``)."""
    host, port = parse_endpoint(endpoint)
    try:
        return dist.TCPStore(host, port, None, is_master=node_rank == 0,
                             timeout=timedelta(seconds=timeout), wait_for_workers=False)
    except _STORE_ERRORS as exc:
        role = "host" if node_rank == 0 else "reach node 0's"
        raise NodeError(f"node {node_rank}: could not {role} rendezvous store at {host}:{port} "
                        f"({type(exc).__name__}: {exc})") from exc


class NodeLink:
    def __init__(self, store: dist.Store, node_rank: int, nnodes: int, nproc: int,
                 max_restarts: int, timeout: float, secret: bytes, host: str = "127.0.0.1"):
        if nnodes < 1:
            raise NodeError(f"--nnodes must be at least 1, got {nnodes}")
        if not 0 <= node_rank < nnodes:
            raise NodeError(f"--node-rank must be in [0, {nnodes}) for --nnodes {nnodes}, "
                            f"got {node_rank}")
        self.store, self.node_rank, self.nnodes = store, node_rank, nnodes
        self.mine = {"nnodes": nnodes, "nproc": nproc, "max_restarts": max_restarts,
                     "host": socket.gethostname()}
        self.timeout, self.secret = timeout, secret
        self._id = secrets.token_hex(8)  # this launcher, in its claim
        self.host = host  # node 0's address: its launcher listens there too
        self.peers: Hub | Member | None = None  # the connections to the other launchers
        self.job_id = b""  # the job's identity (agreed in join)
        self.attempt_id = b""  # the running attempt's identity (agreed in wait_ready)
        self._stop_seen = False

    # -- signed records ([Note: launcher records]) --------------------------------------------

    def _scope(self, job_wide: bool = True) -> str:
        """The signed scope of this job's records: the job's identity once agreed (claims and
        node 0's port are written before it exists)."""
        return f"{SCOPE}|job={self.job_id.hex()}" if job_wide and self.job_id else SCOPE

    def _put(self, key: str, value: str, job_wide: bool = True) -> None:
        signed_store.put(self.store, key, value, self.secret, self._scope(job_wide))

    def _sealed(self, key: str, value: str, job_wide: bool = True) -> bytes:
        return signed_store.seal(key, value, self.secret, self._scope(job_wide))

    def _read(self, key: str, job_wide: bool = True) -> tuple[str | None, bool]:
        """(the true value under ``key`` or None, whether a false record is there)."""
        if not self.store.check([key]):
            return None, False
        raw = self.store.get(key)
        try:
            return signed_store.open_record(key, raw, self.secret, self._scope(job_wide)).decode(
                errors="replace"), False
        except signed_store.BadRecord as why:
            signed_store._warn_once(key, bytes(raw), why)
            return None, True

    def _value(self, key: str, job_wide: bool = True) -> str:
        return self._read(key, job_wide)[0] or ""

    def _claim(self) -> bool:
        """Claim this node rank; False when a launcher claimed it before (a true claim)."""
        key, mine = f"{_CLAIM}{self.node_rank}", self._sealed(f"{_CLAIM}{self.node_rank}",
                                                               self._id)
        expected = b""
        for _ in range(100):
            now = bytes(self.store.compare_set(key, expected, mine))
            if now == mine:
                return True
            value, false = self._read(key)
            if value is not None:
                return value == self._id
            expected = bytes(self.store.get(key)) if false else b""
        raise NodeError(f"node {self.node_rank}: could not claim the node rank: its claim in "
                        f"the store keeps being overwritten")

    def join(self, attempt: int = 0) -> tuple[Layout, int]:
        """Announce this node and wait for all others; the global rank layout and the attempt
        to run first (``attempt``, or later when this launcher replaces a lost one or others
        are further on).

        The launchers that claim their node ranks first agree on the job's identity
        (distributed/job_identity.py: a round of nonces and one of confirms in the store);
        every record after that is signed under it. A launcher started again for a lost node
        learns it from node 0's launcher, over the node link."""
        if self.node_rank == 0 and self.peers is None:
            self.peers = Hub(self.host, self.nnodes, self.secret, self.timeout)
            self._put(_LINK, str(self.peers.port), job_wide=False)
        first = self._claim()
        if not first:
            attempt = max(attempt, self._take_lost_place())
        self.mine["attempt"] = attempt
        if isinstance(self.peers, Hub):
            self.mine["link_port"] = self.peers.port
        if first:  # launchers that disagree stop here, before they agree on anything
            self._put(f"{_PLAN}{self.node_rank}", json.dumps(self.mine), job_wide=False)
            self._wait_records(_PLAN, job_wide=False)
            self.job_id = self._agree_job()
            if isinstance(self.peers, Hub):
                self.peers.job_id = self.job_id
        self._put(f"{_NODE}{self.node_rank}", json.dumps(self.mine))
        records = self._wait_records(_NODE)
        if self.peers is None:
            port = _link_port(records[0])
            if port is None:
                raise NodeError(f"node {self.node_rank}: node 0's record names no port for the "
                                "launchers' connections (is node 0 another shardwise version?)")
            self.peers = Member(self.node_rank, self.nnodes, self.secret, self.timeout,
                                self.host, port)
        sizes = [records[k]["nproc"] for k in range(self.nnodes)]
        first = max(int(records[k].get("attempt", 0)) for k in range(self.nnodes))
        return Layout(sum(sizes[: self.node_rank]), sum(sizes)), first

    def _agree_job(self) -> bytes:
        try:
            return agree(self.store, "shardwise/job_identity", self.node_rank, self.nnodes,
                         self.secret, SCOPE, self.timeout)
        except JobIdentityError as exc:
            raise NodeError(f"node {self.node_rank}: not every node joined within "
                            f"{self.timeout:g} s ({exc})") from exc

    def _wait_records(self, prefix: str, job_wide: bool = True) -> dict[int, dict]:
        """Every node's record under ``prefix``, each checked against this node's."""
        deadline = time.monotonic() + self.timeout
        while True:
            records = self._records(prefix, job_wide)
            if len(records) == self.nnodes:
                return records
            if time.monotonic() > deadline:
                missing = [k for k in range(self.nnodes) if k not in records]
                raise NodeError(f"node {self.node_rank}: only {len(records)} of {self.nnodes} "
                                f"nodes joined within {self.timeout:g} s; missing nodes: "
                                f"{missing} (or their records were deleted from the store)")
            time.sleep(0.1)

    def _take_lost_place(self) -> int:
        """This node rank was claimed before: join in place of a launcher the others declared
        lost (the attempt they run next), or fail if that launcher is alive (node 0's launcher
        says it is connected and beating, or no mark comes within the timeout). Node 0's
        launcher also says the job's identity, under which the mark is signed."""
        k = self.node_rank
        patience = 2 * self.timeout + 5  # the others need the timeout to declare it lost
        deadline = time.monotonic() + patience
        while True:
            answer = self._ask_node_0() if k != 0 else None
            if answer is not None and answer[0]:
                raise NodeError(f"two launchers were started with --node-rank {k}: the first "
                                f"is still running")
            if answer is not None:
                self.job_id = answer[1]
                if self._take(f"{_LOST}{k}"):
                    return int(self._value(_NEXT) or 0)
            if time.monotonic() > deadline:
                raise NodeError(f"--node-rank {k} was claimed by an earlier launcher, and the "
                                f"other nodes did not declare it lost within {patience:g} s (a "
                                f"lost node rejoins only while the job has restarts left; "
                                f"without an answer from node 0's launcher, the store may be "
                                f"tampered with)")
            time.sleep(0.1)

    def _ask_node_0(self) -> tuple[bool, bytes] | None:
        """Node 0's launcher's answer over the node link: (whether this node rank's launcher is
        connected and beating, the job's identity); None when there is no answer."""
        text = self._value(_LINK, job_wide=False)
        if not text.isdigit():
            return None
        return probe(self.host, int(text), self.node_rank, self.secret, min(self.timeout, 10.0))

    def _take(self, key: str) -> bool:
        """Turn the mark at ``key`` from "1" to "0"; True for the one launcher that did."""
        one, zero = self._sealed(key, "1"), self._sealed(key, "0")
        return self._value(key) == "1" and bytes(self.store.compare_set(key, one, zero)) == zero

    def mark_lost(self, nodes: list[int], next_attempt: int) -> None:
        """Declare ``nodes`` lost: a launcher started again for one of them joins
        ``next_attempt``."""
        self._put(_NEXT, str(next_attempt))
        for k in nodes:
            self._put(f"{_LOST}{k}", "1")

    def wait_ready(self, attempt: int) -> None:
        """Wait (up to the timeout) until every node is ready for ``attempt``: the nodes agree
        on the attempt's identity through the store (distributed/job_identity.py), then every
        other node's launcher connects to node 0's under it ([Note: node link])."""
        try:
            self.attempt_id = agree(self.store, f"shardwise/attempt_{attempt}/identity",
                                    self.node_rank, self.nnodes, self.secret, self._scope(),
                                    self.timeout)
        except JobIdentityError as exc:
            raise NodeError(f"not every node joined attempt {attempt} within "
                            f"{self.timeout:g} s ({exc})") from exc
        try:
            self.peers.begin(attempt, self.attempt_id + attempt.to_bytes(4, "big"))
        except LinkError as exc:
            raise NodeError(f"node {self.node_rank}: {exc}") from exc

    def say_stopped(self, text: str) -> None:
        """This launcher was told to stop (a signal): the job ends, no node restarts."""
        self._stop_seen = True
        self.peers.note_stop(text)

    def stopped(self) -> str | None:
        """Why the job was stopped (by a signal to some node's launcher), once heard here."""
        text = self.peers.stop_text()
        if text and not self._stop_seen:
            self._stop_seen = True
            self.peers.ack_stop()
        return text

    def others_saw_stop(self) -> bool:
        return self.node_rank != 0 or self.peers.others_saw_stop()

    def _records(self, prefix: str = _NODE, job_wide: bool = True) -> dict[int, dict]:
        records = {}
        for k in range(self.nnodes):
            text = self._value(f"{prefix}{k}", job_wide)
            if text:
                records[k] = json.loads(text)
                self._check_agrees(k, records[k])
        return records

    def _check_agrees(self, k: int, theirs: dict) -> None:
        for name in ("nnodes", "max_restarts"):
            if theirs.get(name) != self.mine[name]:
                flag = "--" + name.replace("_", "-")
                raise NodeError(f"the launchers disagree on {flag}: node {self.node_rank} has "
                                f"{self.mine[name]}, node {k} has {theirs.get(name)}")

    def beaten_since(self, t: float) -> bool:
        """Whether every other node's launcher was heard from after ``t`` (this launcher's
        monotonic clock; a launcher that runs beats twice a second)."""
        return self.peers.heard_since(t)

    def lost_nodes(self, now: float) -> list[int]:
        """Nodes lost in this attempt: their connection closed without a "bye", or nothing
        came over it for the timeout (on a node other than 0: node 0, or what node 0 declared
        lost). Nothing in the store counts: no node is declared lost because a record vanished
        or repeated."""
        return self.peers.lost(now)

    def never_connected(self, nodes: list[int]) -> bool:
        """Whether every node in ``nodes`` never connected to node 0's launcher in this
        attempt (no evidence of what became of it)."""
        return self.peers.never_connected(nodes)

    def report_failure(self, attempt: int, text: str) -> None:
        """Tell the other nodes this node failed in ``attempt`` (over the node link)."""
        self.peers.send("failed", text=text)

    def remote_failure(self, attempt: int) -> tuple[int, str] | None:
        """Another node's failure report in this attempt: (node, text), else None."""
        return self.peers.failure()

    def finish(self, attempt: int) -> bool:
        """Say this node's ranks all succeeded; True when every node has said so."""
        return self.peers.finish()

    def all_finished(self, attempt: int) -> bool:
        return self.peers.all_finished()

    def close(self) -> None:
        """Say goodbye to the other launchers and close the connections."""
        if self.peers is not None:
            self.peers.close()


def _link_port(record: dict) -> int | None:
    """The port node 0's launcher listens on for the others, from its join record."""
    port = record.get("link_port")
    return port if isinstance(port, int) and 0 < port < 65536 else None
