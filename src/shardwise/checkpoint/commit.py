"""Making a checkpoint visible: the metadata written last, then one atomic rename.

Every rank, once its data file is written and fsynced, writes a small JSON part file (its chunk
records) into ``<id>.tmp``. Rank 0 assembles the part files into ``metadata.json``, fsyncs it and
the directory, and renames ``<id>.tmp`` to ``<id>``. Until that rename nothing named ``<id>``
exists (or the previous checkpoint of that name is still whole), so a crash at any earlier
moment leaves nothing that ``load`` accepts. Part files are exchanged through the directory, not
a collective, so the asynchronous save can commit from a background thread.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from shardwise.checkpoint.atomic import create_exclusive
from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.format import FORMAT, METADATA, VERSION, fsync_dir, tmp_dir
from shardwise.checkpoint.plan import SavePlan
from shardwise.checkpoint.safe_open import open_regular
from shardwise.checkpoint.validate import DIGEST, digest_of


def part_file(tmp: Path, rank: int) -> Path:
    return tmp / f".part_{rank:05d}.json"


def write_json(path: Path, obj: Any) -> None:
    """A new file (created exclusively, never through a link), fsynced."""
    with create_exclusive(path, text=True) as f:
        json.dump(obj, f, allow_nan=True)
        f.flush()
        os.fsync(f.fileno())


def write_part(tmp: Path, plan: SavePlan, file_name: str, records: list[dict]) -> None:
    """Written under another name and renamed, so that rank 0, polling, never reads half of
    it."""
    size = (tmp / file_name).stat().st_size
    final = part_file(tmp, plan.rank)
    partial = final.with_name(final.name + ".partial")
    write_json(partial, {"token": plan.token, "file": file_name, "size": size,
                         "chunks": records})
    os.rename(partial, final)


def failure_file(tmp: Path, rank: int) -> Path:
    return tmp / f".failed_{rank:05d}.json"


def write_failure(tmp: Path, plan: SavePlan, error: BaseException) -> None:
    """A rank whose background save failed says so in ``<id>.tmp``, so that the ranks waiting
    for its part file (rank 0) or for rank 0's commit (the others) fail at once instead of
    waiting out their timeout. Best effort: the directory may be gone or the disk full."""
    try:
        path = failure_file(tmp, plan.rank)
        partial = path.with_name(path.name + ".partial")
        with create_exclusive(partial, text=True) as f:
            f.write(json.dumps({"token": plan.token,
                                "error": f"{type(error).__name__}: {error}"}))
        os.rename(partial, path)
    except OSError:
        pass


def check_failures(tmp: Path, plan: SavePlan) -> None:
    """Raise if any rank recorded a failure of this save (see ``write_failure``). ``tmp`` may
    be renamed away by rank 0's commit while this lists it: then no failure was recorded."""
    try:
        recorded = sorted(tmp.glob(".failed_*.json"))
    except FileNotFoundError:
        return
    for path in recorded:
        try:
            failed = _read_json(path)
        except (OSError, ValueError, CheckpointError):
            continue
        if failed.get("token") == plan.token:
            rank = int(path.stem.split("_")[1])
            raise CheckpointError(f"save into {tmp} failed on rank {rank}: {failed['error']}")


def wait_for_parts(tmp: Path, plan: SavePlan, timeout_s: float) -> list[dict]:
    """Rank 0: every rank's part file of this save (polling until ``timeout_s``; a failure
    recorded by a rank is raised at once)."""
    deadline = time.monotonic() + timeout_s
    parts: dict[int, dict] = {}
    while len(parts) < plan.world:
        check_failures(tmp, plan)
        for r in range(plan.world):
            if r not in parts and part_file(tmp, r).is_file():
                part = _read_json(part_file(tmp, r))
                if part["token"] == plan.token:
                    parts[r] = part
        if len(parts) < plan.world:
            if time.monotonic() > deadline:
                missing = sorted(set(range(plan.world)) - set(parts))
                raise CheckpointError(f"save into {tmp}: ranks {missing} did not finish "
                                      f"writing within {timeout_s:g} s")
            time.sleep(0.01)
    return [parts[r] for r in range(plan.world)]


def commit(tmp: Path, final: Path, plan: SavePlan, parts: list[dict], fault: Any = None
           ) -> dict[str, Any]:
    """Rank 0: write the metadata, then rename ``tmp`` to ``final`` (replacing an older
    checkpoint of that name only after the new one is complete)."""
    meta = build_metadata(plan, parts)
    write_json(tmp / METADATA, meta)
    for r in range(plan.world):
        part_file(tmp, r).unlink(missing_ok=True)
    fsync_dir(tmp)
    if fault is not None:
        fault("metadata", 0)
    old = None
    if final.exists():
        old = final.with_name(f"{final.name}.old-{plan.token}")
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return meta


def build_metadata(plan: SavePlan, parts: list[dict]) -> dict[str, Any]:
    tensors = {k: {"shape": v["shape"], "dtype": v["dtype"], "chunks": []}
               for k, v in plan.tensors.items()}
    for part in parts:
        for rec in part["chunks"]:
            entry = {k: v for k, v in rec.items() if k != "name"}
            tensors[rec["name"]]["chunks"].append(entry)
    meta = {"format": FORMAT, "version": VERSION, "token": plan.token,
            "world_size": plan.world, "files": {p["file"]: p["size"] for p in parts},
            "tensors": tensors, "values": plan.values, "paths": plan.paths}
    meta[DIGEST] = digest_of(meta)
    return meta


def wait_for_final(final: Path, plan: SavePlan, timeout_s: float) -> None:
    """Ranks other than 0 (async save): wait until rank 0 renamed this save into place (a
    failure recorded by any rank is raised at once)."""
    deadline = time.monotonic() + timeout_s
    meta_file = final / METADATA
    token = plan.token
    while True:
        check_failures(tmp_dir(final), plan)
        try:
            if _read_json(meta_file).get("token") == token:
                return
        except (OSError, ValueError, CheckpointError):
            pass
        if time.monotonic() > deadline:
            raise CheckpointError(f"async save: {final} was not committed by rank 0 within "
                                  f"{timeout_s:g} s")
        time.sleep(0.02)


def _read_json(path: Path) -> Any:
    """A record a save left (a part, a failure, the committed metadata), read as every
    checkpoint file is ([Note: opening checkpoint files] in safe_open.py: nothing in its place
    can block the reader)."""
    with open_regular(path, "checkpoint record") as f:
        return json.loads(f.read())
