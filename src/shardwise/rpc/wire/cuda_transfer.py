"""CUDA tensors in RPC messages: device maps applied, device-to-device where the host allows.

Between processes on one host a CUDA tensor travels as a CUDA IPC handle (torch's own
``reduce_tensor``): the receiver opens the sender's memory, waits on the IPC event that the
sender recorded on its current stream (so it never reads before the producer's kernels wrote),
and copies device-to-device onto the mapped device on its own current stream; host memory is
never touched. Across hosts the tensor is staged through host memory, with a one-time warning
(an NCCL point-to-point channel is not implemented). The map used for a request is the
caller's map to the callee; for a reply, the inverse of that map, which the caller sends along.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import torch

from shardwise.rpc.trust.callables import register
from shardwise.rpc.trust.serialization import cpu_buffer, current_session, tensor_from_buffer
from shardwise.rpc.wire.device_maps import DeviceMap, DeviceMapError, target_device

log = logging.getLogger("shardwise.rpc")


class _ThreadState(threading.local):
    override: tuple[int, DeviceMap] | None = None  # (peer, map) while replying to peer


class CudaTransfer:
    def __init__(self, agent) -> None:
        self._agent = agent
        self._hosts: list[str] = []
        self._tls = _ThreadState()
        self._warned = False

    def set_peer_hosts(self, hosts: list[str]) -> None:
        self._hosts = hosts

    @contextlib.contextmanager
    def reply_map(self, peer: int, device_map: DeviceMap | None) -> Iterator[None]:
        """Within this block, tensors sent to ``peer`` use ``device_map`` (a reply's map)."""
        outer = self._tls.override
        self._tls.override = (peer, device_map or {})
        try:
            yield
        finally:
            self._tls.override = outer

    def map_for(self, dest: int) -> DeviceMap:
        override = self._tls.override
        if override is not None and override[0] == dest:
            return override[1]
        return self._agent.device_maps.get(self._agent.workers[dest].name, {})

    def reduce(self, t: torch.Tensor, dest: int) -> tuple:
        peer = self._agent.workers[dest].name
        target = target_device(t.device, self.map_for(dest), peer)
        if self._hosts and self._hosts[dest] == self._hosts[self._agent.rank]:
            from torch.multiprocessing.reductions import reduce_tensor

            _, args = reduce_tensor(t.detach())
            # (the tensor and storage classes stay out of the pickle: the receiver supplies
            # them, so the unpickler needs no global beyond _rebuild_ipc and the dtype)
            return _rebuild_ipc, (args[1:4] + args[5:], str(target), t.requires_grad)
        if not self._warned:
            log.warning("shardwise.rpc: CUDA tensors to %r (another host) are staged through "
                        "host memory", peer)
            self._warned = True
        buf, dtype, shape = cpu_buffer(t.detach().cpu())
        return _rebuild_staged, (buf, dtype, shape, str(target), t.requires_grad)


def _check_target(target: str) -> torch.device:
    dev = torch.device(target)
    if dev.type == "cuda" and (not torch.cuda.is_available()
                               or dev.index >= torch.cuda.device_count()):
        raise DeviceMapError(f"a peer sent a tensor for {dev}, which this worker does not have")
    return dev


def _finish(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    if requires_grad:
        t.requires_grad_(True)
        with contextlib.suppress(RuntimeError):
            current_session().grad_tensors.append(t)
    return t


@register
def _rebuild_ipc(args: tuple, target: str, requires_grad: bool) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    dev = _check_target(target)
    if not isinstance(args, tuple) or len(args) != 13:
        raise RuntimeError("malformed CUDA IPC tensor description")
    # waits on the producer's IPC event on our current stream
    shared = rebuild_cuda_tensor(torch.Tensor, *args[:3], torch.storage.TypedStorage, *args[3:])
    with torch.cuda.device(dev):
        own = shared.to(dev, copy=True)  # device to device, then the IPC block can go
    return _finish(own, requires_grad)


@register
def _rebuild_staged(buf, dtype: str, shape, target: str, requires_grad: bool) -> torch.Tensor:
    dev = _check_target(target)
    return _finish(tensor_from_buffer(buf, dtype, shape).to(dev), requires_grad)
