"""Our point-to-point pipeline against torch.distributed.pipelining, on the same split of the
demo GPT: step time per schedule (GPipe, 1F1B, interleaved 1F1B) and the bubble.

GPipe and 1F1B run one stage per rank (2 stages by default), interleaved 1F1B ``VIRTUAL``
stages per rank (stage k on rank k % ranks; the GPT cut into ranks x VIRTUAL stages), over
gloo, the same cut (``split_gpt``) for ours and torch's, the same micro-batches, loss and
AdamW. The bubble is measured the same way for both: each rank first times its stages'
forwards and backwards of one step's micro-batches alone (no communication; the median of a
few runs), and a schedule's idle fraction is 1 - that busy time / the median step time
(``bubble_per_rank``; ``bubble_mean`` over the ranks). Ours also reports its own per-step accounting
(``schedule.idle_fraction``: over the rank's stages, each stage's ``StepStats``).
``bubble_formula`` is the schedule's idle fraction with equal stage times and free
communication: (p - 1) / (m + p - 1) for GPipe and 1F1B, and for interleaved 1F1B that of its
orders (``simulated_bubble``: (p - 1) / (v m + p - 1) when p divides m).

``alternating`` runs all six in the same ranks, one step of each in turn, so that load from
other jobs on the machine falls on all four alike; its ``ours_over_torch`` is the steadier
ratio on a busy machine (its peak RSS is of all six together), and ``own_idle_mean`` our
schedules' own idle fractions (median over steps, mean over ranks) measured side by side.

Each schedule's row also gets its physical limit (limits.py): the computation on the
schedule's critical path, from every stage's busy time alone and its optimizer step timed alone,
plus one activation and one gradient transfer per stage boundary (``limit_compute_ms`` and
``exposed_comm_ms``). For interleaved rows the fill and drain are counted in chunks of one
stage's micro-batch (v m of them per rank, each 1/v of a rank's per-micro-batch work) and the
transfers over its v p - 1 boundaries.

Prints the table, then per schedule our step time over torch's (kept in the record as
``per_schedule``). CPU and gloo only (no ``--device cuda`` yet).

    shardwise bench pipeline --nproc 2 --rounds 3 --steps 20 --microbatches 4
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from shardwise.bench.limits import PATTERNS, boundary_transfers_ms, pipeline_critical_path_ms
from shardwise.bench.sidebyside import SideBySide
from shardwise.bench.sidebyside import run as run_side_by_side
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.pipeline import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    bubble_fraction,
    simulated_bubble,
    split_gpt,
)

KINDS = ("gpipe", "1f1b", "interleaved")
IMPLS = [f"{who}-{kind}" for kind in KINDS for who in ("torch", "shardwise")] + ["alternating"]
PATTERN = PATTERNS["pipeline"]
ALTERNATED = IMPLS[:-1]
VIRTUAL = 2  # stages per rank of the interleaved rows


def _args(parser) -> None:
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)


def _stages_per_rank(impl: str) -> int:
    return VIRTUAL if impl.endswith("interleaved") else 1


def _modules(impl: str, cfg: GPTConfig, rank: int, pp: int) -> tuple[list, list[int], int]:
    """This rank's stage modules of a fresh GPT (seed 0), their stage indices and the stage
    count."""
    n = pp * _stages_per_rank(impl)
    torch.manual_seed(0)
    parts = split_gpt(GPT(cfg), n)
    indices = list(range(rank, n, pp))
    return [parts[k] for k in indices], indices, n


def _make_schedule(impl: str, modules: list, indices: list[int], n: int, group, micro: int):
    kind = impl.split("-")[1]
    if impl.startswith("torch"):
        from torch.distributed import pipelining as tp

        stages = [tp.PipelineStage(m, k, n, torch.device("cpu"), group=group)
                  for m, k in zip(modules, indices)]
        if kind == "interleaved":
            return stages, tp.ScheduleInterleaved1F1B(stages, micro, loss_fn=lm_loss)
        cls = tp.ScheduleGPipe if kind == "gpipe" else tp.Schedule1F1B
        return stages, cls(stages[0], micro, loss_fn=lm_loss)
    stages = [PipelineStage(m, k, n, group=group) for m, k in zip(modules, indices)]
    if kind == "interleaved":
        return stages, ScheduleInterleaved1F1B(stages, micro, loss_fn=lm_loss)
    cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
    return stages, cls(stages[0], micro, loss_fn=lm_loss)


def _busy_alone(modules: list, indices: list[int], n: int, cfg: GPTConfig, micro_batch: int,
                micro: int, repeats: int = 5) -> tuple[float, float]:
    """Seconds of one step's forwards and backwards on this rank's stages with no
    communication, and of an AdamW step over their parameters (on a copy: the stages
    themselves are untouched)."""
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len), generator=gen)
    hidden = torch.randn(micro_batch, cfg.seq_len, cfg.d_model, generator=gen)
    y = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len), generator=gen)
    runs = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for module, k in zip(modules, indices):
            for _ in range(micro):
                inp = tokens if k == 0 else hidden.clone().requires_grad_(True)
                out = module(inp)
                if k == n - 1:
                    (lm_loss(out, y) / micro).backward()
                else:
                    out.backward(torch.ones_like(out))
        runs.append(time.perf_counter() - start)
        if len(runs) <= repeats:
            for module in modules:
                module.zero_grad(set_to_none=True)
    return statistics.median(runs[1:]), _optimizer_alone(torch.nn.ModuleList(modules))


def _optimizer_alone(module, repeats: int = 3) -> float:
    """Seconds of an AdamW step over copies of ``module``'s parameters and gradients."""
    params = [p.detach().clone().requires_grad_(True) for p in module.parameters()]
    for p, q in zip(params, module.parameters()):
        p.grad = q.grad.clone() if q.grad is not None else torch.zeros_like(p)
    module.zero_grad(set_to_none=True)
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()  # creates the state
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        opt.step()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def _batch(step: int, cfg: GPTConfig, batch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)


