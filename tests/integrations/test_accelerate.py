"""accelerate trains the same loop with ``accelerator.prepare`` (torch's DDP) and with
``shardwise.integrations.accelerate.prepare`` (shardwise's), gradient accumulation through
``accelerator.accumulate``; per-step losses are equal, ``unwrap_model`` returns the bare module
and ``get_state_dict`` has its keys (no ``module.`` prefix) in both runs."""

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


def main(impl: str, out_dir: str) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    torch.manual_seed(0)
    bare = ResNet()
    optimizer = torch.optim.AdamW(bare.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(dataset(STEPS * ACCUMULATE), batch_size=BATCH)
    if impl == "torch":
        model, optimizer, loader = accelerator.prepare(bare, optimizer, loader)
    else:
        from shardwise.integrations.accelerate import prepare

        model, optimizer, loader = prepare(accelerator, bare, optimizer, loader)
    losses = []
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.detach())
    state = accelerator.get_state_dict(model)
    save(out_dir, impl, accelerator.process_index, {
        "losses": torch.stack(losses), "wrapper": type(model).__module__,
        "unwrapped": accelerator.unwrap_model(model) is bare,
        "keys": sorted(state) == sorted(bare.state_dict())})


@pytest.mark.slow
def test_accelerate_with_shardwise_prepare_matches_torch_ddp(tmp_path):
    pytest.importorskip("accelerate", reason="accelerate is not installed "
                        "(pip install 'shardwise[accelerate]')")
    from tests.integrations.launch import run_both

    runs = run_both("tests.integrations.test_accelerate", tmp_path)
    compare_losses(runs, STEPS * ACCUMULATE)
    for impl, wrapper in WRAPPERS.items():
        assert [r["wrapper"] for r in runs[impl]] == [wrapper] * 2
        assert all(r["unwrapped"] and r["keys"] for r in runs[impl]), impl


if __name__ == "__main__":
    main(*sys.argv[1:])
