"""Cutting a model into pipeline stages: by module names or by a balanced cost.

A model is first listed as an ordered run of named layers whose composition is the model's
forward (``gpt_layers`` for the demo GPT, ``sequential_layers`` for an ``nn.Sequential``); a
split then cuts that run into contiguous stages. The cut positions are small pure functions
(``cuts_from_points``, ``balanced_cuts``), tested without processes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

Layers = list[tuple[str, nn.Module]]


class Embed(nn.Module):
    """The GPT's token and position embeddings, as one layer."""

    def __init__(self, gpt: nn.Module):
        super().__init__()
        self.tok_emb, self.pos_emb = gpt.tok_emb, gpt.pos_emb

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))


class Head(nn.Module):
    """The GPT's final layer norm and LM head, as one layer."""

    def __init__(self, gpt: nn.Module):
        super().__init__()
        self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


class Stage(nn.Module):
    """A run of consecutive layers, applied in order; ``layer_names`` says which."""

    def __init__(self, layers: Layers):
        super().__init__()
        self.layer_names = [name for name, _ in layers]
        self.layers = nn.Sequential(*(m for _, m in layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def gpt_layers(gpt: nn.Module) -> Layers:
    """The demo GPT as ``[embed, blocks.0, ..., blocks.N-1, head]``.

    ``embed`` holds ``tok_emb`` and ``pos_emb``; ``head`` holds ``ln_f`` and ``head``; split
    points may also name those inner modules (``tok_emb``, ``ln_f``).
    """
    return [("embed", Embed(gpt)),
            *((f"blocks.{i}", b) for i, b in enumerate(gpt.blocks)),
            ("head", Head(gpt))]


def sequential_layers(model: nn.Sequential) -> Layers:
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"sequential_layers needs an nn.Sequential, got {type(model).__name__}")
    return list(model.named_children())


def layers_of(model: nn.Module) -> Layers:
    """``gpt_layers`` for a model with the GPT's layout, ``sequential_layers`` for a
    Sequential; anything else must be listed by the caller."""
    if isinstance(model, nn.Sequential):
        return sequential_layers(model)
    if all(hasattr(model, a) for a in ("tok_emb", "pos_emb", "blocks", "ln_f", "head")):
        return gpt_layers(model)
    raise TypeError(f"cannot list the layers of a {type(model).__name__}: pass an nn.Sequential, "
                    "the demo GPT, or a list of (name, module) pairs")


_ALIASES = {"tok_emb": "embed", "pos_emb": "embed", "ln_f": "head"}


def cuts_from_points(names: Sequence[str], split_points: Sequence[str]) -> list[int]:
    """Layer indices where stages start (``[0, ..., len(names)]``) from the names of the
    layers that begin each stage after the first."""
    index = {n: i for i, n in enumerate(names)}
    cuts = [0]
    for point in split_points:
        key = point if point in index else _ALIASES.get(point, point)
        if key not in index:
            raise ValueError(f"split point {point!r} names no layer; layers are {list(names)}")
        i = index[key]
        if i <= cuts[-1]:
            raise ValueError(f"split point {point!r} (layer {i}) must come after the previous "
                             f"cut (layer {cuts[-1]}) and leave no stage empty")
        cuts.append(i)
    return cuts + [len(names)]


def balanced_cuts(costs: Sequence[float], stages: int) -> list[int]:
    """Contiguous cut of ``costs`` into ``stages`` non-empty runs minimising the largest run's
    total (exact dynamic programme; ties keep earlier stages lighter). ``[0, ..., len]``."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # best[k][i]: first i layers, k stages
    arg = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], arg[k][i] = value, j
    cuts, i = [n], n
    for k in range(stages, 0, -1):
        i = arg[k][i]
        cuts.append(i)
    return cuts[::-1]


def parameter_costs(layers: Layers) -> list[float]:
    """Parameter elements per layer (a weight shared by two layers counts in the first)."""
    seen: set[int] = set()
    costs = []
    for _, module in layers:
        fresh = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        costs.append(float(sum(p.numel() for p in fresh)))
    return costs


@torch.no_grad()
def time_costs(layers: Layers, sample: torch.Tensor, repeats: int = 3) -> list[float]:
    """Measured forward seconds per layer on ``sample`` (the median of ``repeats`` runs, after
    one warm-up), each layer fed the previous layer's output."""
    costs = []
    x = sample
    for _, module in layers:
        module(x)
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            y = module(x)
            runs.append(time.perf_counter() - start)
        costs.append(sorted(runs)[len(runs) // 2])
        x = y
    return costs


def split_layers(layers: Layers, num_stages: int | None = None, *,
                 split_points: Sequence[str] | None = None, cost: str = "params",
                 sample: torch.Tensor | None = None) -> list[Stage]:
    """Cut ``layers`` into stages: at ``split_points`` (names of the layers that start stages
    1, 2, ...), or into ``num_stages`` stages balanced by ``cost`` (``"params"``: parameter
    elements; ``"time"``: measured forward time on ``sample``)."""
    names = [n for n, _ in layers]
    if split_points is not None:
        cuts = cuts_from_points(names, split_points)
        if num_stages is not None and len(cuts) - 1 != num_stages:
            raise ValueError(f"{len(split_points)} split points make {len(cuts) - 1} stages, "
                             f"not {num_stages}")
    elif num_stages is None:
        raise TypeError("split_layers needs num_stages or split_points")
    else:
        cuts = balanced_cuts(_costs(layers, cost, sample), num_stages)
    stages = [Stage(layers[a:b]) for a, b in zip(cuts, cuts[1:])]
    _owners(stages)  # stages must not share parameters
    return stages


def _costs(layers: Layers, cost: str, sample: torch.Tensor | None) -> list[float]:
    if cost == "params":
        return parameter_costs(layers)
    if cost == "time":
        if sample is None:
            raise ValueError("cost='time' needs a sample input to time the layers on")
        return time_costs(layers, sample)
    raise ValueError(f"unknown cost {cost!r}; use 'params' or 'time'")


def split_gpt(gpt: nn.Module, num_stages: int | None = None, *,
              split_points: Sequence[str] | None = None, cost: str = "params",
              sample: torch.Tensor | None = None) -> list[Stage]:
    """The demo GPT cut into stages (see ``split_layers``); the stages share the GPT's
    parameters (no copy)."""
    layers = gpt_layers(gpt)
    if num_stages is not None and split_points is None and num_stages > len(layers):
        raise ValueError(f"a pipeline of {num_stages} stages needs at least {num_stages - 2} "
                         f"blocks, the model has {len(gpt.blocks)}")
    return split_layers(layers, num_stages, split_points=split_points, cost=cost, sample=sample)


def split_by_names(model: nn.Module, stage_names: Sequence[Sequence[str]]) -> list[Stage]:
    """Stages made of the named submodules of ``model``, in the order given. Every parameter of
    ``model`` must belong to exactly one stage: a split that leaves one out (or puts one in two
    stages) is a ValueError naming the parameters."""
    modules = dict(model.named_modules())
    stages = []
    for names in stage_names:
        missing = [n for n in names if n not in modules]
        if missing:
            raise ValueError(f"no submodule named {missing} in {type(model).__name__}")
        stages.append(Stage([(n, modules[n]) for n in names]))
    _check_cover(model, stages)
    return stages


def _check_cover(model: nn.Module, stages: list[Stage]) -> None:
    owner = _owners(stages)
    left = [n for n, p in model.named_parameters() if id(p) not in owner]
    if left:
        raise ValueError(f"the split does not cover the model: no stage holds {left}")


def _owners(stages: list[Stage]) -> dict[int, int]:
    """The stage of every parameter (by id); ValueError when two stages share one."""
    owner: dict[int, int] = {}
    for k, stage in enumerate(stages):
        for p in stage.parameters():
            if owner.setdefault(id(p), k) != k:
                raise ValueError(f"stages {owner[id(p)]} and {k} share a parameter (tied "
                                 "weights?): put the layers that use it in one stage")
    return owner