def _one_step(schedule, tokens: torch.Tensor, rank: int, pp: int) -> None:
    if rank == 0:
        schedule.step(tokens[:, :-1])
    elif rank == pp - 1:
        schedule.step(target=tokens[:, 1:], losses=[])
    else:
        schedule.step()


def _timed_step(schedule, opt, tokens: torch.Tensor, rank: int, pp: int,
                group: dist.ProcessGroup) -> float:
    """One pipeline step and optimizer step after a barrier; its seconds on this rank."""
    dist.barrier(group=group)
    t0 = time.perf_counter()
    _one_step(schedule, tokens, rank, pp)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def alternating(args, group: dist.ProcessGroup):
    """All four in the same ranks, one step of each in turn, in a rotating order (each on its own
    group, model copy and optimizer): load from elsewhere falls on all of them alike. Reports
    each one's median step time in ``extra``; the returned times are each turn's total."""
    rank, pp = dist.get_rank(group), dist.get_world_size(group)
    cfg = GPTConfig(n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head,
                    seq_len=args.seq_len)
    runs = []
    for impl in ALTERNATED:
        modules, indices, n = _modules(impl, cfg, rank, pp)
        sub = dist.new_group(list(range(pp)))
        _, schedule = _make_schedule(impl, modules, indices, n, sub, args.microbatches)
        params = [p for m in modules for p in m.parameters()]
        runs.append((impl, schedule, torch.optim.AdamW(params, lr=1e-3)))
    times: dict[str, list[float]] = {impl: [] for impl in ALTERNATED}
    idle: dict[str, list[float]] = {impl: [] for impl in ALTERNATED if impl.startswith("shard")}
    for step in range(args.warmup + args.steps):
        tokens = _batch(step, cfg, args.batch_size)
        turn = step % len(runs)  # rotate who goes first: no implementation always follows another
        for impl, schedule, opt in runs[turn:] + runs[:turn]:
            took = _timed_step(schedule, opt, tokens, rank, pp, group)
            if step >= args.warmup:
                times[impl].append(took)
                if impl in idle:
                    idle[impl].append(schedule.idle_fraction)
    medians = {impl: round(statistics.median(ts) * 1e3, 1) for impl, ts in times.items()}
    own = {impl: statistics.median(v) for impl, v in idle.items()}
    gathered: list = [None] * pp
    dist.all_gather_object(gathered, (medians, own), group=group)
    own_idle = {impl: round(statistics.mean(g[1][impl] for g in gathered), 3) for impl in own}
    gathered = [g[0] for g in gathered]
    slowest = {impl: max(m[impl] for m in gathered) for impl in ALTERNATED}
    ratios = {kind: round(slowest[f"shardwise-{kind}"] / slowest[f"torch-{kind}"], 3)
              for kind in KINDS}
    if rank == 0:  # every round's figures (the summary table shows the first round's)
        print(f"alternating round: median ms {slowest}, ours / torch {ratios}, our idle "
              f"fraction (mean over ranks) {own_idle}", flush=True)
    return [sum(ts) for ts in zip(*times.values())], {"median_ms": slowest,
                                                      "ours_over_torch": ratios,
                                                      "own_idle_mean": own_idle}


