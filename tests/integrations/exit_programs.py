"""Programs whose interpreter exit tests/integrations/test_clean_exit.py times. Each prints
``END <CPU seconds used so far>`` as its last line (flushed) and then ends without any cleanup
call: what keeps the interpreter alive after that line is what the test looks for.

``python tests/integrations/exit_programs.py KIND``; KIND ``torch`` (import torch and
torch.distributed only: the baseline), ``import`` (import shardwise and its subpackages),
``ddp`` (2 ranks: 10 AdamW steps with shardwise.DistributedDataParallel, started with a
launcher's variables), ``accelerate`` (2 ranks: accelerate's own DDP with shardwise imported,
the run behind the report of a held exit).
"""

from __future__ import annotations

import sys


def _torch() -> None:
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401


def _import() -> None:
    import shardwise  # noqa: F401
    import shardwise.checkpoint  # noqa: F401
    import shardwise.distributed  # noqa: F401
    import shardwise.fsdp  # noqa: F401
    import shardwise.rpc  # noqa: F401


def _train(model, steps: int = 10):
    import torch

    rank = torch.distributed.get_rank()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(4, 8, generator=g)
        loss = (model(x) - x[:, :1]).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _ddp() -> None:
    import torch
    import torch.distributed as dist

    import shardwise

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    _train(shardwise.DistributedDataParallel(model))


def _accelerate() -> None:
    import torch
    from accelerate import Accelerator

    import shardwise  # noqa: F401

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    _train(accelerator.prepare(model))


if __name__ == "__main__":
    import time

    {"torch": _torch, "import": _import, "ddp": _ddp, "accelerate": _accelerate}[sys.argv[1]]()
    print("END", time.process_time(), flush=True)
