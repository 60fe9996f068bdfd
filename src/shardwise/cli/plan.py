"""`shardwise plan`: memory per rank of a model under each strategy, before anything runs.

The model is the demo GPT by shape (built on the meta device: no memory, no time), a bare
parameter count (``--params 7.5e9``) or a Hugging Face causal LM's ``config.json``
(``--hf-config``: shardwise/memory/hf_config.py reads its shapes, no weights). Model state
(parameters, gradients, optimizer state) comes from the pure functions of
shardwise/memory/estimate.py and layouts.py in the chosen ``--precision`` (fp32, bf16, or the
ZeRO paper's mixed precision: 2 + 2 + 12 bytes per parameter with Adam); ``--batch-size`` adds
the activation estimate of shardwise/memory/activations.py. FSDP is estimated with one unit per
transformer layer plus the root unit, as `shardwise train --strategy fsdp` wraps it; ``--tp``
(one or more degrees) and ``--replicas`` add the mesh layouts (see [Note: mesh state estimates]
in shardwise/memory/layouts.py). ``--simulate`` also runs the library's own code for each row
on one rank of a fake process group of ``--nproc`` ranks (shardwise/sim/: no data, no other
process) and reports that rank's state, peak of gathered units and communication per step.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.cli.plan_args import GPT_FLAGS, UNITS, build_parser, parameter_count
from shardwise.cli.strategy_tp import gpt_plan
from shardwise.memory.accounting import StateBytes
from shardwise.memory.activations import TransformerShape, activation_bytes
from shardwise.memory.estimate import (
    STRATEGIES,
    element_bytes,
    estimate_state_bytes,
)
from shardwise.memory.hf_config import HFConfigError, ModelSpec, load_hf_config
from shardwise.memory.layouts import MeshLayout, ParamSize, estimate_mesh_state_bytes
from shardwise.models import GPT, GPTConfig

# Ranked by communication per step, least first: DDP, ZeRO-1 and ZeRO-2 move about 2x the model
# per rank and step (all-reduce, or reduce-scatter + all-gather), HSDP adds its in-group
# all-gathers, FSDP gathers parameters twice and reduce-scatters once (about 3x), and tensor
# parallelism communicates activations in every layer on top.
COST_ORDER = ("ddp", "zero1", "zero2", "hsdp", "fsdp")


@dataclass(frozen=True)
class Row:
    name: str
    state: StateBytes
    activations: int | None
    mesh: tuple[int, int, int] | None = None

    @property
    def total(self) -> int:
        return self.state.total + (self.activations or 0)


def plan(args: argparse.Namespace) -> str:
    """The table (or JSON record) `shardwise plan` prints; ValueError names a bad input."""
    record = plan_record(args)
    return json.dumps(record, indent=2) if args.json else format_plan(record)


def plan_record(args: argparse.Namespace) -> dict:
    if args.nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {args.nproc}")
    spec = model_spec(args)
    layouts = _layouts(args, spec)
    rows = _rows(args, spec, layouts)
    fits = None
    if args.memory_gib is not None:
        if args.memory_gib <= 0:
            raise ValueError(f"--memory-gib must be positive, got {args.memory_gib}")
        fits = {r.name: r.total <= args.memory_gib * 1024**3 for r in rows}
    record = {
        "model": spec.description, "parameters": spec.n_params, "world_size": args.nproc,
        "precision": args.precision, "optimizer": args.optimizer,
        "bytes_per_parameter": dict(zip(("params", "grads", "optimizer"),
                                        element_bytes(args.precision, args.optimizer)[:3])),
        "batch_per_rank": args.batch_size, "seq_len": _seq_len(args, spec),
        "activation_checkpointing": args.activation_checkpointing,
        "activations": _activation_pair(args, spec), "units": UNITS[args.units][1],
        "memory_gib": args.memory_gib, "cheapest_fit": _cheapest(rows, fits),
        "rows": [{"strategy": r.name, "params": r.state.params, "grads": r.state.grads,
                  "optimizer": r.state.optimizer, "model_state": r.state.total,
                  "activations": r.activations, "total": r.total,
                  "mesh": list(r.mesh) if r.mesh else None,
                  "fits": None if fits is None else fits[r.name]} for r in rows],
    }
    if getattr(args, "simulate", False):
        _simulate(args, record)
    elif getattr(args, "reshard_to", None) is not None:
        raise ValueError("--reshard-to plans a checkpoint in the dry run: it needs --simulate")
    return record


def _simulate(args: argparse.Namespace, record: dict) -> None:
    """Add each row's ``"simulated"`` figures and the ``"simulation"`` cost (shardwise/sim)."""
    from shardwise.sim.models import demo_gpt, hf_model
    from shardwise.sim.report import dry_run_for, simulate_rows

    if args.params is not None:
        raise ValueError("--simulate needs the model's shapes (the demo GPT or --hf-config); "
                         "a bare --params count has none")
    if args.optimizer != "adamw":
        raise ValueError(f"--simulate steps AdamW; --optimizer {args.optimizer} is planned by "
                         "the formulas only")
    if not 0 <= args.rank < args.nproc:
        raise ValueError(f"--rank {args.rank} is outside a world of {args.nproc} ranks")
    if args.hf_config:
        def build():
            return hf_model(args.hf_config)
    else:
        cfg = _demo_config(args)

        def build():
            return demo_gpt(cfg)
    picked = [r["strategy"] for r in record["rows"] if args.strategy in (None, r["strategy"])
              or (args.strategy == "fsdp" and r["strategy"].startswith("fsdp x tp"))]
    if args.strategy == "hsdp" and args.replicas < 2:
        raise ValueError("--strategy hsdp needs --replicas R (at least 2 replica groups)")
    runs = [dry_run_for(r["strategy"], args.nproc, rank=args.rank, replicas=args.replicas,
                        precision=args.precision, tp_plan=None if args.hf_config else gpt_plan,
                        zero_partition=args.zero_partition)
            if r["strategy"] in picked else None
            for r in record["rows"]]
    reshard = None
    if args.reshard_to is not None:
        from shardwise.sim.checkpoint_plan import Reshard

        reshard = Reshard(args.reshard_to, args.rank)
    figures, cost = simulate_rows(build, runs, reshard=reshard)
    for row, sim in zip(record["rows"], figures):
        if reshard is not None:  # the checkpoint plan is the row's own object
            row["checkpoint"] = sim.pop("checkpoint") if sim is not None else None
        row["simulated"] = sim
    record["simulated_rank"] = args.rank
    record["simulation"] = cost


