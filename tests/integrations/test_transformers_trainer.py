"""The transformers ``Trainer`` trains a tiny GPT-2 (built from a config: no download) with
torch's DDP (the plain Trainer) and with shardwise's (the Trainer with
``ShardwiseDDPTrainerMixin``); the losses it logs at every step are equal."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.integrations.common import LR, STEPS, WRAPPERS, save

ACCUMULATE = 2


class _Tokens(torch.utils.data.Dataset):
    """Fixed token sequences; labels are the inputs (the model shifts them)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, 64, (n, 12), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(impl: str, out_dir: str) -> None:
    import transformers

    trainer_class = transformers.Trainer
    if impl == "shardwise":
        from shardwise.integrations.transformers import ShardwiseDDPTrainerMixin

        class Trainer(ShardwiseDDPTrainerMixin, transformers.Trainer):
            pass

        trainer_class = Trainer

    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=2,
        gradient_accumulation_steps=ACCUMULATE, learning_rate=LR, lr_scheduler_type="constant",
        optim="adamw_torch", logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = trainer_class(model=model, args=args, train_dataset=_Tokens(64))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    save(out_dir, impl, trainer.args.process_index, {
        "losses": torch.tensor(losses, dtype=torch.float64),
        "wrapper": type(trainer.model_wrapped).__module__,
        "unwrapped": trainer.accelerator.unwrap_model(trainer.model_wrapped) is model})


@pytest.mark.slow
def test_trainer_with_shardwise_mixin_logs_the_losses_of_torch_ddp(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed "
                        "(pip install 'shardwise[transformers]')")
    pytest.importorskip("accelerate", reason="accelerate is not installed")
    from tests.integrations.common import compare_losses
    from tests.integrations.launch import run_both

    runs = run_both("tests.integrations.test_transformers_trainer", tmp_path)
    compare_losses(runs, STEPS)
    for impl, wrapper in WRAPPERS.items():
        assert [r["wrapper"] for r in runs[impl]] == [wrapper] * 2
        assert all(r["unwrapped"] for r in runs[impl]), impl


if __name__ == "__main__":
    main(*sys.argv[1:])
