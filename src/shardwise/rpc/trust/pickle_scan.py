"""A pass over a pickle's opcodes before it is unpickled: refuses what the C unpickler would
turn into unbounded work or into a change of something that existed before the message.

[Note: pickle scan] The restricted unpickler (serialization.py) decides which globals a pickle
may name; this pass decides what the pickle may *do* with them, before the C unpickler runs:

* Memo indexes. CPython's unpickler sizes its memo by the index a ``PUT`` / ``LONG_BINPUT``
  opcode names: four bytes claiming index 800,000,000 make it allocate and zero gigabytes.
  Python's own pickler at protocol 4 and above memoizes with ``MEMOIZE`` (no index), so a
  message never holds those opcodes. Persistent ids, ``INST`` / ``OBJ`` (protocol 0/1 object
  creation), the copyreg extension opcodes ``EXT*`` and the text ``GET`` are refused too: the
  pickler never makes them at protocol 4 or 5.
* ``BUILD``. The C unpickler applies a ``BUILD`` state to whatever is on its stack: a function
  (``__defaults__``, ``__kwdefaults__``), a class, a memoized global. So when a pickle holds
  ``BUILD``, ``NEWOBJ`` or ``NEWOBJ_EX``, a second, slower walk follows what each stack slot
  holds (a global, an instance made in this pickle by ``NEWOBJ`` / ``NEWOBJ_EX`` / ``REDUCE``
  of a global, a dict and whether its keys are plain attribute names, anything else), through
  ``MEMOIZE`` / ``BINGET``. A ``BUILD`` is accepted only on an instance made in this pickle,
  once, with a dict state or a ``(dict or None, dict)`` state whose keys are plain attribute
  names (no ``__dunder__``); the walk returns which class each instance came from, and the
  unpickler then checks that class ([Note: data classes] in pickle_rules.py). The walk also
  records the globals used only as ``NEWOBJ``'s class: only those may resolve to a data-only
  class (an ``nn.Module`` subclass the worker imported), which is thus never called (no
  ``__init__``), passed as a value or returned.
* Depth. The C unpickler builds nested containers without recursion, but whatever touches the
  result afterwards (pickling a reply, ``repr``, user code) recurses. Nesting needs one
  container per level, so the fast walk counts container-making opcodes; only a pickle with
  more of them than the depth bound has its result measured (``pickle_rules.check_depth``).

The fast walk reads each opcode's argument length only (from ``pickletools``' table), so it
costs a few microseconds for a call's pickle; tensors travel out of band and are not scanned.
"""

from __future__ import annotations

import pickle
import pickletools
from dataclasses import dataclass
from typing import Any

_REFUSED = {b"p"[0]: "PUT", b"q"[0]: "BINPUT", b"r"[0]: "LONG_BINPUT", b"P"[0]: "PERSID",
            b"Q"[0]: "BINPERSID", b"i"[0]: "INST", b"o"[0]: "OBJ", b"g"[0]: "GET",
            0x82: "EXT1", 0x83: "EXT2", 0x84: "EXT4"}
_STOP = b"."[0]
_TRACKED = (b"b"[0], 0x81, 0x92)  # BUILD, NEWOBJ, NEWOBJ_EX: the slow walk follows
_CONTAINERS = (b"]"[0], b"}"[0], b")"[0], 0x8f, 0x85, 0x86, 0x87, b"t"[0], b"l"[0], b"d"[0],
               0x91, b"R"[0])  # opcodes that make an object holding others
_LINES = {b"c"[0]: 2}  # GLOBAL: module and name lines

# table codes below 0 that are not argument lengths
_REFUSE, _END, _TRACK, _CONTAINER = -100, -200, -300, -400
_PREFIX = {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: 4,
           pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8}


class UnsafePickle(pickle.UnpicklingError):
    """A pickle that would change an existing object or rebuild something that is not data."""


def _table() -> list[int | None]:
    """256 entries: None (invalid opcode), n >= 0 (fixed argument bytes), -1 / -2 (one / two
    newline-ended lines), -10 - w (a w-byte little-endian length, then that many bytes), or one
    of the special codes above (all for opcodes without an argument)."""
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
    for code in _CONTAINERS:
        table[code] = _CONTAINER
    for code in _TRACKED:
        table[code] = _TRACK
    for code in _REFUSED:
        table[code] = _REFUSE
    table[_STOP] = _END
    return table


_TABLE = _table()


@dataclass(frozen=True)
class Scan:
    """What a pickle does that the unpickler's checks need: ``containers``, the number of
    container-making opcodes (a bound on its nesting depth); ``builds``, one ``(module,
    qualname), how`` per ``BUILD`` (``how``: ``"new"`` for ``NEWOBJ`` / ``NEWOBJ_EX``,
    ``"call"`` for ``REDUCE``; the state shape is checked here); ``new_only``, the globals used
    only as ``NEWOBJ``'s class."""

    containers: int = 0
    builds: tuple[tuple[tuple[str, str], str], ...] = ()
    new_only: frozenset[tuple[str, str]] = frozenset()


