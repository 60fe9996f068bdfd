"""ZeRO's element-wise partition (``partition="elements"``): the layout's arithmetic, stage 1
and stage 2 in float64 against one process training on the whole batch (AdamW with clipping),
checkpoints across the two partitions, and the refusals."""

import copy

import pytest
import torch

from shardwise import DistributedDataParallel, ZeroDataParallel, ZeroRedundancyOptimizer
from shardwise.memory import state_bytes
from shardwise.zero.elements import Segment, bucket_parts
from tests.harness import WORLD_SIZES, assert_rel_close, rank_slice, run_on_ranks
from tests.zero.common import global_batch, loss_fn, make_net, param_groups, schedule

RTOL = 1e-12  # float64: the ranks' sums differ from the reference's only in rounding
CLIP = 0.05  # below the gradients' norm, so every step clips
KWARGS = {"lr": 1e-2, "weight_decay": 0.1}
BUCKET_MB = 0.001


# -- the layout ----------------------------------------------------------------------------

@pytest.mark.parametrize("world", (1, 2, 3, 7, 64))
def test_ranges_cover_every_element_once_and_differ_by_at_most_one_chunk(world):
    numels = [144, 24, 288, 12, 36, 3, 1, 5]
    segment = Segment([(0, i, n) for i, n in enumerate(numels)], world)
    seen = [0] * sum(numels)
    for rank in range(world):
        lo, hi = segment.range_of(rank)
        assert hi - lo <= -(-sum(numels) // world)
        for piece in segment.pieces(rank):
            assert 0 <= piece.start < piece.end <= numels[piece.index]
            first = segment.offsets[piece.index] + piece.start
            assert lo <= first and first + piece.numel <= hi and piece.offset == first
            for k in range(first, first + piece.numel):
                seen[k] += 1
    assert seen == [1] * sum(numels)


def test_bucket_parts_are_each_ranks_elements_of_the_bucket():
    numels = [10, 7, 30, 2, 9, 16]
    segment = Segment([(0, i, n) for i, n in enumerate(numels)], 4)  # chunk 19
    chosen = [1, 2, 4]  # a bucket of parameters 1, 2 and 4, packed in layout order
    offsets = [segment.offsets[i] for i in chosen]
    parts = bucket_parts(offsets, [numels[i] for i in chosen], segment)
    positions = [o + k for i, o in zip(chosen, offsets) for k in range(numels[i])]
    for rank, (start, end) in enumerate(parts):
        lo, hi = segment.range_of(rank)
        want = [k for k, x in enumerate(positions) if lo <= x < hi]
        assert list(range(start, end)) == want, (rank, parts)


# -- training against one process -----------------------------------------------------------

def _models(ctx, stage, partition="elements", start=None):
    """The reference and its AdamW, and the same model under DDP + ZeRO-1 (stage 1) or
    ZeroDataParallel (stage 2) with ``partition``; both from ``start``'s state dicts (model,
    optimizer) when given."""
    reference = make_net().double()
    ref_opt = torch.optim.AdamW(param_groups(reference), **KWARGS)
    net = make_net(seed=ctx.rank).double()  # replicas start different: the wrap syncs them
    if start is not None:
        reference.load_state_dict(start[0])
        ref_opt.load_state_dict(start[1])
        net.load_state_dict(start[0])
    if stage == 1:
        model = DistributedDataParallel(net)
    opt = ZeroRedundancyOptimizer(param_groups(net), torch.optim.AdamW, partition=partition,
                                  **KWARGS)
    if stage == 2:
        model = ZeroDataParallel(net, opt, bucket_cap_mb=BUCKET_MB)
    return reference, ref_opt, net, model, opt


def _train(ctx, stage, steps, reference, ref_opt, net, model, opt, first=0):
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in (opt, ref_opt)]
    for step in range(first, first + steps):
        x, y = global_batch(step)
        x, y = x.double(), y.double()
        xr, yr = rank_slice(x, ctx.rank, ctx.world_size), rank_slice(y, ctx.rank, ctx.world_size)
        loss_fn(model(xr[0]), yr[0]).backward()
        loss_fn(reference(x[0]), y[0]).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        if stage == 1:
            norm = torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        else:
            norm = model.clip_grad_norm_(CLIP)
            if opt.partition == "elements":  # the reduced gradients are the pieces'
                assert all(p.grad is None for p in net.parameters())
        assert_rel_close(norm, ref_norm, RTOL, f"step {step}: total norm")
        for o, sched in zip((opt, ref_opt), scheds):
            o.step()
            sched.step()
            o.zero_grad()
        for (name, p), (_, q) in zip(net.named_parameters(), reference.named_parameters()):
            assert_rel_close(p, q, RTOL, f"stage {stage} step {step}: {name}")


