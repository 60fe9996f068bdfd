"""Device maps: validation at init, mapping and inverse, and the CUDA path where a GPU exists."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import shardwise.rpc as rpc
from shardwise.rpc.agent import start_agent
from shardwise.rpc.wire.device_maps import (
    DeviceMapError,
    check_present,
    inferred_devices,
    inverse,
    normalize_device_map,
    target_device,
    validate_device_maps,
)
from tests.harness.ports import closed_port
from tests.rpc.conftest import ROOT

D = torch.device


def _record(name, devices=("cpu",), maps=None, explicit=False):
    return {"name": name, "devices": list(devices), "explicit": explicit, "maps": maps or {}}


def test_a_worker_without_devices_gets_what_peers_map_to_it():
    """As torch's TensorPipe agent: w0's map to w1 is enough for w1 to have w1's side of it."""
    records = [_record("w0", ["cpu", "cuda:0"], {"w1": {"cuda:0": "cuda:1"}}), _record("w1")]
    every = inferred_devices(records)
    assert every["w1"] == [D("cpu"), D("cuda:1")]
    assert every["w0"] == [D("cpu"), D("cuda:0")]
    validate_device_maps({"w1": {D("cuda:0"): D("cuda:1")}}, every["w0"], every, "w0")


def test_a_worker_that_named_its_devices_keeps_them_and_the_map_is_refused():
    records = [_record("w0", ["cpu", "cuda:0"], {"w1": {"cuda:0": "cuda:1"}}),
               _record("w1", ["cpu"], explicit=True)]
    every = inferred_devices(records)
    assert every["w1"] == [D("cpu")]
    with pytest.raises(DeviceMapError, match=r"'w1' has no device cuda:1"):
        validate_device_maps({"w1": {D("cuda:0"): D("cuda:1")}}, every["w0"], every, "w0")


@pytest.mark.skipif(torch.cuda.device_count() > 7, reason="needs a CUDA device this host lacks")
def test_a_peer_mapping_to_a_device_this_worker_lacks_is_named():
    with pytest.raises(DeviceMapError, match=r"sends tensors to cuda:7 on worker 'w1'"):
        check_present([D("cpu"), D("cuda:7")], "w1")


def test_mapping_and_inverse():
    m = normalize_device_map({"cuda:0": "cuda:1", 1: "cuda:0", "cpu": "cpu"})
    assert target_device(D("cuda:0"), m, "w1") == D("cuda:1")
    assert target_device(D("cuda:1"), m, "w1") == D("cuda:0")  # bare ints mean cuda
    assert target_device(D("cpu"), {}, "w1") == D("cpu")  # cpu needs no map
    assert inverse(m) == {D("cuda:1"): D("cuda:0"), D("cuda:0"): D("cuda:1"), D("cpu"): D("cpu")}
    with pytest.raises(DeviceMapError, match="no entry for cuda:2"):
        target_device(D("cuda:2"), m, "w1")


def test_non_bijective_map_rejected():
    with pytest.raises(DeviceMapError, match="not one-to-one"):
        normalize_device_map({"cuda:0": "cuda:1", "cuda:1": "cuda:1"})
    with pytest.raises(DeviceMapError, match="not one-to-one"):
        rpc.TensorPipeRpcBackendOptions(device_maps={"w1": {"cuda:0": "cuda:0",
                                                            "cuda:1": "cuda:0"}})


def test_validation_against_published_devices():
    mine = [D("cpu"), D("cuda:0")]
    peers = {"w0": mine, "w1": [D("cpu"), D("cuda:0"), D("cuda:1")]}
    validate_device_maps({"w1": {D("cuda:0"): D("cuda:1")}}, mine, peers, "w0")
    with pytest.raises(DeviceMapError, match="local device cuda:1 is not one of"):
        validate_device_maps({"w1": {D("cuda:1"): D("cuda:0")}}, mine, peers, "w0")
    with pytest.raises(DeviceMapError, match="'w1' has no device cuda:3"):
        validate_device_maps({"w1": {D("cuda:0"): D("cuda:3")}}, mine, peers, "w0")
    with pytest.raises(DeviceMapError, match="unknown worker 'w9'"):
        validate_device_maps({"w9": {D("cuda:0"): D("cuda:0")}}, mine, peers, "w0")
    with pytest.raises(DeviceMapError, match="unknown device|not supported"):
        normalize_device_map({"tpu:0": "cpu"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only rejection")
def test_init_rejects_a_device_this_machine_lacks():
    with closed_port() as port:  # refused before anything binds or connects
        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                               device_maps={"w1": {"cuda:0": "cuda:1"}})
        with pytest.raises(DeviceMapError, match="cuda:0 does not exist on this worker"):
            start_agent("w0", 0, 2, opts)


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA device (none here)")
def test_cuda_tensors_follow_the_device_map():
    """Two processes on one host: cuda tensors move by CUDA IPC to the mapped device, results
    come back through the inverse map."""
    out = subprocess.run([sys.executable, "-m", "tests.rpc.cuda_scenario"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "cuda ok" in out.stdout
