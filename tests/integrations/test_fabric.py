"""Lightning Fabric trains the same loop with torch's DDP (``strategy="ddp"``) and shardwise's
(``strategy="shardwise_ddp"``, shardwise.integrations.fabric), gradient accumulation through
``fabric.no_backward_sync``; and with FSDP2 through ``ModelParallelStrategy(parallelize_fn=...)``
calling torch's or shardwise's ``fully_shard``. Per-step losses are equal."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from tests.integrations.common import (
    LR,
    STEPS,
    WRAPPERS,
    ResNet,
    compare_losses,
    rank_batch,
    save,
)

ACCUMULATE = 2


def _ddp(impl: str):
    from lightning_fabric import Fabric

    if impl == "shardwise":
        import shardwise.integrations.fabric  # noqa: F401 (registers "shardwise_ddp")
    fabric = Fabric(accelerator="cpu", devices=2,
                    strategy="shardwise_ddp" if impl == "shardwise" else "ddp")
    fabric.launch()
    torch.manual_seed(0)
    model = ResNet()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    losses = []
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            x, y = rank_batch(fabric.global_rank, step * ACCUMULATE + micro)
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATE - 1):
                loss = F.mse_loss(model(x), y)
                fabric.backward(loss / ACCUMULATE)
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
    wrapper = model._forward_module  # what fabric.setup wrapped the module in (a check only)
    return fabric, {"losses": torch.stack(losses), "wrapper": type(wrapper).__module__}


def _fsdp2(impl: str):
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import ModelParallelStrategy

    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from shardwise import fully_shard

    def parallelize(model, device_mesh):
        mesh = device_mesh["data_parallel"]
        fully_shard(model.block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=2,
                                     tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup(ResNet())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    losses = []
    for step in range(STEPS):
        x, y = rank_batch(fabric.global_rank, step)
        loss = F.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return fabric, {"losses": torch.stack(losses)}


def main(impl: str, out_dir: str) -> None:
    kind, impl = impl.split("-")
    fabric, results = (_ddp if kind == "ddp" else _fsdp2)(impl)
    save(out_dir, f"{kind}-{impl}", fabric.global_rank, results)


def _runs(kind: str, tmp_path) -> dict:
    from tests.integrations.launch import run_both

    return run_both("tests.integrations.test_fabric", tmp_path, kind)


@pytest.mark.slow
def test_fabric_shardwise_ddp_with_no_backward_sync_matches_torch_ddp(tmp_path):
    pytest.importorskip("lightning_fabric", reason="Lightning Fabric is not installed "
                        "(pip install 'shardwise[lightning]')")
    runs = _runs("ddp", tmp_path)
    compare_losses(runs, STEPS * ACCUMULATE)
    for impl, wrapper in WRAPPERS.items():
        assert [r["wrapper"] for r in runs[impl]] == [wrapper] * 2


@pytest.mark.slow
def test_fabric_model_parallel_with_shardwise_fully_shard_matches_fsdp2(tmp_path):
    pytest.importorskip("lightning_fabric", reason="Lightning Fabric is not installed "
                        "(pip install 'shardwise[lightning]')")
    compare_losses(_runs("fsdp2", tmp_path), STEPS)


if __name__ == "__main__":
    main(*sys.argv[1:])
