"""Lightning's Trainer with ``ModelParallelStrategy``: the LightningModule shards itself in
``configure_model`` with FSDP2's ``fully_shard`` (torch's or shardwise's, the one line that
differs) and both train to the same per-step losses."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from tests.integrations.common import BATCH, LR, STEPS, ResNet, compare_losses, dataset, save


def main(impl: str, out_dir: str) -> None:
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import ModelParallelStrategy

    if impl == "torch":
        from torch.distributed.fsdp import FSDPModule, fully_shard
    else:
        from shardwise import FSDPModule, fully_shard

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = ResNet()
            self.losses: list[torch.Tensor] = []

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.net.block, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, index):
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    module = Module()
    loader = torch.utils.data.DataLoader(dataset(STEPS), batch_size=BATCH)
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, loader)
    save(out_dir, impl, trainer.global_rank, {"losses": torch.stack(module.losses),
                                              "sharded": isinstance(module.net, FSDPModule)})


@pytest.mark.slow
def test_model_parallel_strategy_with_shardwise_fully_shard_matches_fsdp2(tmp_path):
    pytest.importorskip("pytorch_lightning", reason="PyTorch Lightning is not installed "
                        "(pip install 'shardwise[lightning]')")
    from tests.integrations.launch import run_both

    runs = run_both("tests.integrations.test_lightning_model_parallel", tmp_path)
    compare_losses(runs, STEPS)
    assert all(r["sharded"] for impl in runs for r in runs[impl])


if __name__ == "__main__":
    main(*sys.argv[1:])
