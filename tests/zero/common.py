"""A tiny model with two param groups and a frozen layer, its reference, and per-rank data."""

from __future__ import annotations

import torch
from torch import nn

GLOBAL_BATCH = 8
RTOL = 1e-6
LR = 1e-2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 24)
        self.frozen = nn.Linear(24, 24)
        self.frozen.requires_grad_(False)
        self.mid = nn.Linear(24, 12)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.frozen(h))
        return self.head(torch.tanh(self.mid(h)))


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def param_groups(net: Net) -> list[dict]:
    """Two groups of different learning rates; the frozen layer is in the first."""
    body = [*net.inp.parameters(), *net.frozen.parameters(), *net.mid.parameters()]
    return [{"params": body}, {"params": list(net.head.parameters()), "lr": LR * 3}]


def optimizer_kwargs(name: str) -> tuple[type[torch.optim.Optimizer], dict]:
    return {
        "adamw": (torch.optim.AdamW, {"lr": LR, "weight_decay": 0.1}),
        "adam": (torch.optim.Adam, {"lr": LR}),
        "sgd": (torch.optim.SGD, {"lr": LR, "momentum": 0.9}),
        "adagrad": (torch.optim.Adagrad, {"lr": LR}),
    }[name]


def global_batch(step: int, micro: int = 1):
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(micro, GLOBAL_BATCH, 6, generator=gen)
    y = torch.randn(micro, GLOBAL_BATCH, 3, generator=gen)
    return x, y




def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def schedule(step: int) -> float:
    return 1.0 / (1 + step)


def assert_params_equal(model: nn.Module, reference: nn.Module, what: str) -> None:
    from tests.harness import assert_rel_close

    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert_rel_close(p, q, RTOL, f"{what}: {name}")
