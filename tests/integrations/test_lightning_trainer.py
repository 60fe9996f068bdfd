"""Lightning's Trainer trains the same LightningModule with ``strategy="ddp"`` (torch's DDP) and
``strategy="shardwise_ddp"`` (shardwise.integrations.lightning) to the same per-step losses,
with gradient accumulation (``no_sync``) on, and with manual optimization (``manual_backward``,
which runs inside the wrapper's forward); ``teardown`` leaves the bare LightningModule."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from tests.integrations.common import (
    BATCH,
    LR,
    STEPS,
    WRAPPERS,
    ResNet,
    compare_losses,
    dataset,
    save,
)

ACCUMULATE = 2


def main(kind_impl: str, out_dir: str) -> None:
    import pytorch_lightning as pl

    kind, impl = kind_impl.split("-")
    manual = kind == "manual"

    strategy = "ddp"
    if impl == "shardwise":
        import shardwise.integrations.lightning  # noqa: F401 (registers "shardwise_ddp")

        strategy = "shardwise_ddp"

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = ResNet()
            self.losses: list[torch.Tensor] = []
            self.automatic_optimization = not manual

        def training_step(self, batch, index):
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.losses.append(loss.detach())
            self.wrapper = type(self.trainer.strategy.model).__module__
            if manual:
                optimizer = self.optimizers()
                optimizer.zero_grad()
                self.manual_backward(loss)
                optimizer.step()
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    module = Module()
    accumulate = 1 if manual else ACCUMULATE
    loader = torch.utils.data.DataLoader(dataset(STEPS * accumulate), batch_size=BATCH)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS,
                         accumulate_grad_batches=accumulate, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, loader)
    rank = trainer.global_rank
    save(out_dir, kind_impl, rank, {"losses": torch.stack(module.losses),
                               "bare": trainer.strategy.model is module,
                               "wrapper": module.wrapper})


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["automatic", "manual"])
def test_trainer_with_shardwise_ddp_matches_torch_ddp(tmp_path, kind):
    pytest.importorskip("pytorch_lightning", reason="PyTorch Lightning is not installed "
                        "(pip install 'shardwise[lightning]')")
    from tests.integrations.launch import run_both

    runs = run_both("tests.integrations.test_lightning_trainer", tmp_path, kind)
    compare_losses(runs, STEPS * (ACCUMULATE if kind == "automatic" else 1))
    for impl, wrapper in WRAPPERS.items():
        assert all(r["bare"] for r in runs[impl]), f"{impl}: teardown kept the wrapper"
        assert [r["wrapper"] for r in runs[impl]] == [wrapper] * 2


if __name__ == "__main__":
    main(*sys.argv[1:])
