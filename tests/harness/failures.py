"""Errors injected into a training step, for tests of what a caught failure leaves behind."""

from __future__ import annotations

from typing import Any


class Injected(RuntimeError):
    """The error a test raised on purpose (told apart from any real failure)."""


def raise_from_grad(grad: Any) -> None:
    raise Injected("raised by a hook in the middle of backward")


def raise_in_backward(module: Any, args: Any, output: Any) -> None:
    """A forward hook that makes the backward through ``output`` raise (``Injected``) once it
    reaches the output's gradient; the output itself stays as it is (the hook returns None)."""
    output.register_hook(raise_from_grad)
