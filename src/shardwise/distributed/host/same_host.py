"""Whether the ranks of a group share this host, and so may share memory.

``same_host`` compares every rank's ``host_id`` (one all-gather); ``on_one_host`` is the test
each same-host path of DDP, ZeRO and FSDP runs once when it is set up: CPU tensors, more than
one rank, a real process group, every rank's own precondition, and one host.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist

from shardwise.distributed.env import int_var

NODE_VAR = "GROUP_RANK"  # the launch's node of this process


def host_id() -> bytes:
    """32 bytes that equal another process's exactly when both run on this host and boot and
    belong to the same node of the launch (``GROUP_RANK``, set by torchrun and our launcher):
    nodes simulated on one host keep the path real nodes take, so their restarts behave alike."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
    except OSError:
        boot = b""
    node = str(int_var(NODE_VAR, 0, minimum=0)).encode()
    return hashlib.sha256(socket.gethostname().encode() + b"\0" + boot + b"\0" + node).digest()


def same_host(group: dist.ProcessGroup) -> bool:
    """Whether every rank of ``group`` runs on this host (one all-gather of 32 bytes)."""
    mine = torch.frombuffer(bytearray(host_id()), dtype=torch.uint8)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return all(torch.equal(mine, other) for other in everyone)


def on_one_host(group: dist.ProcessGroup, device: torch.device,
                local_ok: Callable[[], bool]) -> bool:
    """Whether a shared-memory path may serve ``group`` on ``device``: CPU tensors, more than
    one rank, not a dry run's fake group, ``local_ok()`` on every rank, and every rank on this
    host. Collective (every rank must call it): an all-reduce of the ranks' verdicts, then
    ``same_host`` where they all agree."""
    if device.type != "cpu" or dist.get_world_size(group) < 2:
        return False
    if dist.get_backend(group) == "fake":  # a dry run's ranks share no host (shardwise.sim)
        return False
    flag = torch.tensor([1 if local_ok() else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item()) and same_host(group)
