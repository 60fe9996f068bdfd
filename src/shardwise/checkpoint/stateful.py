"""torch's ``Stateful`` protocol in ``save``, ``async_save`` and ``load``, as torch DCP has it.

An entry at the top level of the state dict that is ``Stateful`` (has ``state_dict()`` and
``load_state_dict()``: ``isinstance(x, torch.distributed.checkpoint.stateful.Stateful)``, a
runtime-checkable protocol, so modules and optimizers count too) is saved as what its
``state_dict()`` returns, under its key. On load its ``state_dict()`` is taken first (the
tensors to load into, in place), loaded, then handed to its ``load_state_dict()``. Deeper
entries are not looked at, as in DCP (``_stateful_to_state_dict`` walks the top level only).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.stateful import Stateful


def expand(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy of ``state_dict`` with each Stateful entry replaced by its
    ``state_dict()`` (the same dict when there is none)."""
    if not any(isinstance(v, Stateful) for v in state_dict.values()):
        return state_dict
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}


def hand_back(state_dict: dict[str, Any], loaded: dict[str, Any]) -> None:
    """After a load into ``loaded = expand(state_dict)``: each Stateful entry's
    ``load_state_dict`` with what was loaded for it; every other top-level entry set to what
    was loaded (the copy's top-level values were replaced there, not in ``state_dict``)."""
    if loaded is state_dict:
        return
    for key, value in state_dict.items():
        if isinstance(value, Stateful):
            value.load_state_dict(loaded[key])
        else:
            state_dict[key] = loaded[key]
