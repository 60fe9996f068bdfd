"""A torchvision-style model module for the RPC data tests: nn.Module classes of a library the
workers import, neither registered nor allowed by name; instances travel as data."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)) + x)


class TinyResNet(nn.Module):
    def __init__(self, width: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, width, 3, padding=1)
        self.layers = nn.Sequential(Block(width), Block(width))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, classes)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


def make(seed: int) -> TinyResNet:
    gen = torch.Generator().manual_seed(seed)
    model = TinyResNet()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.rand(p.shape, generator=gen) - 0.5)
    return model.eval()
