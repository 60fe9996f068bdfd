"""The small transformer and the data that the FSDP1 and FSDP2 compat programs share.

Dimensions are chosen to split unevenly over 2 and 4 ranks; ``reset_parameters`` serves
FSDP2's meta-device init; ``batch`` gives each rank its slice and the whole batch (for the
one-process reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, LAYERS, SEQ = 37, 24, 3, 8


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, 3 * DIM)
        self.w2 = nn.Linear(3 * DIM, DIM, bias=False)

    def forward(self, x):
        return x + self.w2(F.gelu(self.w1(self.norm(x))))

    def reset_parameters(self):
        self.norm.reset_parameters()
        self.w1.reset_parameters()
        self.w2.reset_parameters()


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        h = self.tok(idx)
        for layer in self.layers:
            h = layer(h)
        return self.out(self.norm(h))

    def reset_parameters(self):
        self.tok.reset_parameters()
        for layer in self.layers:
            layer.reset_parameters()
        self.norm.reset_parameters()
        self.out.reset_parameters()


def batch(step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (2 * world, SEQ + 1), generator=g)
    mine = x[2 * rank : 2 * rank + 2]
    return mine[:, :-1], mine[:, 1:], x[:, :-1], x[:, 1:]