def worker(impl: str, args, group: dist.ProcessGroup):
    if impl == "alternating":
        return alternating(args, group)
    rank, pp = dist.get_rank(group), dist.get_world_size(group)
    cfg = GPTConfig(n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head,
                    seq_len=args.seq_len)
    modules, indices, n = _modules(impl, cfg, rank, pp)
    v = _stages_per_rank(impl)
    micro_batch = args.batch_size // args.microbatches
    busy, opt_alone = _busy_alone(modules, indices, n, cfg, micro_batch, args.microbatches)
    _, schedule = _make_schedule(impl, modules, indices, n, group, args.microbatches)
    opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=1e-3)
    times, own_idle = [], []
    for step in range(args.warmup + args.steps):
        took = _timed_step(schedule, opt, _batch(step, cfg, args.batch_size), rank, pp, group)
        if step >= args.warmup:
            times.append(took)
            if impl.startswith("shardwise"):
                own_idle.append(schedule.idle_fraction)
    step_s = statistics.median(times)
    own = round(statistics.median(own_idle), 3) if own_idle else None
    mine = (round(1 - busy / step_s, 3), own, busy * 1e3, opt_alone * 1e3)
    per_rank: list = [None] * pp
    dist.all_gather_object(per_rank, mine, group=group)  # rank 0's record shows every rank
    transfers = boundary_transfers_ms((micro_batch, cfg.seq_len, cfg.d_model), group,
                                      torch.device("cpu"))
    if pp > 1:  # every boundary moves the same shapes; v p - 1 of them
        transfers = transfers * (n - 1) / (pp - 1)
    formula = simulated_bubble(pp, v, args.microbatches) if v > 1 else \
        bubble_fraction(pp, args.microbatches)
    extra = {"bubble_per_rank": [r[0] for r in per_rank],
             "bubble_mean": round(statistics.mean(r[0] for r in per_rank), 3),
             "bubble_formula": round(formula, 3),
             "limit_compute_ms": round(pipeline_critical_path_ms(
                 [r[2] for r in per_rank], [r[3] for r in per_rank], args.microbatches * v), 2),
             "exposed_comm_ms": round(transfers, 3)}
    if own_idle:
        extra["own_idle_per_rank"] = [r[1] for r in per_rank]
    return times, extra


def per_schedule(summary: dict) -> list[dict]:
    """Per schedule whose both implementations ran: both median step times and ours / torch."""
    rows = []
    for kind in KINDS:
        ours, theirs = summary.get(f"shardwise-{kind}"), summary.get(f"torch-{kind}")
        if ours and theirs:
            rows.append({"schedule": kind, "ours_step_s": ours["median_step_s"],
                         "torch_step_s": theirs["median_step_s"],
                         "ratio": ours["median_step_s"] / theirs["median_step_s"]})
    return rows


def per_schedule_lines(rows: list[dict]) -> list[str]:
    return [f"{r['schedule']}: ours {r['ours_step_s'] * 1e3:.1f} ms, torch "
            f"{r['torch_step_s'] * 1e3:.1f} ms per step: {r['ratio']:.3f}x torch's" for r in rows]


def bubble_lines(summary: dict) -> list[str]:
    """Per schedule that ran: its formula bubble, each implementation's measured mean and ours
    from our own per-step accounting (``idle_fraction``: busy time inside the step itself, less
    exposed to load that changes between the busy-alone timing and the steps)."""
    lines = []
    for kind in KINDS:
        rows = {who: summary.get(f"{who}-{kind}") for who in ("shardwise", "torch")}
        rows = {who: r for who, r in rows.items() if r and "bubble_formula" in r.get("extra", {})}
        if not rows:
            continue
        formula = next(iter(rows.values()))["extra"]["bubble_formula"]
        measured = ", ".join(f"{who} {r['extra']['bubble_mean']}" for who, r in rows.items())
        line = f"bubble {kind}: formula {formula}, measured mean over ranks {measured}"
        own = rows.get("shardwise", {}).get("extra", {}).get("own_idle_per_rank")
        if own and None not in own:
            line += f"; our per-step accounting's mean {round(statistics.mean(own), 3)}"
        lines.append(line)
    return lines


_BENCH = SideBySide("pipeline", worker, IMPLS, "torch-gpipe", _args,
                    "our p2p pipeline against torch.distributed.pipelining", pattern=PATTERN,
                    cuda=False)


def run(argv: Sequence[str]) -> dict | None:
    """The side-by-side run, plus ours / torch per schedule and each schedule's bubble (printed
    after the table as the record's ``notes``)."""
    record = run_side_by_side(_BENCH, argv)
    if record is None:
        return None
    rows = per_schedule(record["impls"])
    notes = per_schedule_lines(rows) + bubble_lines(record["impls"])
    return {**record, "per_schedule": rows, "notes": notes}
