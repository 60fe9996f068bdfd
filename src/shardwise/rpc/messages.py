"""Message kinds, the envelope that precedes every payload, and remote exceptions.

A frame's payload starts with a 9-byte envelope (kind, message id) in plain binary, so that a
request whose body cannot be decoded still gets an error reply naming the problem. The body is
pickled as ``(context_id, grad_key, body)``: the distributed autograd context the sender was in
(or None) and the key under which its tensors requiring grad were recorded (autograd/).
"""

from __future__ import annotations

import struct
import traceback
from enum import IntEnum

from shardwise.rpc.trust.callables import resolve_exception


class Kind(IntEnum):
    CALL = 1  # (function name, args, kwargs, reply device map)
    REMOTE = 2  # (function name, args, kwargs, reply device map, rref id, fork id)
    FETCH = 3  # (rref id,): the owner's value, when ready
    FORK_ADD = 4  # (rref id, fork id, receiver rank): a holder hands its RRef to the receiver
    FORK_DEL = 5  # (rref id, fork id): the fork's holder dropped it
    BACKWARD = 6  # (context id, grad key, grads): gradients for tensors this worker sent
    CTX_RELEASE = 7  # (context id,): forget a distributed autograd context
    AT_SHUTDOWN = 8  # (no body, no reply): the sender called shutdown() and is at its barrier
    RESPONSE = 16
    ERROR = 17  # (exception type, message, remote traceback)


REQUESTS = frozenset(k for k in Kind if k < Kind.RESPONSE)
ENVELOPE = struct.Struct("!BQ")


class RemoteException(RuntimeError):
    """A remote exception whose own type could not be rebuilt here."""


def encode_exception(exc: BaseException) -> tuple[str, str, str]:
    kind = type(exc)
    tb = "".join(traceback.format_exception(kind, exc, exc.__traceback__))
    return f"{kind.__module__}:{kind.__qualname__}", str(exc), tb


def decode_exception(info: tuple[str, str, str], worker: str) -> BaseException:
    """The remote exception, as its own type where possible, its message followed by the
    remote traceback."""
    if not (isinstance(info, tuple) and len(info) == 3 and all(isinstance(x, str) for x in info)):
        return RemoteException(f"worker {worker!r} sent a malformed error reply")
    type_name, message, tb = info
    text = f"{message}\n\nOn worker {worker!r}:\n{tb}"
    module, _, qualname = type_name.partition(":")
    cls = resolve_exception(module, qualname)
    if cls is not None:
        try:
            return cls(text)
        except Exception:  # noqa: BLE001 - a constructor that wants other arguments
            pass
    return RemoteException(f"{type_name}: {text}")
