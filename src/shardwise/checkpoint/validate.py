"""Reading a checkpoint's metadata and checking it as a whole, before anything else is read or
allocated. Every reader (``load`` and so resharding and ``--resume``, ``inspect``,
``export_safetensors``, ``read_meta``) starts here. [Note: checkpoint validation]

[Note: checkpoint validation]
The metadata says where every byte goes, so a reader that trusted it could be made to read
outside the checkpoint, fill a tensor twice or not at all, or allocate what the disk does not
hold. Before anything is read beyond ``metadata.json`` (docs/checkpoint.md, "Validation"):

1. The step directory is not a symbolic link (lstat); ``metadata.json`` is a regular file,
   opened without following a link and without blocking ([Note: opening checkpoint files]
   in safe_open.py), of at most ``format.max_metadata_bytes()`` bytes by ``fstat``, before
   it is read or parsed.
2. The digest: ``"sha256:<hex>"`` over the canonical JSON of the metadata without it
   (``sort_keys``, no spaces, ``allow_nan``); a mismatch is accidental damage, named.
3. The schema: every key present with its type and range (ints are never bools; sizes,
   offsets and byte counts >= 0; a known dtype; no unknown keys).
4. Every data file name is a plain name (letters, digits, ``._-``, not starting with a dot):
   no separator, no ``..``, no absolute path, no NUL.
5. Every declared file exists in the step directory as a regular file (not a link) of exactly
   its declared size.
6. ``paths`` names exactly the stored keys, each path spelling its key.
7. Every chunk: ``nbytes`` equals its box's elements times the dtype's size, one CRC per
   block of ``block_rows`` rows, and its bytes lie inside its file's declared size; no two
   chunks share a byte of a file. So the tensors together hold no more bytes than the files.
8. Every tensor's chunk boxes lie inside its shape and tile it exactly (``boxes.check_cover``,
   O(n log n) in the number of chunks: [Note: exact tiling by corner counts] in tiling.py).

Only then does a reader allocate (at most what the files hold, by 5 and 7) and read; data
files are opened as the metadata is (safe_open.py, from reader.py). The digest catches damage,
not an attacker: one who can rewrite the metadata can also rewrite the data and its CRCs, and
so choose the values loaded, but never where they are read from or how much is allocated.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

from shardwise.checkpoint import boxes
from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.format import (
    FORMAT,
    MAX_METADATA_VAR,
    METADATA,
    VERSION,
    dtype_from,
    max_metadata_bytes,
    tmp_dir,
)
from shardwise.checkpoint.safe_open import describe, read_bounded

DIGEST = "digest"
_TOP = {"format", "version", "token", "world_size", "files", "tensors", "values", "paths",
        DIGEST}
_CHUNK = {"file", "byte_offset", "nbytes", "offsets", "sizes", "block_rows", "crc32"}
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}")
_DIGEST_TEXT = re.compile(r"sha256:[0-9a-f]{64}")


class _Invalid(Exception):
    """One problem found, as ``where: what``; raised as a CheckpointError naming the file."""


def digest_of(meta: dict[str, Any]) -> str:
    """The digest stored in ``meta[DIGEST]``: sha256 of the canonical JSON of the rest."""
    body = {k: v for k, v in meta.items() if k != DIGEST}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The checked metadata of the complete checkpoint at ``path`` (see the Note); a
    CheckpointError naming the problem otherwise. Reads only ``metadata.json`` and stats the
    data files."""
    root = Path(path)
    _check_root(root)
    meta_file = root / METADATA
    meta = _load_json(meta_file)
    try:
        check(meta, root)
    except _Invalid as err:
        raise CheckpointError(f"checkpoint metadata {meta_file} is invalid: {err}") from None
    return meta


def _check_root(root: Path) -> None:
    try:
        mode = os.lstat(root).st_mode
    except FileNotFoundError:
        if tmp_dir(root).exists():
            raise CheckpointError(f"checkpoint {root} is incomplete: a save did not finish "
                                  f"(only {tmp_dir(root)} exists)") from None
        raise CheckpointError(f"no checkpoint at {root} (no such directory)") from None
    if stat.S_ISLNK(mode):
        raise CheckpointError(f"checkpoint {root} is a symbolic link (to {os.readlink(root)}); "
                              "a checkpoint must be a real directory, not a link to another")
    if not stat.S_ISDIR(mode):
        raise CheckpointError(f"no checkpoint at {root} (not a directory)")


