"""Writing one rank's chunks into its data file: raw bytes, a CRC-32 per block, then fsync.

No pickle and no header: the bytes of each chunk (row-major, the tensor's own dtype) follow one
another, and the records returned (byte offset, length, box, block CRCs) go into the metadata.
A chunk is read out block by block (``BLOCK_BYTES``), so a chunk on an accelerator is copied to
the CPU one block at a time and a non-contiguous one is made contiguous once.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint import boxes
from shardwise.checkpoint.atomic import create_exclusive
from shardwise.checkpoint.format import BLOCK_BYTES
from shardwise.checkpoint.plan import WriteItem


def block_rows(sizes, itemsize: int) -> int:
    """Rows of dim 0 per checksummed block (at least one row)."""
    _, row_numel = boxes.rows_and_row_numel(sizes)
    return max(1, BLOCK_BYTES // max(1, row_numel * itemsize))


def write_file(path: Path, items: list[WriteItem], fault: Any = None) -> list[dict[str, Any]]:
    """Write ``items`` to ``path``, fsync it, and return one record per chunk. ``fault``: a
    test hook called as ``fault("chunk", index)`` after each chunk."""
    records = []
    with create_exclusive(path) as f:
        for i, item in enumerate(items):
            records.append(_write_chunk(f, item, path.name))
            if fault is not None:
                fault("chunk", i)
        f.flush()
        os.fsync(f.fileno())
    return records


def block_starts(sizes, itemsize: int) -> range:
    """The first row of each checksummed block of a chunk of ``sizes`` (none when it is
    empty): one CRC-32 each in its record."""
    rows, row_numel = boxes.rows_and_row_numel(sizes)
    return range(0, rows if rows * row_numel else 0, block_rows(sizes, itemsize))


def chunk_record(name: str, file_name: str, start: int, offsets, sizes, itemsize: int,
                 crcs: list[int]) -> dict[str, Any]:
    """The metadata's record of one chunk written at byte ``start`` of ``file_name``."""
    return {"name": name, "file": file_name, "byte_offset": start,
            "nbytes": boxes.numel(sizes) * itemsize, "offsets": list(offsets),
            "sizes": list(sizes), "block_rows": block_rows(sizes, itemsize), "crc32": crcs}


def _write_chunk(f, item: WriteItem, file_name: str) -> dict[str, Any]:
    t = item.chunk.tensor.detach()
    sizes = tuple(t.shape)
    k = block_rows(sizes, t.element_size())
    flat = t.reshape(1) if t.dim() == 0 else t
    start, crcs = f.tell(), []
    for r in block_starts(sizes, t.element_size()):
        block = flat[r : r + k].contiguous()
        if block.device.type != "cpu":
            block = block.cpu()
        data = block.reshape(-1).view(torch.uint8).numpy()
        crcs.append(zlib.crc32(data))
        f.write(data)
    record = chunk_record(item.name, file_name, start, item.chunk.offsets, sizes,
                          t.element_size(), crcs)
    if record["nbytes"] != f.tell() - start:
        raise OSError(f"{file_name}: wrote {f.tell() - start} bytes of {item.name}, expected "
                      f"{record['nbytes']}")
    return record