def _run(ctx, stage):
    reference, ref_opt, net, model, opt = _models(ctx, stage)
    _train(ctx, stage, 5, reference, ref_opt, net, model, opt)
    assert torch.equal(net.frozen.weight, reference.frozen.weight)
    return [p.detach().clone() for p in net.parameters()], state_bytes(net, opt).optimizer


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("stage", (1, 2))
def test_five_clipped_adamw_steps_equal_single_process(world_size, stage):
    results = run_on_ranks(world_size, _run, stage)
    for params, _ in results[1:]:  # every rank holds the same parameters
        assert all(torch.equal(a, b) for a, b in zip(params, results[0][0]))


@pytest.mark.parametrize("world_size", (2, 4))
def test_every_rank_holds_its_share_of_optimizer_state(world_size):
    results = run_on_ranks(world_size, _run, 1)
    net = make_net()
    elements = sum(p.numel() for p in net.parameters() if p.requires_grad)
    per_param = len([p for p in net.parameters() if p.requires_grad])
    chunk = -(-elements // world_size)
    for _, held in results:  # two float64 moments per element, a step per piece (< 2 more)
        assert 16 * (chunk - 1) <= held <= 16 * chunk + 8 * (per_param // world_size + 2)


def _torch_shaped_state(ctx, stage):
    """Train 3 steps with the element partition, consolidate, and check the state equals the
    reference optimizer's; then load it into the parameter partition (and back into the
    element partition) and train 2 more steps: equal to the reference."""
    reference, ref_opt, net, model, opt = _models(ctx, stage)
    _train(ctx, stage, 3, reference, ref_opt, net, model, opt)
    opt.consolidate_state_dict(to=0)
    saved = opt.state_dict() if ctx.rank == 0 else None
    if ctx.rank == 0:
        want = ref_opt.state_dict()
        assert saved["state"].keys() == want["state"].keys()
        for index, entry in want["state"].items():
            for key, value in entry.items():
                assert_rel_close(saved["state"][index][key], value, RTOL, f"{index} {key}")
    box = [saved]
    torch.distributed.broadcast_object_list(box, src=0)
    saved_ref = copy.deepcopy((reference.state_dict(), ref_opt.state_dict()))
    for partition in ("parameters", "elements"):
        # each trial from its own copy (AdamW updates the state it loaded in place)
        start = copy.deepcopy(saved_ref)
        reference, ref_opt, net, model, opt = _models(ctx, stage, partition, start)
        opt.load_state_dict(box[0])
        _train(ctx, stage, 2, reference, ref_opt, net, model, opt, first=3)


@pytest.mark.parametrize("world_size", (2, 4))
@pytest.mark.parametrize("stage", (1, 2))
def test_checkpoint_is_torch_shaped_and_loads_into_either_partition(world_size, stage):
    run_on_ranks(world_size, _torch_shaped_state, stage)


# -- refusals ----------------------------------------------------------------------------

class _WholeTensorOptimizer(torch.optim.Optimizer):
    """Scales each update by its parameter's norm (like LAMB's trust ratio): not element-wise."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})


def _errors(ctx):
    net = make_net()
    messages = []
    for kwargs in ({"partition": "element"}, {"partition": "elements", "optimizer_class":
                                              _WholeTensorOptimizer},
                   {"partition": "elements", "parameters_as_bucket_view": True}):
        kwargs = {"optimizer_class": torch.optim.AdamW, **kwargs}
        with pytest.raises(ValueError) as exc:
            ZeroRedundancyOptimizer(net.parameters(), lr=0.1, **kwargs)
        messages.append(str(exc.value))
    opt = ZeroRedundancyOptimizer(param_groups(net)[:1], torch.optim.AdamW,
                                  partition="elements")
    with pytest.raises(RuntimeError, match="add_param_group is not available"):
        opt.add_param_group(param_groups(net)[1])
    with pytest.raises(RuntimeError, match="no one owner"):
        opt.owners()
    from shardwise.checkpoint import get_state_dict, set_state_dict

    with pytest.raises(ValueError, match="save it with consolidate_state_dict"):
        get_state_dict(net, opt)
    with pytest.raises(ValueError, match="save it with consolidate_state_dict"):
        set_state_dict(net, opt, model_state_dict=net.state_dict(),
                       optim_state_dict={"state": {}, "param_groups": []})
    return messages


def test_bad_partition_options_are_clear_errors():
    messages = run_on_ranks(1, _errors)[0]
    assert "partition must be one of 'parameters', 'elements', got 'element'" in messages[0]
    assert "_WholeTensorOptimizer is not known to be one" in messages[1]
    assert "does not combine with parameters_as_bucket_view" in messages[2]
