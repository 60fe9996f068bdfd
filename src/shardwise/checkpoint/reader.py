"""Reading the part of a stored chunk that a requested box needs, block by block.

The rows of the stored chunk that overlap the request are read one checksummed block at a time
(``block_rows`` rows, about ``BLOCK_BYTES``) into one reused buffer: seek, read, check the
block's CRC-32, copy the overlapping sub-box into the destination. Nothing else of the file is
read, and no more than one block is held beyond the destination tensors.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint import boxes
from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.format import dtype_from
from shardwise.checkpoint.safe_open import open_regular
from shardwise.sharded_tensor.metadata import intersect


def open_data_file(path: Path):
    """A data file opened for reading: a regular file, reached without a link and opened without
    blocking ([Note: opening checkpoint files] in safe_open.py; the validator checked it too,
    and this closes the window between its check and the open)."""
    try:
        return open_regular(path, "checkpoint data file")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint data file {path} is missing") from None


def blocks_to_read(rec: dict, want: boxes.Box) -> tuple[boxes.Box | None, range]:
    """The overlap of the stored chunk ``rec`` and the requested box ``want``, and the blocks
    of ``rec`` that hold it (an empty range: nothing of ``rec`` is needed). Pure: the load's
    read plan, which ``copy_overlap`` follows and a dry run counts."""
    have = (tuple(rec["offsets"]), tuple(rec["sizes"]))
    if not have[1]:  # 0-dim: one element, one block
        return ((), ()), (range(1) if not want[1] else range(0))
    inter = intersect(have, want)
    if inter is None:
        return None, range(0)
    lo = inter[0][0] - have[0][0]
    hi = lo + inter[1][0]
    k = rec["block_rows"]
    return inter, range(lo // k, (hi - 1) // k + 1)


def block_bytes(rec: dict, itemsize: int, b: int) -> int:
    """Bytes of block ``b`` of the stored chunk ``rec`` (what reading it costs)."""
    n_rows, row_numel = boxes.rows_and_row_numel(rec["sizes"])
    k = rec["block_rows"]
    return min(k, n_rows - b * k) * row_numel * itemsize


class BlockReader:
    """Open files of one checkpoint and one read buffer, reused across chunks."""

    def __init__(self, root: Path):
        self.root = root
        self.files: dict[str, Any] = {}
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()

    def _file(self, name: str):
        if name not in self.files:
            self.files[name] = open_data_file(self.root / name)
        return self.files[name]

    def _buf(self, nbytes: int) -> torch.Tensor:
        if self.buffer.numel() < nbytes:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self.buffer[:nbytes]

    def copy_overlap(self, name: str, dtype: str, rec: dict, want: boxes.Box,
                     dest: torch.Tensor) -> None:
        """Copy the overlap of the stored chunk ``rec`` and the box ``want`` into ``dest`` (the
        tensor holding exactly ``want``)."""
        have = (tuple(rec["offsets"]), tuple(rec["sizes"]))
        inter, blocks = blocks_to_read(rec, want)
        if not blocks:
            return
        if not have[1]:  # 0-dim: one element
            dest.copy_(self._block(name, dtype, rec, 0).reshape(()))
            return
        lo = inter[0][0] - have[0][0]
        hi = lo + inter[1][0]
        k = rec["block_rows"]
        for b in blocks:
            rows = self._block(name, dtype, rec, b)
            r0, r1 = max(lo, b * k), min(hi, b * k + rows.shape[0])
            src = [slice(r0 - b * k, r1 - b * k)]
            dst = [slice(r0 + have[0][0] - want[0][0], r1 + have[0][0] - want[0][0])]
            for d in range(1, len(have[1])):
                s = inter[0][d] - have[0][d]
                t = inter[0][d] - want[0][d]
                src.append(slice(s, s + inter[1][d]))
                dst.append(slice(t, t + inter[1][d]))
            dest[tuple(dst)].copy_(rows[tuple(src)])

    def _block(self, name: str, dtype: str, rec: dict, b: int) -> torch.Tensor:
        """Block ``b`` of chunk ``rec``, read and checked, viewed as rows of the chunk."""
        dt = dtype_from(dtype)
        sizes = rec["sizes"]
        n_rows, row_numel = boxes.rows_and_row_numel(sizes)
        k = rec["block_rows"]
        rows = min(k, n_rows - b * k)
        row_bytes = row_numel * dt.itemsize
        nbytes = rows * row_bytes
        crcs = rec["crc32"]
        if b >= len(crcs) or rec["nbytes"] != n_rows * row_bytes:
            raise CheckpointError(f"checkpoint file {rec['file']}, tensor {name}: the metadata's "
                                  "chunk record is inconsistent (sizes, bytes, checksums)")
        f = self._file(rec["file"])
        f.seek(rec["byte_offset"] + b * k * row_bytes)
        buf = self._buf(nbytes)
        got = f.readinto(buf.numpy()) if nbytes else 0
        if got != nbytes:
            raise CheckpointError(f"checkpoint file {self.root / rec['file']} is truncated: "
                                  f"tensor {name} needs {nbytes} bytes at offset "
                                  f"{rec['byte_offset'] + b * k * row_bytes}, got {got}")
        if zlib.crc32(buf.numpy()) != crcs[b]:
            raise CheckpointError(f"checkpoint file {self.root / rec['file']} is corrupt: "
                                  f"tensor {name}, chunk at {rec['offsets']}, block {b} fails "
                                  "its CRC-32 check")
        shape = (rows, *sizes[1:]) if sizes else (1,)
        return buf.view(dt).view(shape)
