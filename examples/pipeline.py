"""Pipeline parallelism with ``shardwise.pipeline``: one stage of the demo GPT per rank on a
1F1B schedule, from docs/pipeline.md.

Every rank builds the same GPT (same seed) and keeps its own stage of it; each step cuts the
batch into 8 micro-batches. The last stage gets one loss per micro-batch. Checks that the loss
on the (fixed) batch goes down and that the stage's step statistics were recorded.

    shardwise run --nproc 2 examples/pipeline.py
"""

import torch
import torch.distributed as dist

from shardwise.distributed import init
from shardwise.models import GPTConfig


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The same 8 sequences on every rank and every step (the first stage reads the inputs,
    the last the targets)."""
    config = GPTConfig()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (8, config.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    init()
    x, y = batch()
    history = []
    # block: pipeline
    import torch
    import torch.distributed as dist

    from shardwise.models import GPT, GPTConfig, lm_loss
    from shardwise.pipeline import PipelineStage, Schedule1F1B, split_gpt

    rank, pp = dist.get_rank(), dist.get_world_size()           # one stage per rank
    torch.manual_seed(0)
    module = split_gpt(GPT(GPTConfig()), pp)[rank]                # or split_points=["blocks.2"]
    stage = PipelineStage(module, rank, pp, group=dist.group.WORLD, transport="p2p",
                          measure_activations=True)        # the accounting below; off by default
    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=lm_loss)
    opt = torch.optim.AdamW(module.parameters())
    for _ in range(5):
        losses = []
        if stage.is_first:
            schedule.step(x)                                      # the whole batch
        elif stage.is_last:
            schedule.step(target=y, losses=losses)                # one loss per micro-batch
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()
        print(stage.stats)     # StepStats: step_s, busy_s, idle_fraction, peak_activation_bytes,
                               # formula_bubble
    # block: end
        history.append(torch.stack(losses).mean().item() if losses else None)
    check(history, stage.is_last, stage.stats)


def check(history: list, is_last: bool, stats) -> None:
    if stats.peak_activation_bytes is None or stats.step_s <= 0:
        raise SystemExit(f"no step statistics: {stats}")
    if is_last:
        print("last stage losses: " + " ".join(f"{v:.3f}" for v in history))
        if not history[-1] < history[0] - 0.1:
            raise SystemExit(f"loss did not go down: {history}")
        print(f"ok: loss {history[0]:.3f} -> {history[-1]:.3f} over "
              f"{dist.get_world_size()} pipeline stages")


if __name__ == "__main__":
    main()
