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
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

_NODE = "shardwise/nodes/"
_CLAIM = "shardwise/node_claims/"
_BEAT = "shardwise/node_beat/"
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
                 max_restarts: int, timeout: float):
        if nnodes < 1:
            raise NodeError(f"--nnodes must be at least 1, got {nnodes}")
        if not 0 <= node_rank < nnodes:
            raise NodeError(f"--node-rank must be in [0, {nnodes}) for --nnodes {nnodes}, "
                            f"got {node_rank}")
        self.store, self.node_rank, self.nnodes = store, node_rank, nnodes
        self.mine = {"nnodes": nnodes, "nproc": nproc, "max_restarts": max_restarts,
                     "host": socket.gethostname()}
        self.timeout = timeout
        self._beats = 0
        self._seen: dict[int, tuple[str, float]] = {}

    def join(self) -> Layout:
        """Announce this node and wait for all others; the global rank layout."""
        if self.store.add(f"{_CLAIM}{self.node_rank}", 1) > 1:
            raise NodeError(f"two launchers were started with --node-rank {self.node_rank}")
        self.store.set(f"{_NODE}{self.node_rank}", json.dumps(self.mine))
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
        return Layout(sum(sizes[: self.node_rank]), sum(sizes))

    def _records(self) -> dict[int, dict]:
        records = {}
        for k in range(self.nnodes):
            key = f"{_NODE}{k}"
            if self.store.check([key]):
                records[k] = json.loads(self.store.get(key))
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
        self.store.set(f"{_BEAT}{self.node_rank}", str(self._beats))

    def lost_nodes(self, now: float) -> list[int]:
        """Nodes whose beat has not changed for the timeout (judged by this launcher's clock)."""
        lost = []
        for k in range(self.nnodes):
            if k == self.node_rank:
                continue
            key = f"{_BEAT}{k}"
            value = self.store.get(key).decode() if self.store.check([key]) else ""
            last = self._seen.get(k)
            if last is None or last[0] != value:
                self._seen[k] = (value, now)
            elif now - last[1] > self.timeout:
                lost.append(k)
        return lost

    def report_failure(self, attempt: int, text: str) -> None:
        self.store.set(f"shardwise/attempt_{attempt}/failed/{self.node_rank}", text)

    def remote_failure(self, attempt: int) -> tuple[int, str] | None:
        for k in range(self.nnodes):
            key = f"shardwise/attempt_{attempt}/failed/{k}"
            if k != self.node_rank and self.store.check([key]):
                return k, self.store.get(key).decode(errors="replace")
        return None

    def finish(self, attempt: int) -> bool:
        """Say this node's ranks all succeeded; True when it is the last node to say so."""
        return self.store.add(f"shardwise/attempt_{attempt}/finished", 1) >= self.nnodes

    def all_finished(self, attempt: int) -> bool:
        return self.store.add(f"shardwise/attempt_{attempt}/finished", 0) >= self.nnodes
