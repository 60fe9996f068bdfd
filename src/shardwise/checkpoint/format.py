"""The on-disk format of a sharded checkpoint (see docs/checkpoint.md).

    <id>/metadata.json        written last, by rank 0: every tensor's global shape, dtype and
                              chunks, every non-tensor value, every data file's size
    <id>/rank_00000.bin       raw little-endian tensor bytes, chunk after chunk, no header

A chunk record names its file, byte offset and length, its box in the global tensor
(``offsets``, ``sizes``, row-major bytes), and a CRC-32 per block of ``block_rows`` rows along
dim 0 (blocks of about ``BLOCK_BYTES``), so a reader that needs only some rows verifies exactly
the blocks it reads. While being written the directory is ``<id>.tmp``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from shardwise.checkpoint.errors import CheckpointError
from shardwise.distributed.env import EnvError, int_var

FORMAT = "shardwise-checkpoint"
VERSION = 2  # 2: the metadata carries its digest (validate.py)
METADATA = "metadata.json"
BLOCK_BYTES = 8 * 1024 * 1024
TMP_SUFFIX = ".tmp"
# A reader refuses a metadata.json larger than this before parsing it (docs/checkpoint.md,
# "Validation"); the environment variable sets another bound.
MAX_METADATA_BYTES = 64 * 1024 * 1024
MAX_METADATA_VAR = "SHARDWISE_CHECKPOINT_MAX_METADATA_BYTES"

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    torch.float8_e4m3fn, torch.float8_e5m2)}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype} cannot be stored in a checkpoint")
    return name


def dtype_from(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise CheckpointError(f"checkpoint metadata names an unknown dtype {name!r}")
    return _DTYPES[name]


def max_metadata_bytes() -> int:
    """The bound on ``metadata.json``'s size: ``$SHARDWISE_CHECKPOINT_MAX_METADATA_BYTES`` when
    set, else ``MAX_METADATA_BYTES``."""
    try:
        return int_var(MAX_METADATA_VAR, MAX_METADATA_BYTES, minimum=1)
    except EnvError as err:
        raise CheckpointError(str(err)) from None


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.bin"


def tmp_dir(final: Path) -> Path:
    return final.with_name(final.name + TMP_SUFFIX)


def checkpoint_dir(checkpoint_id: str | os.PathLike | None) -> Path:
    if checkpoint_id is None:
        raise TypeError("checkpoint_id (the checkpoint directory) is required")
    return Path(checkpoint_id)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
