"""The single-process reference a distributed training test compares with.

A data-parallel (or sharded, or pipelined) run of N ranks must match one process that trains
the plain model on what all ranks saw together, with the same seed and optimizer. This is that
one process, written once::

    ref = reference_train(_Net, lambda model, step: F.mse_loss(model(x[step]), y[step]),
                          lambda model: torch.optim.SGD(model.parameters(), lr=0.1), steps=4)
    ref.losses, ref.state(), ref.grads, ref.norms

Each step: zero the gradients, ``loss_fn(model, step).backward()``, optionally record the
gradients and clip their norm, ``optimizer.step()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class ReferenceRun:
    """What the reference trained: the model and optimizer after the last step, and per step
    the loss, the gradients (with ``keep_grads``) and the norm before clipping (with ``clip``)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    losses: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)

    def state(self) -> dict[str, torch.Tensor]:
        """The model's state dict, detached copies."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def reference_train(model_fn: Callable[[], nn.Module],
                    loss_fn: Callable[[nn.Module, int], torch.Tensor],
                    optim_fn: Callable[[nn.Module], torch.optim.Optimizer],
                    steps: int | Iterable[int], *, seed: int | None = 0,
                    clip: float | None = None, keep_grads: bool = False) -> ReferenceRun:
    """Train ``model_fn()`` (built after ``torch.manual_seed(seed)`` unless ``seed`` is None)
    with the optimizer ``optim_fn(model)`` for ``steps`` (a count, or the step indices), the
    loss of step ``k`` being ``loss_fn(model, k)``; see the module docstring."""
    if seed is not None:
        torch.manual_seed(seed)
    model = model_fn()
    run = ReferenceRun(model, optim_fn(model))
    for step in range(steps) if isinstance(steps, int) else steps:
        run.optimizer.zero_grad()
        loss = loss_fn(model, step)
        loss.backward()
        if keep_grads:
            run.grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                              if p.grad is not None})
        if clip is not None:
            run.norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip)))
        run.optimizer.step()
        run.losses.append(float(loss.detach()))
    return run