def _load_json(meta_file: Path) -> Any:
    try:  # the size bound is checked (fstat) before anything is read or parsed
        raw = read_bounded(meta_file, max_metadata_bytes(), "checkpoint metadata",
                           f" (the environment variable {MAX_METADATA_VAR} sets another)")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {meta_file.parent} is incomplete or not a sharded "
                              f"checkpoint: it has no {METADATA}") from None
    try:
        meta = json.loads(raw)
    except RecursionError:
        raise CheckpointError(f"checkpoint metadata {meta_file} is damaged or unreadable: "
                              "its JSON is nested too deeply") from None
    except ValueError as err:  # bad JSON or UTF-8, an int literal of too many digits
        raise CheckpointError(f"checkpoint metadata {meta_file} is damaged or unreadable: "
                              f"{err}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_file} is not a {FORMAT} metadata file")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{meta_file} has format version {_show(meta.get('version'))}; this "
                              f"shardwise reads version {VERSION}")
    return meta


def check(meta: dict[str, Any], root: Path) -> None:
    """Rules 2 to 8 of the Note (3 as each part is reached); raises ``_Invalid``."""
    _check_digest(meta)
    _keys(meta, _TOP, "the metadata")
    _str(meta["token"], "'token'")
    _int(meta["world_size"], "'world_size'", low=1)
    files = _files(meta["files"])
    tensors = _obj(meta["tensors"], "'tensors'")
    _obj(meta["values"], "'values'")
    _paths(meta["paths"], {*tensors, *meta["values"]})
    _on_disk(root, files, tensors)
    spans: dict[str, list[tuple[int, int, str, str]]] = {name: [] for name in files}
    for name, entry in tensors.items():
        _tensor(name, entry, files, spans)
    _no_shared_bytes(spans)


def _check_digest(meta: dict[str, Any]) -> None:
    if DIGEST not in meta:
        raise _Invalid(f"no {DIGEST!r} key (every checkpoint of version {VERSION} has one)")
    stored = meta[DIGEST]
    if not isinstance(stored, str) or not _DIGEST_TEXT.fullmatch(stored):
        raise _Invalid(f"{DIGEST!r}: expected 'sha256:' and 64 hex digits, got {_show(stored)}")
    if stored != digest_of(meta):
        raise _Invalid("the metadata is damaged: its digest does not match its contents")


def _files(value: Any) -> dict[str, int]:
    files = _obj(value, "'files'")
    for name, size in files.items():
        _plain(name, f"files[{_show(name)}]")
        _int(size, f"files[{_show(name)}]")
    return files


def _tensor(name: str, entry: Any, files: dict[str, int], spans: dict) -> None:
    where = f"tensors[{_show(name)}]"
    _keys(_obj(entry, where), {"shape", "dtype", "chunks"}, where)
    shape = _ints(entry["shape"], f"{where}.shape")
    if not isinstance(entry["dtype"], str):
        raise _Invalid(f"{where}.dtype: expected a string, got {_show(entry['dtype'])}")
    try:
        itemsize = dtype_from(entry["dtype"]).itemsize
    except CheckpointError:
        raise _Invalid(f"{where}.dtype: unknown dtype {_show(entry['dtype'])}") from None
    chunks = entry["chunks"]
    if not isinstance(chunks, list):
        raise _Invalid(f"{where}.chunks: expected a list, got {type(chunks).__name__}")
    found = []
    for i, rec in enumerate(chunks):
        found.append(_chunk(rec, (name, f"{where}.chunks[{i}]"), len(shape), itemsize, files,
                            spans))
    try:
        boxes.check_cover(name, shape, found)
    except ValueError as err:
        raise _Invalid(f"{where}: {err}") from None


def _chunk(rec: Any, named: tuple[str, str], ndim: int, itemsize: int, files: dict[str, int],
           spans: dict) -> boxes.Box:
    name, where = named
    _keys(_obj(rec, where), _CHUNK, where)
    file = _plain(rec["file"], f"{where}.file")
    if file not in files:
        raise _Invalid(f"{where}.file: {_show(file)} is not among the metadata's files")
    offsets = _ints(rec["offsets"], f"{where}.offsets", ndim)
    sizes = _ints(rec["sizes"], f"{where}.sizes", ndim)
    start = _int(rec["byte_offset"], f"{where}.byte_offset")
    nbytes = _int(rec["nbytes"], f"{where}.nbytes")
    k = _int(rec["block_rows"], f"{where}.block_rows", low=1)
    need = boxes.numel(sizes) * itemsize
    if nbytes != need:
        raise _Invalid(f"{where}.nbytes: {nbytes}, but its sizes {sizes} hold {need} bytes")
    if start + nbytes > files[file]:
        raise _Invalid(f"{where} needs bytes {start}..{start + nbytes} of {file}, which has "
                       f"{files[file]} bytes")
    _crcs(rec["crc32"], where, sizes, k)
    if nbytes:
        spans[file].append((start, start + nbytes, where, name))
    return tuple(offsets), tuple(sizes)