_PLAIN = tuple(Scan(n) for n in range(1024))  # (no object made per message)


def check(data: bytes | bytearray | memoryview) -> Scan:
    """Raise ``pickle.UnpicklingError`` unless ``data`` is a protocol 4/5 pickle without memo
    indexes, persistent ids or ``BUILD`` on anything but a fresh instance ([Note: pickle
    scan]); returns what the unpickler must still check."""
    if not isinstance(data, (bytes, bytearray)):
        data = bytes(data)
    end = len(data)
    if end < 2 or data[0] != 0x80 or data[1] not in (4, 5):
        raise pickle.UnpicklingError("RPC payload is not a protocol 4 or 5 pickle")
    at, table, from_bytes = 2, _TABLE, int.from_bytes
    containers, tracked = 0, False
    while at < end:
        code = data[at]
        n = table[code]
        at += 1
        if n is None:
            raise pickle.UnpicklingError(f"invalid pickle opcode {code:#x} at byte {at - 1}")
        if n >= 0:
            at += n
        elif n <= _REFUSE:
            if n == _CONTAINER:
                containers += 1
            elif n == _TRACK:  # (NEWOBJ makes an object holding others: counted too)
                tracked = True
                containers += 1
            elif n == _END:
                if not tracked:
                    return _PLAIN[containers] if containers < 1024 else Scan(containers)
                return _walk(data, containers)
            else:
                raise pickle.UnpicklingError(
                    f"pickle opcode {_REFUSED[code]} at byte {at - 1} is not accepted in RPC "
                    "messages (the pickler never makes it at protocol 4 or 5)")
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


# ---------------------------------------------------------------------------- the slow walk
class _Global:
    """A global on the stack: ``name`` is ``(module, qualname)``, None when not literal."""

    __slots__ = ("name",)

    def __init__(self, name: tuple[str, str] | None) -> None:
        self.name = name


class _Instance:
    """What ``NEWOBJ`` / ``REDUCE`` of a global made in this pickle."""

    __slots__ = ("name", "how", "built")

    def __init__(self, name: tuple[str, str] | None, how: str) -> None:
        self.name, self.how, self.built = name, how, False


class _Dict:
    """A dict made in this pickle; ``plain``: every key so far is a plain attribute name."""

    __slots__ = ("plain",)

    def __init__(self) -> None:
        self.plain = True


class _Tuple:
    __slots__ = ("items",)

    def __init__(self, items: list) -> None:
        self.items = items


_MARK, _NONE, _VALUE = object(), object(), object()
_LEAVES = frozenset({
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT",
    "NEWTRUE", "NEWFALSE", "STRING", "BINSTRING", "SHORT_BINSTRING", "BINBYTES",
    "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8", "NEXT_BUFFER", "EMPTY_LIST", "EMPTY_SET"})
_TEXT = frozenset({"UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"})
_TO_MARK = frozenset({"APPENDS", "ADDITEMS", "POP_MARK"})
_TUPLES = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}


def _describe(item: Any) -> str:
    if isinstance(item, (_Global, _Instance)):
        what = "the global" if isinstance(item, _Global) else "the result of"
        return f"{what} {'.'.join(item.name) if item.name else '(a computed name)'}"
    return "a value that is not an instance made by this pickle"


def _plain_key(key: Any) -> bool:
    return type(key) is str and not (key.startswith("__") and key.endswith("__"))


