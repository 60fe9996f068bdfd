"""Pipeline schedules: which micro-batch a stage runs forward or backward, and when.

``gpipe_order`` and ``one_f_one_b_order`` are pure functions (one stage's list of actions);
``ScheduleGPipe`` and ``Schedule1F1B`` run them with torch.distributed.pipelining's names:
``schedule.step(*inputs, target=..., losses=[])``, where the first stage passes the whole
batch, the last stage the target (and a list that receives each micro-batch's loss), and the
batch is cut into ``n_microbatches`` equal micro-batches along dim 0.

GPipe runs every forward, then every backward: a stage holds all m micro-batches' activations at
the peak. 1F1B runs ``num_stages - stage_index`` forwards first, then alternates one backward and
one forward: at most ``num_stages - stage_index`` micro-batches are in flight on a stage. Both
idle for (p - 1) / (m + p - 1) of the step with equal stage times. Losses are divided by m
before backward (torch's ``scale_grads=True``), so the gradients are those of the whole batch's
mean loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from shardwise.pipeline.stage import PipelineStage

Action = tuple[str, int]  # ("F" or "B", micro-batch)


def gpipe_order(n_microbatches: int, backward: bool = True) -> list[Action]:
    fwd = [("F", i) for i in range(n_microbatches)]
    return fwd + ([("B", i) for i in range(n_microbatches)] if backward else [])


def one_f_one_b_order(stage_index: int, num_stages: int, n_microbatches: int) -> list[Action]:
    """Warm-up forwards, then backward/forward pairs, then the remaining backwards."""
    warmup = min(n_microbatches, num_stages - stage_index)
    order: list[Action] = [("F", i) for i in range(warmup)]
    fwd, bwd = warmup, 0
    while fwd < n_microbatches:
        order += [("B", bwd), ("F", fwd)]
        fwd, bwd = fwd + 1, bwd + 1
    return order + [("B", i) for i in range(bwd, n_microbatches)]


def max_in_flight(order: list[Action]) -> int:
    """The most micro-batches forwarded and not yet backwarded at any point of ``order``."""
    live = peak = 0
    for kind, _ in order:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


class _Schedule:
    def __init__(self, stage: PipelineStage, n_microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 scale_grads: bool = True):
        if not isinstance(stage, PipelineStage):
            raise TypeError(f"a schedule runs a PipelineStage, got {type(stage).__name__}")
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"n_microbatches must be a positive int, got {n_microbatches!r}")
        self._stage, self._n, self._loss_fn = stage, n_microbatches, loss_fn
        self.scale_grads = scale_grads

    def _order(self) -> list[Action]:
        raise NotImplementedError

    def step(self, *args: torch.Tensor, target: torch.Tensor | None = None,
             losses: list | None = None, return_outputs: bool = True) -> torch.Tensor | None:
        """One training step of this stage (forward only when the schedule has no loss_fn).

        Returns the last stage's output (the micro-batches' outputs concatenated, detached)
        when ``return_outputs``; None elsewhere. Point-to-point sends and RPCs happen as the
        stage's transport does them; no collective beyond those (and DDP's, if wrapped)."""
        train = self._loss_fn is not None
        return self._run(args, target, losses, return_outputs, train)

    def eval(self, *args: torch.Tensor, target: torch.Tensor | None = None,
             losses: list | None = None) -> torch.Tensor | None:
        """Forwards only, as torch's ``schedule.eval``: no graph kept, no gradient sent; the
        last stage computes each micro-batch's loss into ``losses`` when it has a target."""
        return self._run(args, target, losses, True, train=False)

    def _run(self, args: tuple, target: torch.Tensor | None, losses: list | None,
             return_outputs: bool, train: bool) -> torch.Tensor | None:
        stage = self._stage
        micro_x = self._split_inputs(args)
        micro_t = self._split_target(target, needed=train)
        order = self._order() if train else gpipe_order(self._n, backward=False)
        stage.begin_step(self._n, backward=train)
        outputs, micro_losses, out = [], {}, None
        try:
            for kind, i in order:
                if kind == "F":
                    out = stage.forward_one_chunk(i, micro_x[i] if micro_x else None)
                    if stage.is_last and self._loss_fn is not None and micro_t is not None:
                        with contextlib.nullcontext() if train else torch.no_grad():
                            micro_losses[i] = self._loss_fn(out, micro_t[i])
                    if stage.is_last and return_outputs:
                        outputs.append(out.detach())
                else:
                    loss = micro_losses.get(i)
                    if loss is not None and self.scale_grads:
                        loss = loss / self._n
                    stage.backward_one_chunk(i, loss, last_backward=i == self._n - 1)
                    if i in micro_losses:  # drop the graph (RPC's backward retains it)
                        micro_losses[i] = micro_losses[i].detach()
        except BaseException:
            stage._saved.clear()
            raise
        stage.end_step()
        if losses is not None and micro_losses:
            losses.extend(micro_losses[i].detach() for i in range(self._n))
        del out
        return torch.cat(outputs) if outputs else None

    def _split_inputs(self, args: tuple) -> list[torch.Tensor] | None:
        if not self._stage.is_first:
            if args:
                raise ValueError(f"stage {self._stage.stage_index} got inputs: only the first "
                                 "stage passes inputs to step()")
            return None
        if len(args) != 1 or not isinstance(args[0], torch.Tensor):
            raise ValueError("the first stage passes exactly one input tensor to step()")
        return self._chunks(args[0], "input")

    def _split_target(self, target: torch.Tensor | None,
                      needed: bool) -> list[torch.Tensor] | None:
        if not self._stage.is_last:
            if target is not None:
                raise ValueError(f"stage {self._stage.stage_index} got a target: only the last "
                                 "stage takes target= (and losses=)")
            return None
        if needed and target is None:
            raise ValueError("the last stage of a schedule with a loss_fn needs target=")
        return self._chunks(target, "target") if target is not None else None

    def _chunks(self, t: torch.Tensor, what: str) -> list[torch.Tensor]:
        if t.dim() == 0 or t.shape[0] % self._n:
            size = t.shape[0] if t.dim() else "a scalar"
            raise ValueError(f"{self._n} micro-batches do not divide the {what} batch of "
                             f"{size}: the batch size must be a multiple of n_microbatches")
        return list(t.chunk(self._n))


class ScheduleGPipe(_Schedule):
    """All forwards of the micro-batches, then all backwards (fill, drain)."""

    def _order(self) -> list[Action]:
        return gpipe_order(self._n, backward=self._loss_fn is not None)


class Schedule1F1B(_Schedule):
    """One forward, one backward: at most ``num_stages - stage_index`` micro-batches alive."""

    def __init__(self, stage: PipelineStage, n_microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 scale_grads: bool = True):
        super().__init__(stage, n_microbatches, loss_fn, scale_grads)
        if loss_fn is None:
            raise ValueError("Schedule1F1B trains: it needs a loss_fn (use ScheduleGPipe "
                             "without one for forward only)")

    def _order(self) -> list[Action]:
        s = self._stage
        return one_f_one_b_order(s.stage_index, s.num_stages, self._n)
