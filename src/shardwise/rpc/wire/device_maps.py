"""Device maps: where a tensor sent to a worker lands, and the checks made at init.

A device map for peer ``w`` maps this worker's devices to ``w``'s devices: a tensor on local
``cuda:0`` sent with ``{"cuda:0": "cuda:1"}`` arrives on ``w``'s ``cuda:1``, and results come
back through the inverse map. CPU tensors go to CPU unless the map says otherwise; a CUDA tensor
whose device is not in the map is an error (never a silent copy through host memory). Maps are
checked when the agent starts, against the devices every worker published: each key must be one
of this agent's devices, each value one of the peer's, and the map must be one-to-one.
"""

from __future__ import annotations

from typing import Any

import torch

DeviceMap = dict[torch.device, torch.device]


class DeviceMapError(ValueError):
    """A device map or device list that cannot work; the message says which entry and why."""


def as_device(d: Any) -> torch.device:
    if isinstance(d, int):
        return torch.device("cuda", d)  # torch's convention for bare integers
    try:
        dev = torch.device(d)
    except (RuntimeError, TypeError) as exc:
        raise DeviceMapError(f"unknown device {d!r}: {exc}") from exc
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", 0)
    if dev.type not in ("cpu", "cuda"):
        raise DeviceMapError(f"device {dev} is not supported by RPC (cpu or cuda only)")
    return dev


def normalize_device_map(device_map: dict) -> DeviceMap:
    if not isinstance(device_map, dict):
        raise DeviceMapError(f"a device map is a dict of local -> remote devices, got "
                             f"{type(device_map).__name__}")
    out: DeviceMap = {}
    for k, v in device_map.items():
        out[as_device(k)] = as_device(v)
    check_bijective(out)
    return out


def normalize_devices(devices: list) -> list[torch.device]:
    out = [as_device(d) for d in devices]
    if len(set(out)) != len(out):
        raise DeviceMapError(f"devices lists a device twice: {[str(d) for d in out]}")
    return out


def check_bijective(device_map: DeviceMap) -> None:
    seen: dict[torch.device, torch.device] = {}
    for src, dst in device_map.items():
        if dst in seen:
            raise DeviceMapError(f"device map is not one-to-one: {seen[dst]} and {src} both map "
                                 f"to {dst}")
        seen[dst] = src


def available_devices() -> list[torch.device]:
    """Devices that exist in this process: cpu and every visible CUDA device."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [torch.device("cpu")] + [torch.device("cuda", i) for i in range(count)]


def _first_missing(devices: list[torch.device]) -> tuple[torch.device, str] | None:
    """The first of ``devices`` this process lacks, with the devices it has (for the error)."""
    present = set(available_devices())
    for dev in devices:
        if dev not in present:
            return dev, ", ".join(str(d) for d in sorted(present, key=str))
    return None


def local_devices(devices: list[torch.device] | None,
                  device_maps: dict[str, DeviceMap]) -> list[torch.device]:
    """This agent's devices: the ``devices`` option, else cpu and every device a map names."""
    chosen = list(devices) if devices is not None else sorted(
        {torch.device("cpu")} | {k for m in device_maps.values() for k in m}, key=str)
    missing = _first_missing(chosen)
    if missing:
        raise DeviceMapError(f"device {missing[0]} does not exist on this worker (it has "
                             f"{missing[1]})")
    if torch.device("cpu") not in chosen:
        chosen.append(torch.device("cpu"))
    return chosen


def inferred_devices(records: list[dict]) -> dict[str, list[torch.device]]:
    """Every worker's devices, from the records all workers published at init (``name``,
    ``devices``, ``maps``: its device maps as strings, ``explicit``: whether it named its
    ``devices``). As in torch's TensorPipe agent, a worker that did not name its devices also has
    every device a peer's map sends to it, so ``{"w1": {"cuda:0": "cuda:1"}}`` on w0 alone is
    enough for w1 to receive on cuda:1."""
    out = {r["name"]: [as_device(d) for d in r["devices"]] for r in records}
    named = {r["name"] for r in records if r["explicit"]}
    for r in records:
        for peer, device_map in r["maps"].items():
            if peer not in out or peer in named:
                continue
            for dst in device_map.values():
                if as_device(dst) not in out[peer]:
                    out[peer].append(as_device(dst))
    return out


def check_present(devices: list[torch.device], name: str) -> None:
    """Raise DeviceMapError if a device that peers' maps target on this worker is missing."""
    missing = _first_missing(devices)
    if missing:
        raise DeviceMapError(f"a peer's device map sends tensors to {missing[0]} on worker "
                             f"{name!r}, which does not have it (it has {missing[1]})")


def validate_device_maps(device_maps: dict[str, DeviceMap], mine: list[torch.device],
                         peers: dict[str, list[torch.device]], my_name: str) -> None:
    """Check every map of this worker against its devices and the peers' (raises DeviceMapError)."""
    for peer, device_map in device_maps.items():
        if peer not in peers:
            raise DeviceMapError(f"device map for unknown worker {peer!r}; workers: "
                                 f"{sorted(peers)}")
        if peer == my_name:
            raise DeviceMapError(f"worker {my_name!r} has a device map to itself")
        check_bijective(device_map)
        for src, dst in device_map.items():
            if src not in mine:
                raise DeviceMapError(f"device map to {peer!r}: local device {src} is not one of "
                                     f"this worker's devices {[str(d) for d in mine]}")
            if dst not in peers[peer]:
                raise DeviceMapError(f"device map to {peer!r}: {src} -> {dst}, but {peer!r} has "
                                     f"no device {dst} (its devices: "
                                     f"{[str(d) for d in peers[peer]]})")


def target_device(device: torch.device, device_map: DeviceMap, peer: str) -> torch.device:
    """Where a tensor on local ``device`` lands on ``peer`` under ``device_map``."""
    if device in device_map:
        return device_map[device]
    if device.type == "cpu":
        return device
    raise DeviceMapError(
        f"tensor on {device} sent to {peer!r} but the device map to {peer!r} has no entry for "
        f"{device}; call options.set_device_map({peer!r}, {{'{device}': '<remote device>'}})"
    )


def inverse(device_map: DeviceMap) -> DeviceMap:
    return {dst: src for src, dst in device_map.items()}
