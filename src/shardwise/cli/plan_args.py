"""`shardwise plan`'s flags and their ranges (torch-free: ``--help`` imports no torch).
The planning itself is cli/plan.py."""

from __future__ import annotations

import argparse
import re

from shardwise.cli.ranges import LAYERS, float_arg, int_arg
from shardwise.memory.tables import OPTIMIZER_STATE, PRECISIONS
from shardwise.models.config import GPTConfig

UNITS = {"gib": (1024**3, "GiB"), "gb": (1e9, "GB")}
GPT_FLAGS = ("n_layer", "n_head", "d_model", "mlp_ratio", "vocab_size")
SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
# Plans are arithmetic, but the demo GPT is built on the meta device (a module per layer) and
# sizes multiply: each flag has a finite range, far beyond today's largest models.
MAX_PARAMS = 1e15
WORLD = int_arg(1, 2**24)
SIZE = int_arg(1, 2**24)
GPT_RANGES = {"n_layer": LAYERS, "n_head": SIZE, "d_model": int_arg(1, 2**20),
              "mlp_ratio": int_arg(1, 1024), "vocab_size": SIZE}
MEMORY_GIB = float_arg(0.0, 2.0**30, above=True)


def parameter_count(text: str) -> int:
    """``--params``: a number such as 7.5e9, 125000000 or 7.5B (K, M, B or T suffix)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of parameters (write it as 7.5e9, 7500000000 or 7.5B)")
    count = float(match.group(1)) * SUFFIXES.get(match.group(2).lower(), 1)
    if not 1 <= count <= MAX_PARAMS:
        bound = "at least 1" if count < 1 else f"at most {MAX_PARAMS:.0e}"
        raise argparse.ArgumentTypeError(
            f"the parameter count must be {bound}, got {text.strip()!r}")
    return int(round(count))


def degrees(text: str) -> tuple[int, ...]:
    """``--tp``: one degree or several, comma-separated."""
    try:
        return tuple(WORLD(v) for v in text.split(","))
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r:.40} is not a tensor-parallel degree or a comma-separated list of them "
            f"({exc})") from None


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add = parser.add_argument
    add("--nproc", type=WORLD, default=2, help="world size to plan for")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--params", type=parameter_count, default=None,
                        help="plan for a bare parameter count (7.5e9, 7.5B): model state only")
    source.add_argument("--hf-config", default=None,
                        help="plan for a Hugging Face causal LM's config.json (no weights)")
    for name in GPT_FLAGS:
        add("--" + name.replace("_", "-"), type=GPT_RANGES[name], default=None,
            help=f"demo GPT (default: {getattr(GPTConfig(), name)})")
    add("--tie-weights", action="store_true", help="demo GPT: head tied to the embedding")
    add("--seq-len", type=SIZE, default=None,
        help=f"tokens per sequence (default: the demo GPT's {GPTConfig().seq_len})")
    add("--batch-size", type=SIZE, default=None,
        help="sequences per data-parallel rank: adds the activation estimate")
    add("--activation-checkpointing", action="store_true",
        help="count activations as with every layer checkpointed")
    add("--precision", default="fp32", choices=PRECISIONS,
        help="mixed: 16-bit params and grads, fp32 master copy and optimizer state")
    add("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATE),
        help="whose state to count")
    add("--memory-gib", type=MEMORY_GIB, default=None,
        help="memory per rank in GiB: mark what fits, name the cheapest strategy that fits")
    add("--units", default="gib", choices=sorted(UNITS), help="GiB (2^30 bytes) or GB (10^9)")
    add("--tp", type=degrees, default=(1,),
        help="tensor-parallel degree(s), e.g. 2 or 2,4,8: add FSDP x TP (2D) layouts")
    add("--replicas", type=WORLD, default=1, help="replica groups: add the hybrid (HSDP) layout")
    add("--json", action="store_true", help="print a JSON record instead of the table")
    add("--simulate", action="store_true",
        help="dry-run the library's own code for each row on one rank of a fake group of "
             "--nproc ranks (no data moved); adds the simulated figures")
    add("--rank", type=int_arg(0, 2**24), default=0, help="--simulate: the rank to play")
    add("--strategy", default=None, choices=("ddp", "zero1", "zero2", "fsdp", "hsdp"),
        help="--simulate: dry-run this strategy's rows only (default: every row)")
    add("--zero-partition", default="parameters", choices=("parameters", "elements"),
        help="--simulate: ZeRO-1/2 give each rank whole parameters (torch's "
             "ZeroRedundancyOptimizer, the default) or equal element ranges (DeepSpeed's)")
    add("--reshard-to", type=WORLD, default=None, metavar="M",
        help="--simulate: also plan a checkpoint saved at --nproc ranks and loaded at M ranks "
             "(metadata size, chunks, files; the reads of --rank at M); no data written")
    return parser
