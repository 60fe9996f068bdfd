"""``export_safetensors`` and ``inspect``: a checkpoint consolidated into one safetensors file,
and a description of what a checkpoint holds. Both read files only (no process group).

The safetensors format (https://huggingface.co/docs/safetensors) is an 8-byte little-endian
header length, a JSON header (``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``,
offsets relative to the end of the header), then the tensors' bytes back to back. Since every
shape and dtype is known from the checkpoint's metadata, the header is written first and then
each tensor is assembled from its chunks and written in turn: one tensor in memory at a time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint import boxes
from shardwise.checkpoint.atomic import create_exclusive, temp_name
from shardwise.checkpoint.format import dtype_from
from shardwise.checkpoint.reader import BlockReader
from shardwise.checkpoint.validate import read_metadata

_ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
              "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
              "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
              "complex64": "C64"}


def inspect(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """``{"world_size", "tensors": {name: {"shape", "dtype", "chunks": [{"file", "offsets",
    "sizes", "byte_offset", "nbytes"}]}}, "values": {name: value}}`` of a complete checkpoint."""
    meta = read_metadata(checkpoint_dir)
    keep = ("file", "offsets", "sizes", "byte_offset", "nbytes")
    tensors = {name: {"shape": tuple(t["shape"]), "dtype": t["dtype"],
                      "chunks": [{k: c[k] for k in keep} for c in t["chunks"]]}
               for name, t in meta["tensors"].items()}
    return {"world_size": meta["world_size"], "tensors": tensors, "values": meta["values"]}


def export_safetensors(checkpoint_dir: str | os.PathLike, out_file: str | os.PathLike,
                       prefix: str = "model.") -> list[str]:
    """Write the tensors whose names start with ``prefix`` (the prefix removed) into the
    safetensors file ``out_file`` (written to a new file ``<out_file>.tmp-<random>``, created
    exclusively, then renamed). Every block read is checked against its CRC-32, and the
    metadata was validated first (validate.py): each tensor is tiled exactly by its chunks, so
    none is written from missing data. Returns the names written.
    With ``get_state_dict``'s ``{"model": ..., "optim": ...}`` layout the result
    loads into the unwrapped model with ``load_state_dict(strict=True)``."""
    root = Path(checkpoint_dir)
    meta = read_metadata(root)
    chosen = sorted(n for n in meta["tensors"] if n.startswith(prefix))
    if not chosen:
        raise ValueError(f"checkpoint {root} has no tensor whose name starts with {prefix!r}")
    header, at = {}, 0
    for name in chosen:
        t = meta["tensors"][name]
        if t["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{name}: dtype {t['dtype']} has no safetensors equivalent")
        size = boxes.numel(t["shape"]) * dtype_from(t["dtype"]).itemsize
        header[name[len(prefix):]] = {"dtype": _ST_DTYPES[t["dtype"]], "shape": t["shape"],
                                      "data_offsets": [at, at + size]}
        at += size
    out = Path(out_file)
    tmp = temp_name(out)
    reader = BlockReader(root)
    try:
        with create_exclusive(tmp) as f:
            _write_header(f, header)
            for name in chosen:
                f.write(_assemble(reader, name, meta["tensors"][name]).reshape(-1)
                        .view(torch.uint8).numpy())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        reader.close()
        tmp.unlink(missing_ok=True)
    return [n[len(prefix):] for n in chosen]


def _write_header(f, header: dict) -> None:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    f.write(len(text).to_bytes(8, "little"))
    f.write(text)


def _assemble(reader: BlockReader, name: str, entry: dict) -> torch.Tensor:
    shape = tuple(entry["shape"])
    full = torch.empty(shape, dtype=dtype_from(entry["dtype"]))
    want = ((0,) * len(shape), shape)
    with torch.no_grad():
        for rec in entry["chunks"]:
            reader.copy_overlap(name, entry["dtype"], rec, want, full)
    return full
