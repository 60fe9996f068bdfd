"""`shardwise plan`: model-state memory per rank of the demo GPT under each strategy.

The model is built on the meta device (no memory, no time), so sizes far beyond this machine can
be planned. FSDP is estimated with one unit per transformer block plus the root unit, as
`shardwise train --strategy fsdp` wraps it. ``--tp`` and ``--replicas`` add the mesh layouts
(see [Note: mesh state estimates] in shardwise/memory/layouts.py): FSDP x TP (2D: FSDP over
``nproc / tp`` ranks, tensor parallelism over ``tp``, split as `--strategy tp` splits the demo
GPT), HSDP (FSDP within groups of ``nproc / replicas`` ranks, replicated across ``replicas``),
and both at once.
"""

from __future__ import annotations

import argparse
import fnmatch
from dataclasses import fields

import torch
from torch import nn

from shardwise.cli.strategy_tp import gpt_plan
from shardwise.memory.accounting import StateBytes
from shardwise.memory.estimate import (
    OPTIMIZER_STATE,
    STRATEGIES,
    estimate_state_bytes,
    parameter_sizes,
)
from shardwise.memory.layouts import MeshLayout, ParamSize, estimate_mesh_state_bytes
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
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks: add the FSDP x TP (2D) layout")
    parser.add_argument("--replicas", type=int, default=1,
                        help="replica groups: add the hybrid (HSDP) layout")
    return parser


def plan(args: argparse.Namespace) -> str:
    if args.nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {args.nproc}")
    layouts = _layouts(args)
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
        lines.append(_row(strategy, est, args.memory_gib))
    if layouts:
        mesh_units = tp_units(model)
        for name, layout in layouts:
            est = estimate_mesh_state_bytes(mesh_units, layout, optimizer=args.optimizer)
            replicas, shard, tp = layout.shape
            lines.append(_row(name, est, args.memory_gib)
                         + f"  mesh: replicate {replicas} x shard {shard} x tp {tp}")
    lines.append("Activations, gathered FSDP units and communication buckets come on top.")
    return "\n".join(lines)


def _row(name: str, est: StateBytes, memory_gib: float | None) -> str:
    row = (f"{name:<10}{est.params / GIB:>12.3f}{est.grads / GIB:>12.3f}"
           f"{est.optimizer / GIB:>12.3f}{est.total / GIB:>12.3f}")
    if memory_gib is not None:
        row += "  fits" if est.total / GIB <= memory_gib else "  does not fit"
    return row


def _layouts(args: argparse.Namespace) -> list[tuple[str, MeshLayout]]:
    """The mesh layouts that --tp and --replicas ask for (validated before any model exists)."""
    for flag, value in (("--tp", args.tp), ("--replicas", args.replicas)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if args.tp > 1 and args.n_head % args.tp:
        raise ValueError(f"--tp {args.tp} must divide n_head ({args.n_head}): every tensor-"
                         "parallel rank holds whole attention heads")
    if args.tp > 1 and args.tie_weights:
        raise ValueError("--tp: tied embedding and head weights cannot be split")
    wanted = []
    if args.replicas > 1:
        wanted.append(("hsdp", MeshLayout(args.nproc, replicas=args.replicas)))
    if args.tp > 1:
        wanted.append(("fsdp x tp", MeshLayout(args.nproc, tp=args.tp)))
    if args.tp > 1 and args.replicas > 1:
        wanted.append(("hsdp x tp", MeshLayout(args.nproc, tp=args.tp, replicas=args.replicas)))
    return wanted


def tp_units(model: nn.Module) -> list[list[ParamSize]]:
    """The FSDP units (one per block, then the root) as ``ParamSize`` lists, each parameter
    marked with the dimension that `--strategy tp`'s plan splits (a column-wise Linear's bias
    is split with its weight)."""
    plan_specs, _ = gpt_plan(1)  # only the split dimensions are read, not the placements
    split: dict[int, int] = {}  # id(parameter) -> length of its split dimension
    for name, module in model.named_modules():
        spec = next((s for pat, s in plan_specs.items() if fnmatch.fnmatchcase(name, pat)), None)
        if spec is None:
            continue
        split[id(module.weight)] = module.weight.shape[spec.dim]
        if isinstance(module, nn.Linear) and module.bias is not None and spec.dim == 0:
            split[id(module.bias)] = module.bias.shape[0]

    def sizes(params) -> list[ParamSize]:
        return [ParamSize(p.numel(), split.get(id(p))) for p in params if p.requires_grad]

    in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
    root = [p for p in model.parameters() if id(p) not in in_blocks]
    return [sizes(b.parameters()) for b in model.blocks] + [sizes(root)]