def _crcs(value: Any, where: str, sizes: list[int], k: int) -> None:
    rows, _ = boxes.rows_and_row_numel(sizes)
    want = math.ceil(rows / k) if boxes.numel(sizes) else 0
    if not isinstance(value, list) or len(value) != want:
        got = len(value) if isinstance(value, list) else type(value).__name__
        raise _Invalid(f"{where}.crc32: expected a list of {want} checksums (one per "
                       f"{k} rows), got {got}")
    for i, crc in enumerate(value):
        if not isinstance(crc, int) or isinstance(crc, bool) or not 0 <= crc < 2 ** 32:
            raise _Invalid(f"{where}.crc32[{i}]: expected an int in [0, 2**32), got {_show(crc)}")


def _no_shared_bytes(spans: dict[str, list[tuple[int, int, str, str]]]) -> None:
    for file, ranges in spans.items():
        ranges.sort()
        for (_, end, a, _), (start, _, b, _) in zip(ranges, ranges[1:]):
            if start < end:
                raise _Invalid(f"{a} and {b} share bytes {start}..{end} of {file}")


def _on_disk(root: Path, files: dict[str, int], tensors: dict) -> None:
    for name, size in files.items():
        path = root / name
        held = _holder(tensors, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise _Invalid(f"data file {path} (holding {held}) is missing") from None
        if not stat.S_ISREG(st.st_mode):
            raise _Invalid(f"data file {path} is {describe(path)}, not a regular file; data "
                           "files must be regular files inside the checkpoint")
        if st.st_size != size:
            raise _Invalid(f"checkpoint file {path} (holding tensor {held}) is truncated or "
                           f"damaged: it has {st.st_size} bytes on disk, the metadata declares "
                           f"{size}")


def _paths(value: Any, keys: set[str]) -> None:
    """Every stored key has a path (flatten.step) that spells it."""
    paths = _obj(value, "'paths'")
    if set(paths) != keys:
        odd = sorted(set(paths) ^ keys)[:5]
        raise _Invalid(f"'paths': its keys are not the stored tensors and values ({odd})")
    for key, path in paths.items():
        if not isinstance(path, list) or not path or not all(map(_step_ok, path)):
            raise _Invalid(f"paths[{_show(key)}]: expected a list of keys and indices, got "
                           f"{_show(path)}")
        spelled = ".".join(str(s[0] if isinstance(s, list) else s) for s in path)
        if spelled != key:
            raise _Invalid(f"paths[{_show(key)}]: {_show(path)} spells {_show(spelled)}")


def _step_ok(s: Any) -> bool:
    if isinstance(s, list):
        return len(s) == 1 and isinstance(s[0], int) and not isinstance(s[0], bool)
    return isinstance(s, str) or (isinstance(s, int) and not isinstance(s, bool) and s >= 0)


def _holder(tensors: dict, file: str) -> str:
    """The first tensor with a chunk in ``file`` (for messages; the schema is not checked yet)."""
    for name, entry in tensors.items():
        chunks = entry.get("chunks") if isinstance(entry, dict) else None
        if isinstance(chunks, list) and any(
                isinstance(c, dict) and c.get("file") == file for c in chunks):
            return name
    return "no tensor"


def _keys(obj: dict, allowed: set[str], where: str) -> None:
    missing = sorted(allowed - {*obj})
    if missing:
        raise _Invalid(f"{where} has no {_show(missing[0])} key")
    unknown = sorted({*obj} - allowed, key=str)
    if unknown:
        raise _Invalid(f"{where} has an unknown key {_show(unknown[0])}")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _obj(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise _Invalid(f"{where}: expected an object, got {type(value).__name__}")
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"{where}: expected a string, got {_show(value)}")
    return value


def _int(value: Any, where: str, low: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise _Invalid(f"{where}: expected an int >= {low}, got {_show(value)}")
    return value


def _ints(value: Any, where: str, n: int | None = None) -> list[int]:
    if not isinstance(value, list) or (n is not None and len(value) != n):
        want = "a list" if n is None else f"a list of {n} ints"
        raise _Invalid(f"{where}: expected {want}, got {_show(value)}")
    return [_int(v, f"{where}[{i}]") for i, v in enumerate(value)]


def _plain(name: Any, where: str) -> str:
    _str(name, where)
    if not _PLAIN_NAME.fullmatch(name):
        raise _Invalid(f"{where}: {_show(name)} is not a plain file name inside the checkpoint "
                       "(letters, digits, '._-'; no separator, '..' or absolute path)")
    return name
