"""Launchers on several nodes agreeing on one job (``--nnodes``, ``--node-rank``,
``--rdzv-endpoint``, with torchrun's meaning).

The launcher of node 0 hosts the rendezvous TCPStore at the endpoint; the others connect to it.
Each launcher writes a record ``shardwise/nodes/<k>`` (its --nnodes, ranks per node,
--max-restarts) and waits for the other nodes' records, checking every one it sees against its
own, so that launchers that disagree stop at once with an error naming both values. Global ranks
are numbered node by node. While the job runs, every launcher bumps ``shardwise/node_beat/<k>``
and watches the others': a node whose beat stops for the timeout is reported lost, by number. A
node whose ranks failed writes its report under ``shardwise/attempt_<a>/failed/<k>`` so the others
stop their own ranks and repeat the cause, instead of blaming their ranks' broken connections.

Restarts with a lost node (``--max-restarts``): the surviving launchers write the attempt to run
next (``shardwise/next_attempt``) and mark the node lost (``shardwise/node_lost/<k>``); a launcher
started again for that node finds its node rank already claimed, waits for the mark, takes it
(so that a third launcher for the node is again a duplicate) and joins that attempt. When node 0
itself was lost, its store went with it: the other launchers connect to the store of node 0's new
launcher and join again; every record carries the attempt its launcher is about to run and all
take the largest, so node 0's new launcher (which knows nothing) continues the job's count. Each
attempt starts when every node has said it is ready for it (``wait_ready``), so the survivors wait
for the lost node to rejoin, within the timeout.

Every record here is signed under the job's secret ([Note: launcher records] in job_secret.py):
a record that fails its MAC is ignored and logged. A false beat counts as a sign of life (a node
is never declared lost on evidence someone tampered with), a false claim is taken over, and the
claims, "finished" and "saw the stop" are one signed record per node instead of counters.
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
from shardwise.launch.progress import SCOPE

_NODE = "shardwise/nodes/"
_CLAIM = "shardwise/node_claims/"
_BEAT = "shardwise/node_beat/"
_LOST = "shardwise/node_lost/"
_NEXT = "shardwise/next_attempt"
_STOPPED = "shardwise/job_stopped"
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
                 max_restarts: int, timeout: float, secret: bytes):
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
        self._beats = 0
        self._seen: dict[int, tuple[int, float]] = {}
        self._stop_seen = False

    # -- signed records ([Note: launcher records]) --------------------------------------------

    def _put(self, key: str, value: str) -> None:
        signed_store.put(self.store, key, value, self.secret, SCOPE)

    def _sealed(self, key: str, value: str) -> bytes:
        return signed_store.seal(key, value, self.secret, SCOPE)

    def _read(self, key: str) -> tuple[str | None, bool]:
        """(the true value under ``key`` or None, whether a false record is there)."""
        if not self.store.check([key]):
            return None, False
        raw = self.store.get(key)
        try:
            return signed_store.open_record(key, raw, self.secret, SCOPE).decode(
                errors="replace"), False
        except signed_store.BadRecord as why:
            signed_store._warn_once(key, bytes(raw), why)
            return None, True

    def _value(self, key: str) -> str:
        return self._read(key)[0] or ""

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
        are further on)."""
        if not self._claim():
            attempt = max(attempt, self._take_lost_place())
        self.mine["attempt"] = attempt
        self._put(f"{_NODE}{self.node_rank}", json.dumps(self.mine))
        deadline = time.monotonic() + self.timeout
        while True:
            records = self._records()
            if len(records) == self.nnodes:
                break
            if time.monotonic() > deadline:
                missing = [k for k in range(self.nnodes) if k not in records]
                raise NodeError(f"node {self.node_rank}: only {len(records)} of {self.nnodes} "
                                f"nodes joined within {self.timeout:g} s; missing nodes: "
                                f"{missing}")
            time.sleep(0.1)
        sizes = [records[k]["nproc"] for k in range(self.nnodes)]
        first = max(int(records[k].get("attempt", 0)) for k in range(self.nnodes))
        return Layout(sum(sizes[: self.node_rank]), sum(sizes)), first

    def _take_lost_place(self) -> int:
        """This node rank was claimed before: join in place of a launcher the others declared
        lost (the attempt they run next), or fail if that launcher is alive (its beat moves,
        or no mark comes within the timeout)."""
        k = self.node_rank
        beat = self._value(f"{_BEAT}{k}")
        patience = 2 * self.timeout + 5  # the others need the timeout to declare it lost
        deadline = time.monotonic() + patience
        while not self._take(f"{_LOST}{k}"):
            if self._value(f"{_BEAT}{k}") != beat:
                raise NodeError(f"two launchers were started with --node-rank {k}: the first "
                                f"is still running")
            if time.monotonic() > deadline:
                raise NodeError(f"--node-rank {k} was claimed by an earlier launcher, and the "
                                f"other nodes did not declare it lost within {patience:g} s (a "
                                f"lost node rejoins only while the job has restarts left)")
            time.sleep(0.1)
        return int(self._value(_NEXT) or 0)

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
        """Say this node is ready for ``attempt`` and wait (up to the timeout) until every node
        is; the error names the nodes that did not come."""
        self._put(f"shardwise/attempt_{attempt}/ready/{self.node_rank}", "1")
        deadline = time.monotonic() + self.timeout
        while True:
            missing = [k for k in range(self.nnodes)
                       if self._value(f"shardwise/attempt_{attempt}/ready/{k}") != "1"]
            if not missing:
                break
            if time.monotonic() > deadline:
                raise NodeError(f"node(s) {', '.join(map(str, missing))} did not join attempt "
                                f"{attempt} within {self.timeout:g} s")
            time.sleep(0.1)
        self._seen.clear()  # judge every node's beat afresh: a rejoined one beats from 1

    def say_stopped(self, text: str) -> None:
        """This launcher was told to stop (a signal): the job ends, no node restarts."""
        self._put(_STOPPED, text)

    def stopped(self) -> str | None:
        """Why the job was stopped (by a signal to some node's launcher), once seen here."""
        text = self._value(_STOPPED)
        if text and not self._stop_seen:
            self._stop_seen = True
            self._put(f"{_STOPPED}/seen/{self.node_rank}", "1")
        return text or None

    def others_saw_stop(self) -> bool:
        return all(self._value(f"{_STOPPED}/seen/{k}") == "1"
                   for k in range(self.nnodes) if k != self.node_rank)

    def _records(self) -> dict[int, dict]:
        records = {}
        for k in range(self.nnodes):
            text = self._value(f"{_NODE}{k}")
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

    def beat(self) -> None:
        self._beats += 1
        self._put(f"{_BEAT}{self.node_rank}", str(self._beats))

    def beaten_since(self, t: float) -> bool:
        """Whether ``lost_nodes`` saw every other node's beat change after ``t`` (this
        launcher's clock; a launcher that runs bumps its beat twice a second)."""
        return all(k in self._seen and self._seen[k][1] > t
                   for k in range(self.nnodes) if k != self.node_rank)

    def lost_nodes(self, now: float) -> list[int]:
        """Nodes whose beat has not changed for the timeout (judged by this launcher's clock).
        A false beat counts as a beat: no node is declared lost on evidence someone tampered
        with."""
        lost = []
        for k in range(self.nnodes):
            if k == self.node_rank:
                continue
            text, false = self._read(f"{_BEAT}{k}")
            value = int(text) if text and text.isdigit() else 0
            last = self._seen.get(k)
            if last is None or value != last[0] or false:
                self._seen[k] = (value, now)
            elif now - last[1] > self.timeout:
                lost.append(k)
        return lost

    def report_failure(self, attempt: int, text: str) -> None:
        self._put(f"shardwise/attempt_{attempt}/failed/{self.node_rank}", text)

    def remote_failure(self, attempt: int) -> tuple[int, str] | None:
        for k in range(self.nnodes):
            if k != self.node_rank:
                text = self._value(f"shardwise/attempt_{attempt}/failed/{k}")
                if text:
                    return k, text
        return None

    def finish(self, attempt: int) -> bool:
        """Say this node's ranks all succeeded; True when every node has said so."""
        self._put(f"shardwise/attempt_{attempt}/finished/{self.node_rank}", "1")
        return self.all_finished(attempt)

    def all_finished(self, attempt: int) -> bool:
        return all(self._value(f"shardwise/attempt_{attempt}/finished/{k}") == "1"
                   for k in range(self.nnodes))
