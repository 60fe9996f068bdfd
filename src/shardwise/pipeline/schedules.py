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
mean loss. ``_Schedule`` runs a rank's actions on its stages, one for these two and several for
the interleaved schedule (interleaved.py), which shares the batch splitting and the runner.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from shardwise.pipeline.stage import PipelineStage

Action = tuple[str, int]  # ("F" or "B", micro-batch)
StageAction = tuple[str, int, int]  # ("F" or "B", local stage, micro-batch)


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
    """What GPipe, 1F1B and interleaved 1F1B share: splitting the batch into micro-batches and
    running one rank's actions, in order, on its stages (one, or several for interleaved)."""

    def __init__(self, stage: PipelineStage, n_microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 scale_grads: bool = True):
        self._init(_one_stage(stage), n_microbatches, loss_fn, scale_grads)

    def _init(self, stages: list[PipelineStage], n_microbatches: int,
              loss_fn: Callable | None, scale_grads: bool) -> None:
        for stage in stages:
            if not isinstance(stage, PipelineStage):
                raise TypeError(f"a schedule runs a PipelineStage, got {type(stage).__name__}")
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"n_microbatches must be a positive int, got {n_microbatches!r}")
        self._stages, self._n, self._loss_fn = stages, n_microbatches, loss_fn
        self._stage = stages[0]
        self.scale_grads = scale_grads
        first = [s for s in stages if s.is_first]
        last = [s for s in stages if s.is_last]
        self._first = first[0] if first else None
        self._last = last[0] if last else None

    def _order(self) -> list[Action]:
        raise NotImplementedError

    def _actions(self) -> list[StageAction]:
        """This rank's actions as (kind, local stage, micro-batch)."""
        return [(kind, 0, i) for kind, i in self._order()]

    def _eval_actions(self) -> list[StageAction]:
        """Forwards only: every micro-batch through the rank's first stage, then its next, ..."""
        return [("F", j, i) for j in range(len(self._stages)) for i in range(self._n)]

    def step(self, *args: torch.Tensor, target: torch.Tensor | None = None,
             losses: list | None = None, return_outputs: bool = True) -> torch.Tensor | None:
        """One training step of this rank's stages (forward only when the schedule has no
        loss_fn).

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
        micro_x = self._split_inputs(args)
        micro_t = self._split_target(target, needed=train)
        actions = self._actions() if train else self._eval_actions()
        for stage in self._stages:
            stage.begin_step(self._n, backward=train)
        outputs, micro_losses = [], {}
        try:
            for kind, j, i in actions:
                stage = self._stages[j]
                if kind == "F":
                    x = micro_x[i] if stage.is_first else None
                    out = stage.forward_one_chunk(i, x)
                    if stage.is_last and self._loss_fn is not None and micro_t is not None:
                        with contextlib.nullcontext() if train else torch.no_grad():
                            micro_losses[i] = self._loss_fn(out, micro_t[i])
                    if stage.is_last and return_outputs:
                        outputs.append(out.detach())
                    del out
                else:
                    loss = micro_losses.get(i) if stage.is_last else None
                    if loss is not None and self.scale_grads:
                        loss = loss / self._n
                    stage.backward_one_chunk(i, loss, last_backward=i == self._n - 1)
                    if stage.is_last and i in micro_losses:  # drop the graph (RPC retains it)
                        micro_losses[i] = micro_losses[i].detach()
        except BaseException:
            for stage in self._stages:
                stage._saved.clear()
            raise
        for stage in self._stages:
            stage.end_step()
        if losses is not None and micro_losses:
            losses.extend(micro_losses[i].detach() for i in range(self._n))
        return torch.cat(outputs) if outputs else None

    @property
    def idle_fraction(self) -> float | None:
        """The last step's idle fraction of this rank: 1 - its stages' busy time / the step's
        time (None before a step, and over RPC, where backwards run in RPC threads)."""
        stats = [s.stats for s in self._stages]
        if any(st is None or st.idle_fraction is None for st in stats):
            return None
        return 1 - sum(st.busy_s for st in stats) / max(st.step_s for st in stats)

    def _split_inputs(self, args: tuple) -> list[torch.Tensor] | None:
        if self._first is None:
            if args:
                raise ValueError(f"stage {self._stage.stage_index} got inputs: only the first "
                                 "stage passes inputs to step()")
            return None
        if len(args) != 1 or not isinstance(args[0], torch.Tensor):
            raise ValueError("the first stage passes exactly one input tensor to step()")
        return self._chunks(args[0], "input")

    def _split_target(self, target: torch.Tensor | None,
                      needed: bool) -> list[torch.Tensor] | None:
        if self._last is None:
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


def _one_stage(stage: PipelineStage) -> list[PipelineStage]:
    """GPipe and 1F1B run one stage per rank: the stage's pipeline has as many stages as its
    group has ranks."""
    if isinstance(stage, PipelineStage):
        size = dist.get_world_size(stage.group)
        if stage.num_stages != size:
            raise ValueError(f"this schedule runs one stage per rank, but the stage is one of "
                             f"{stage.num_stages} over {size} ranks; use "
                             "ScheduleInterleaved1F1B for several stages per rank")
    return [stage]


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
