"""A pass over a pickle's opcodes before it is unpickled: refuses what the C unpickler would
turn into unbounded work.

[Note: pickle scan] The restricted unpickler (serialization.py) decides which globals a pickle
may name, but CPython's unpickler sizes its memo by the index a ``PUT`` / ``LONG_BINPUT`` opcode
names: four bytes claiming index 800,000,000 make it allocate and zero gigabytes. Python's own
pickler at protocol 4 and above memoizes with ``MEMOIZE`` (no index), so a message never holds
those opcodes; this pass walks the opcodes (argument lengths from ``pickletools``' table) and
refuses ``PUT``, ``BINPUT``, ``LONG_BINPUT``, persistent ids and a first opcode that is not
``PROTO`` 4 or 5. It reads each opcode's argument length only, so it costs a few microseconds
for a call's pickle (tensors travel out of band and are not scanned).
"""

from __future__ import annotations

import pickle
import pickletools

_REFUSED = {b"p"[0]: "PUT", b"q"[0]: "BINPUT", b"r"[0]: "LONG_BINPUT", b"P"[0]: "PERSID",
            b"Q"[0]: "BINPERSID"}
_STOP = b"."[0]
_LINES = {b"c"[0]: 2, b"i"[0]: 2}  # GLOBAL / INST: module and name lines

# opcode byte -> fixed argument bytes (>= 0), or -1 (to a newline), or -(width of the length
# prefix + 1) for length-prefixed arguments (pickletools' convention, mapped to widths)
_PREFIX = {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: 4,
           pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8}


def _table() -> list[int | None]:
    """256 entries: None (invalid opcode), n >= 0 (fixed argument bytes), -1 / -2 (one / two
    newline-ended lines), -10 - w (a w-byte little-endian length, then that many bytes)."""
    table: list[int | None] = [None] * 256
    for op in pickletools.opcodes:
        code = op.code.encode("latin-1")[0]
        arg = op.arg
        if arg is None:
            table[code] = 0
        elif arg.n >= 0:
            table[code] = arg.n
        elif arg.n == pickletools.UP_TO_NEWLINE:
            table[code] = -_LINES.get(code, 1)
        else:
            table[code] = -10 - _PREFIX[arg.n]
    for code in _REFUSED:
        table[code] = -100
    table[_STOP] = -200
    return table


_TABLE = _table()


def check(data: bytes | bytearray | memoryview) -> None:
    """Raise ``pickle.UnpicklingError`` unless ``data`` is a protocol 4/5 pickle without memo
    indexes or persistent ids ([Note: pickle scan])."""
    if not isinstance(data, (bytes, bytearray)):
        data = bytes(data)
    end = len(data)
    if end < 2 or data[0] != 0x80 or data[1] not in (4, 5):
        raise pickle.UnpicklingError("RPC payload is not a protocol 4 or 5 pickle")
    at, table, from_bytes = 2, _TABLE, int.from_bytes
    while at < end:
        code = data[at]
        n = table[code]
        at += 1
        if n is None:
            raise pickle.UnpicklingError(f"invalid pickle opcode {code:#x} at byte {at - 1}")
        if n >= 0:
            at += n
        elif n <= -100:
            if n == -200:
                return
            raise pickle.UnpicklingError(f"pickle opcode {_REFUSED[code]} at byte {at - 1} is "
                                         "not accepted in RPC messages (the pickler never "
                                         "makes it at protocol 4 or 5)")
        elif n <= -10:
            width = -10 - n
            at += width + from_bytes(data[at:at + width], "little")
        else:
            for _ in range(-n):
                nl = data.find(b"\n", at, at + 4096)
                if nl < 0:
                    raise pickle.UnpicklingError(f"unterminated pickle argument at byte {at}")
                at = nl + 1
    raise pickle.UnpicklingError("pickle data was truncated (no STOP opcode)")