class _Walk:
    """The slow walk's state: the stack, the marks, the memo, and what it found."""

    def __init__(self) -> None:
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: list[Any] = []
        self.escaped: set[tuple[str, str]] = set()
        self.new: set[tuple[str, str]] = set()
        self.builds: list[tuple[tuple[str, str], str]] = []

    def pop(self) -> Any:
        if not self.stack or (self.marks and self.marks[-1] == len(self.stack)):
            raise pickle.UnpicklingError("malformed pickle: stack underflow")
        return self.stack.pop()

    def to_mark(self) -> list[Any]:
        if not self.marks:
            raise pickle.UnpicklingError("malformed pickle: no MARK")
        at = self.marks.pop()
        items = self.stack[at:]
        del self.stack[at:]
        for item in items:
            self.use(item)
        return items

    def use(self, item: Any) -> None:
        """``item`` is passed on as a value (called, stored, returned): a global used so is
        never a data-only class."""
        if isinstance(item, _Global) and item.name is not None:
            self.escaped.add(item.name)

    def fill_dict(self, target: Any, items: list[Any]) -> None:
        if isinstance(target, _Dict) and not all(_plain_key(k) for k in items[::2]):
            target.plain = False

    def build(self, at: int) -> None:
        state = self.pop()
        self.use(state)
        if not self.stack:
            raise pickle.UnpicklingError("malformed pickle: stack underflow")
        target = self.stack[-1]
        if not isinstance(target, _Instance) or target.name is None:
            raise UnsafePickle(f"pickle BUILD at byte {at} on {_describe(target)} refused: RPC "
                               "sets state only on an instance its message creates")
        name = ".".join(target.name)
        if target.built:
            raise UnsafePickle(f"pickle BUILD at byte {at} sets the state of one {name} "
                               "instance twice")
        if not _plain_state(state):
            raise UnsafePickle(f"pickle BUILD at byte {at} on a {name} instance refused: its "
                               "state must be a dict (or a (dict, dict) pair for slots) of "
                               "plain attribute names")
        target.built = True
        self.builds.append((target.name, target.how))

    def step(self, name: str, arg: Any, at: int) -> bool:
        """One opcode; False at STOP."""
        stack = self.stack
        if name in _LEAVES:
            stack.append(_VALUE)
        elif name in _TEXT:
            stack.append(arg if len(arg) <= 256 else _VALUE)
        elif name == "MEMOIZE":
            if not stack:
                raise pickle.UnpicklingError("malformed pickle: MEMOIZE on an empty stack")
            self.memo.append(stack[-1])
        elif name in ("BINGET", "LONG_BINGET"):
            if arg >= len(self.memo):
                raise pickle.UnpicklingError(f"pickle memo index {arg} at byte {at} not set")
            stack.append(self.memo[arg])
        elif name == "MARK":
            self.marks.append(len(stack))
        elif name == "NONE":
            stack.append(_NONE)
        elif name == "EMPTY_DICT":
            stack.append(_Dict())
        elif name == "EMPTY_TUPLE":
            stack.append(_Tuple([]))
        elif name in _TUPLES:
            items = [self.pop() for _ in range(_TUPLES[name])][::-1]
            for item in items:
                self.use(item)
            stack.append(_Tuple(items))
        elif name == "TUPLE":
            stack.append(_Tuple(self.to_mark()))
        elif name in ("LIST", "FROZENSET"):
            self.to_mark()
            stack.append(_VALUE)
        elif name == "DICT":
            items = self.to_mark()
            stack.append(_Dict())
            self.fill_dict(stack[-1], items)
        elif name == "SETITEM":
            value, key = self.pop(), self.pop()
            self.use(value)
            self.use(key)
            self.fill_dict(self._top(), [key, value])
        elif name == "SETITEMS":
            items = self.to_mark()
            self.fill_dict(self._top(), items)
        elif name == "APPEND":
            self.use(self.pop())
            self._top()
        elif name in _TO_MARK:
            self.to_mark()
            if name != "POP_MARK":
                self._top()
        elif name == "GLOBAL":
            module, _, qualname = arg.partition(" ")
            stack.append(_Global((module, qualname)))
        elif name == "STACK_GLOBAL":
            qualname, module = self.pop(), self.pop()
            literal = type(module) is str and type(qualname) is str
            stack.append(_Global((module, qualname) if literal else None))
        elif name == "REDUCE":
            args, func = self.pop(), self.pop()
            self.use(args)
            self.use(func)
            stack.append(_Instance(func.name, "call") if isinstance(func, _Global) else _VALUE)
        elif name in ("NEWOBJ", "NEWOBJ_EX"):
            if name == "NEWOBJ_EX":
                self.use(self.pop())
            self.use(self.pop())
            cls = self.pop()
            if isinstance(cls, _Global) and cls.name is not None:
                self.new.add(cls.name)
                stack.append(_Instance(cls.name, "new"))
            else:
                self.use(cls)
                stack.append(_VALUE)
        elif name == "BUILD":
            self.build(at)
        elif name == "READONLY_BUFFER":
            self._top()
        elif name == "DUP":
            stack.append(self._top())
        elif name == "POP":
            if self.marks and self.marks[-1] == len(stack):
                self.marks.pop()
            else:
                self.use(self.pop())
        elif name == "STOP":
            self.use(self.pop())
            return False
        elif name not in ("PROTO", "FRAME"):
            raise pickle.UnpicklingError(f"pickle opcode {name} at byte {at} is not accepted "
                                         "in RPC messages")
        return True

    def _top(self) -> Any:
        if not self.stack or (self.marks and self.marks[-1] == len(self.stack)):
            raise pickle.UnpicklingError("malformed pickle: stack underflow")
        return self.stack[-1]


def _plain_state(state: Any) -> bool:
    if isinstance(state, _Dict):
        return state.plain
    if isinstance(state, _Tuple) and len(state.items) == 2:
        first, slots = state.items
        return (first is _NONE or (isinstance(first, _Dict) and first.plain)) \
            and isinstance(slots, _Dict) and slots.plain
    return False


def _walk(data: bytes | bytearray, containers: int) -> Scan:
    walk = _Walk()
    try:
        for op, arg, at in pickletools.genops(data):
            if not walk.step(op.name, arg, at):
                break
    except (ValueError, EOFError) as exc:  # genops on a malformed pickle
        raise pickle.UnpicklingError(f"malformed pickle: {exc}") from exc
    return Scan(containers, tuple(walk.builds), frozenset(walk.new - walk.escaped))