def format_plan(record: dict) -> str:
    scale = UNITS["gb" if record["units"] == "GB" else "gib"][0]
    per = record["bytes_per_parameter"]
    lines = [f"{record['model']}: {record['parameters'] / 1e6:,.1f}M parameters, "
             f"{record['optimizer']}, {record['precision']} ({per['params']} + {per['grads']} + "
             f"{per['optimizer']} bytes per parameter), world size {record['world_size']}"]
    acts = record["activations"]
    if acts is not None:
        lines.append(f"activations per rank (estimate), {record['batch_per_rank']} x "
                     f"{record['seq_len']} tokens: {_fmt(acts['without'] / scale)} "
                     f"{record['units']} without activation checkpointing, "
                     f"{_fmt(acts['with'] / scale)} with (counted: "
                     f"{'with' if record['activation_checkpointing'] else 'without'})")
    head = f"{'strategy':<14}{'params':>10}{'grads':>10}{'optimizer':>10}{'state':>10}"
    if acts is not None:
        head += f"{'activ.':>10}{'total':>10}"
    lines.append(f"{head}  ({record['units']} per rank; fsdp is ZeRO stage 3)")
    for row in record["rows"]:
        cells = [row["params"], row["grads"], row["optimizer"], row["model_state"]]
        if acts is not None:
            cells += [row["activations"], row["total"]]
        text = f"{row['strategy']:<14}" + "".join(f"{_fmt(c / scale):>10}" for c in cells)
        if row["fits"] is not None:
            text += "  fits" if row["fits"] else "  does not fit"
        if row["mesh"]:
            text += "  mesh: replicate {} x shard {} x tp {}".format(*row["mesh"])
        lines.append(text)
    if record["memory_gib"] is not None:
        best = record["cheapest_fit"]
        lines.append(f"cheapest strategy that fits in {record['memory_gib']:g} GiB per rank: "
                     + (best if best else "none") + " (ranked by communication per step: "
                     + ", ".join(COST_ORDER) + ", then tensor parallelism)")
    if "simulation" in record:
        from shardwise.sim.report import format_simulated

        lines += format_simulated(record, scale, record["units"])
    extra = "FSDP's gathered units" if acts is not None else "activations, FSDP's gathered units"
    lines.append(f"Not counted: {extra}, communication buckets, allocator caching.")
    return "\n".join(lines)


def _fmt(value: float) -> str:
    """Three significant digits, no exponent (120, 31.4, 16.6, 1.88, 0.469)."""
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}" if value >= 0.001 else f"{value:.1e}" if value else "0"


