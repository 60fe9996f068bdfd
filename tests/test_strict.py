"""Strict by default, over the whole public API: an unknown keyword to each public constructor
is a TypeError naming it (torch's own message shape: "got an unexpected keyword argument"), and
a torch argument we accept without honouring it warns once. Other strictness tests live beside
their mechanism: FSDP1's ignored arguments and use_orig_params=False
(tests/fsdp/test_fsdp1_constructor.py), gradients arriving twice (tests/ddp, tests/zero,
tests/fsdp/test_fsdp_state_machine.py)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from tests.harness import run_on_ranks


def _spec():
    from shardwise.sharded_tensor import ChunkShardingSpec

    return ChunkShardingSpec(dim=0, placements=["rank:0/cpu"])


def _stage():
    from shardwise.pipeline import PipelineStage

    return PipelineStage(nn.Linear(2, 2), 0, 1)


def _constructors() -> dict:
    import shardwise
    import shardwise.rpc as rpc
    import shardwise.sharded_tensor as st
    from shardwise.distributed import init_device_mesh
    from shardwise.pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe

    lin = lambda: nn.Linear(2, 2)  # noqa: E731
    return {
        "DistributedDataParallel": lambda **k: shardwise.DistributedDataParallel(lin(), **k),
        "ZeroRedundancyOptimizer": lambda **k: shardwise.ZeroRedundancyOptimizer(
            lin().parameters(), torch.optim.SGD, lr=0.1, **k),
        "ZeroDataParallel": lambda **k: shardwise.ZeroDataParallel(lin(), **k),
        "FullyShardedDataParallel": lambda **k: shardwise.FullyShardedDataParallel(lin(), **k),
        "fully_shard": lambda **k: shardwise.fully_shard(lin(), **k),
        "MixedPrecision": lambda **k: shardwise.MixedPrecision(**k),
        "CPUOffload": lambda **k: shardwise.CPUOffload(**k),
        "init_device_mesh": lambda **k: init_device_mesh("cpu", (1,), **k),
        "ChunkShardingSpec": lambda **k: st.ChunkShardingSpec(dim=0, placements=["rank:0/cpu"],
                                                              **k),
        "ShardedTensor": lambda **k: st.ShardedTensor(_spec(), 4, 2, **k),
        "empty": lambda **k: st.empty(_spec(), 4, 2, **k),
        "zeros": lambda **k: st.zeros(_spec(), 4, 2, **k),
        "ones": lambda **k: st.ones(_spec(), 4, 2, **k),
        "full": lambda **k: st.full(_spec(), (4, 2), 1.0, **k),
        "rand": lambda **k: st.rand(_spec(), 4, 2, **k),
        "randn": lambda **k: st.randn(_spec(), 4, 2, **k),
        "shard_parameter": lambda **k: st.shard_parameter(nn.Linear(4, 4), "weight", _spec(),
                                                          **k),
        "PipelineStage": lambda **k: PipelineStage(lin(), 0, 1, **k),
        "ScheduleGPipe": lambda **k: ScheduleGPipe(_stage(), 1, **k),
        "Schedule1F1B": lambda **k: Schedule1F1B(_stage(), 1, loss_fn=nn.functional.mse_loss,
                                                 **k),
        "TensorPipeRpcBackendOptions": lambda **k: rpc.TensorPipeRpcBackendOptions(**k),
        "init_rpc": lambda **k: rpc.init_rpc("w0", rank=0, world_size=1, **k),
        "RemoteModule": lambda **k: rpc.RemoteModule("w0/cpu", nn.Linear, args=(2, 2), **k),
    }


NAMES = ["DistributedDataParallel", "ZeroRedundancyOptimizer", "ZeroDataParallel",
         "FullyShardedDataParallel", "fully_shard", "MixedPrecision", "CPUOffload",
         "init_device_mesh", "ChunkShardingSpec", "ShardedTensor", "empty", "zeros", "ones",
         "full", "rand", "randn", "shard_parameter", "PipelineStage", "ScheduleGPipe",
         "Schedule1F1B", "TensorPipeRpcBackendOptions", "init_rpc", "RemoteModule"]


def _unknown_keywords(ctx) -> dict:
    """name -> the TypeError's message, or what happened instead."""
    out = {}
    for name, make in _constructors().items():
        try:
            make(bogus_keyword=1)
            out[name] = "no error"
        except TypeError as exc:
            out[name] = str(exc)
        except Exception as exc:  # noqa: BLE001 - reported as the wrong error
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def test_every_public_constructor_refuses_an_unknown_keyword():
    got = run_on_ranks(1, _unknown_keywords)[0]
    assert sorted(got) == sorted(NAMES)
    for name, message in got.items():
        assert "unexpected keyword argument 'bogus_keyword'" in message, (name, message)


def _torch_only_warns_once(ctx) -> dict:
    import shardwise.sharded_tensor as st

    counts = {}
    for name, value in [("pin_memory", True), ("init_rrefs", True),
                        ("memory_format", torch.channels_last)]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                st.zeros(_spec(), 4, 2, **{name: value})
                st.ShardedTensor(_spec(), 4, 2, **{name: value})
        counts[name] = [str(w.message) for w in caught if name in str(w.message)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        st.zeros(_spec(), 4, 2, pin_memory=False, init_rrefs=False)  # torch's defaults: quiet
    counts["defaults"] = [str(w.message) for w in caught]
    from shardwise.pipeline import PipelineStage

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            PipelineStage(nn.Linear(2, 2), 0, 1, input_args=(torch.zeros(1, 2),))
    counts["input_args"] = [str(w.message) for w in caught]
    return counts


def test_accepted_torch_arguments_without_effect_warn_once():
    counts = run_on_ranks(1, _torch_only_warns_once)[0]
    for name in ("pin_memory", "init_rrefs", "memory_format"):
        assert len(counts[name]) == 1, counts[name]
        assert "accepted for torch's API and ignored" in counts[name][0]
    assert counts["defaults"] == []
    assert len(counts["input_args"]) == 1 and "ignored" in counts["input_args"][0]



def test_mixed_precision_policies_refuse_non_floating_dtypes():
    import pytest

    from shardwise.fsdp.mixed_precision import MixedPrecision, MixedPrecisionPolicy

    for cls, field in ((MixedPrecision, "buffer_dtype"), (MixedPrecisionPolicy, "output_dtype"),
                       (MixedPrecision, "param_dtype"), (MixedPrecisionPolicy, "reduce_dtype")):
        with pytest.raises(ValueError, match=f"{cls.__name__}.{field} must be a floating"):
            cls(**{field: torch.int32})
        assert getattr(cls(**{field: torch.bfloat16}), field) is torch.bfloat16
