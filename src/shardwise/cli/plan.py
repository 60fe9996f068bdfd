"""`shardwise plan`: model-state memory per rank of the demo GPT under each strategy.

The model is built on the meta device (no memory, no time), so sizes far beyond this machine can
be planned. FSDP is estimated with one unit per transformer block plus the root unit, as
`shardwise train --strategy fsdp` wraps it.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

import torch

from shardwise.memory.estimate import (
    OPTIMIZER_STATE,
    STRATEGIES,
    estimate_state_bytes,
    parameter_sizes,
)
from shardwise.models import GPT, GPTConfig

GIB = 1024**3


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = GPTConfig()
    parser.add_argument("--nproc", type=int, default=2, help="world size to plan for")
    for f in fields(GPTConfig):
        if f.type in ("int", int) and f.name != "vocab_size":
            parser.add_argument("--" + f.name.replace("_", "-"), type=int,
                                default=getattr(d, f.name))
    parser.add_argument("--vocab-size", type=int, default=d.vocab_size)
    parser.add_argument("--tie-weights", action="store_true")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATE))
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="memory per rank: mark which strategies fit")
    return parser


def plan(args: argparse.Namespace) -> str:
    if args.nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {args.nproc}")
    names = {f.name for f in fields(GPTConfig)}
    cfg = GPTConfig(**{k: v for k, v in vars(args).items() if k in names})
    with torch.device("meta"):
        model = GPT(cfg)
    sizes = parameter_sizes(model)
    units = [parameter_sizes(b) for b in model.blocks]
    units.append([sum(sizes) - sum(map(sum, units))])  # the root unit: embeddings, ln_f, head
    lines = [f"demo GPT: {sum(sizes) / 1e6:,.1f}M parameters ({cfg.n_layer} layers, d_model "
             f"{cfg.d_model}), {args.optimizer}, fp32, world size {args.nproc}",
             f"{'strategy':<10}{'params':>12}{'grads':>12}{'optimizer':>12}{'total':>12}"
             f"  (GiB per rank, model state only)"]
    for strategy in STRATEGIES:
        est = estimate_state_bytes(sizes, strategy, args.nproc, optimizer=args.optimizer,
                                   units=units if strategy == "fsdp" else None)
        row = (f"{strategy:<10}{est.params / GIB:>12.3f}{est.grads / GIB:>12.3f}"
               f"{est.optimizer / GIB:>12.3f}{est.total / GIB:>12.3f}")
        if args.memory_gib is not None:
            row += "  fits" if est.total / GIB <= args.memory_gib else "  does not fit"
        lines.append(row)
    lines.append("Activations, gathered FSDP units and communication buckets come on top.")
    return "\n".join(lines)
