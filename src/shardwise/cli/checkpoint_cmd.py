"""`shardwise checkpoint export DIR OUT.safetensors` and `shardwise checkpoint inspect DIR`.

DIR is a checkpoint (a directory with ``metadata.json``) or a training run's ``--checkpoint-dir``
(its ``latest`` checkpoint is used). Both read files only: no process group, no ranks.
``export`` streams the model's tensors into one safetensors file, one tensor in memory at a
time (``shardwise.checkpoint.export_safetensors``); ``inspect`` prints every tensor's name,
global shape, dtype and how it is sharded (each chunk's box and file), then the values.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

_VALUE_CHARS = 120  # a long value (a JSON record, param_groups) is cut to this in the listing


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    sub = parser.add_subparsers(dest="action", required=True)
    export = sub.add_parser("export", help="write the model as one safetensors file")
    export.add_argument("dir", help="a checkpoint, or a --checkpoint-dir (its latest)")
    export.add_argument("out", help="the .safetensors file to write")
    export.add_argument("--prefix", default="model.",
                        help="export the tensors under this prefix, without it")
    show = sub.add_parser("inspect", help="each tensor's shape, dtype and sharding")
    show.add_argument("dir", help="a checkpoint, or a --checkpoint-dir (its latest)")
    return parser


def run(args: argparse.Namespace) -> str:
    """What to print; CheckpointError or ValueError when the checkpoint cannot be read."""
    from shardwise.checkpoint import export_safetensors, inspect

    path = resolve(args.dir)
    if args.action == "export":
        names = export_safetensors(path, args.out, prefix=args.prefix)
        return f"wrote {len(names)} tensors of {path} to {args.out}"
    return describe(path, inspect(path))


def resolve(directory: str) -> Path:
    """A checkpoint directory as given, or the latest one of a training run's directory."""
    from shardwise.checkpoint import latest_checkpoint
    from shardwise.checkpoint.train_state import LATEST, METADATA

    path = Path(directory)  # lexists: a FIFO or link in either place is refused by its reader
    if not os.path.lexists(path / METADATA) and os.path.lexists(path / LATEST):
        return latest_checkpoint(path)
    return path


def describe(path: Path, info: dict[str, Any]) -> str:
    tensors = info["tensors"]
    lines = [f"checkpoint {path}: saved by {info['world_size']} rank(s), {len(tensors)} "
             f"tensors, {len(info['values'])} values"]
    width = max((len(n) for n in tensors), default=0)
    for name, t in tensors.items():
        shape = str(tuple(t["shape"]))
        lines.append(f"  {name:<{width}}  {shape:<14} {t['dtype']:<9} {sharding(t)}")
    for name, value in info["values"].items():
        text = json.dumps(value)
        if len(text) > _VALUE_CHARS:
            text = text[:_VALUE_CHARS - 3] + "..."
        lines.append(f"  {name} = {text}")
    return "\n".join(lines)


def sharding(tensor: dict[str, Any]) -> str:
    """``whole in rank_00000.bin`` or ``2 chunks on dim 0: [0:4] rank_00000.bin, ...``."""
    chunks = tensor["chunks"]
    if len(chunks) == 1 and list(chunks[0]["sizes"]) == list(tensor["shape"]):
        return f"whole in {chunks[0]['file']}"
    split = [d for d in range(len(tensor["shape"]))
             if len({c["offsets"][d] for c in chunks}) > 1]
    dims = ", ".join(map(str, split)) or "-"
    boxes = ", ".join(
        "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(c["offsets"], c["sizes"])) + "] "
        + c["file"] for c in chunks)
    return f"{len(chunks)} chunks on dim {dims}: {boxes}"


def main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from shardwise.checkpoint import CheckpointError

    try:
        print(run(args))
    except (CheckpointError, ValueError, OSError) as exc:
        parser.exit(2, f"shardwise checkpoint: error: {exc}\n")
    return 0