def model_spec(args: argparse.Namespace) -> ModelSpec:
    given = [n for n in GPT_FLAGS if getattr(args, n) is not None]
    if args.tie_weights:
        given.append("tie_weights")
    if (args.params is not None or args.hf_config) and given:
        flag = "--" + given[0].replace("_", "-")
        other = "--params" if args.params is not None else "--hf-config"
        raise ValueError(f"{flag} shapes the demo GPT; it cannot be combined with {other}")
    if args.params is not None:
        return ModelSpec("a parameter count", [[ParamSize(args.params,
                                                                           args.params)]], None)
    if args.hf_config:
        try:
            return load_hf_config(args.hf_config)
        except HFConfigError as exc:
            raise ValueError(f"--hf-config {exc}") from None
    cfg = _demo_config(args)
    with torch.device("meta"):
        model = GPT(cfg)
    shape = TransformerShape(cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_head,
                             cfg.mlp_ratio * cfg.d_model, cfg.vocab_size, "gelu", cfg.seq_len)
    return ModelSpec(f"demo GPT ({cfg.n_layer} layers, d_model {cfg.d_model})",
                     tp_units(model), shape)


def _demo_config(args: argparse.Namespace) -> GPTConfig:
    values = {n: getattr(args, n) for n in GPT_FLAGS if getattr(args, n) is not None}
    if args.seq_len is not None:
        values["seq_len"] = args.seq_len
    return GPTConfig(**values, tie_weights=args.tie_weights)


def _seq_len(args: argparse.Namespace, spec: ModelSpec) -> int:
    return args.seq_len if args.seq_len is not None else GPTConfig().seq_len


def _activation_pair(args: argparse.Namespace, spec: ModelSpec, tp: int = 1) -> dict | None:
    if args.batch_size is None:
        return None
    if spec.shape is None:
        raise ValueError("--batch-size needs the model's shape (the demo GPT or --hf-config); "
                         "a bare --params count has none")
    elem = 4 if args.precision == "fp32" else 2
    seq = _seq_len(args, spec)
    return {key: activation_bytes(spec.shape, args.batch_size, seq, elem_bytes=elem,
                                  checkpointing=ckpt, tp=tp)
            for key, ckpt in (("without", False), ("with", True))}


def _activations(args: argparse.Namespace, spec: ModelSpec, tp: int = 1) -> int | None:
    pair = _activation_pair(args, spec, tp)
    if pair is None:
        return None
    return pair["with" if args.activation_checkpointing else "without"]


def _rows(args: argparse.Namespace, spec: ModelSpec,
          layouts: list[tuple[str, MeshLayout]]) -> list[Row]:
    sizes = [p.numel for unit in spec.units for p in unit]
    units = [[p.numel for p in unit] for unit in spec.units]
    acts = _activations(args, spec)
    rows = []
    for strategy in STRATEGIES:
        est = estimate_state_bytes(sizes, strategy, args.nproc, optimizer=args.optimizer,
                                   units=units if strategy == "fsdp" else None,
                                   precision=args.precision)
        rows.append(Row(strategy, est, acts))
    for name, layout in layouts:
        est = estimate_mesh_state_bytes(spec.units, layout, optimizer=args.optimizer,
                                        precision=args.precision)
        rows.append(Row(name, est, _activations(args, spec, layout.tp), layout.shape))
    return rows


def _cheapest(rows: list[Row], fits: dict[str, bool] | None) -> str | None:
    if fits is None:
        return None
    rank = {name: i for i, name in enumerate(COST_ORDER)}
    fitting = [r.name for r in rows if fits[r.name]]
    fitting.sort(key=lambda name: (rank.get(name, len(rank)), name))
    return fitting[0] if fitting else None


def _layouts(args: argparse.Namespace, spec: ModelSpec) -> list[tuple[str, MeshLayout]]:
    """The mesh layouts that --tp and --replicas ask for (validated before any row is made)."""
    for flag, value in [("--replicas", args.replicas)] + [("--tp", t) for t in args.tp]:
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    heads = spec.shape.n_head if spec.shape else None
    for tp in args.tp:
        if tp > 1 and heads is not None and heads % tp:
            raise ValueError(f"--tp {tp} must divide n_head ({heads}): every tensor-"
                             "parallel rank holds whole attention heads")
        if tp > 1 and spec.shape is not None and spec.shape.kv_heads % tp:
            raise ValueError(f"--tp {tp} must divide the key/value heads "
                             f"({spec.shape.kv_heads})")
        if tp > 1 and args.tie_weights:
            raise ValueError("--tp: tied embedding and head weights cannot be split")
    wanted = []
    if args.replicas > 1:
        wanted.append(("hsdp", MeshLayout(args.nproc, replicas=args.replicas)))
    for tp in (t for t in dict.fromkeys(args.tp) if t > 1):
        wanted.append((f"fsdp x tp{tp}", MeshLayout(args.nproc, tp=tp)))
        if args.replicas > 1:
            wanted.append((f"hsdp x tp{tp}",
                           MeshLayout(args.nproc, tp=tp, replicas=args.replicas)))
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
    root = [p for p in model.parameters() if id(p) not in in_blocks]  # a tied weight once
    return [sizes(b.parameters()) for b in model.blocks] + [sizes(root)]


__all__ = ["build_parser", "parameter_count", "plan", "plan_record", "tp_units"]
