"""FSDP against one process training the unwrapped model on the concatenated batch.

Every variant trains 10 AdamW steps on world sizes 1, 2 and 4 (gloo, CPU) with one unit per
transformer block and the root owning the rest, and checks at every step: the loss (mean over
ranks) against the reference's, each rank's gradient shards against the matching slice of the
reference's gradients (Adam is scale-invariant, so equal parameters alone would not show that
gradients are averaged); at the end the full state dict against the reference's.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from shardwise import FullyShardedDataParallel, MixedPrecision, fully_shard
from shardwise.distributed import init_device_mesh
from shardwise.fsdp import ModuleWrapPolicy, ShardingStrategy, full_state_dict, no_sync, units_of
from shardwise.models import GPT, GPTConfig, lm_loss
from shardwise.models.gpt import Block
from tests.harness import (
    WORLD_SIZES,
    assert_rel_close,
    local_part,
    rank_slice,
    run_on_ranks,
    shard0_rows,
    token_batch,
)

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=2, d_model=32)
GLOBAL_BATCH = 8
STEPS = 10
RTOL = 1e-5
# bf16 compute and bf16 reduce-scatter against the fp32 reference: losses within 0.1% at every
# step; parameters within 5e-3 absolute (AdamW at lr 1e-3 moves a parameter by at most ~1e-2 in
# 10 steps; bf16 noise flips the sign of tiny gradients, so biases near 0 differ by a few lr)
BF16_LOSS_RTOL = 1e-3
BF16_PARAM_ATOL = 5e-3


class TwiceGPT(GPT):
    """Calls its first block twice per forward (a unit used more than once)."""

    def forward(self, idx):
        pos = torch.arange(idx.shape[1])
        x = self.tok_emb(idx) + self.pos_emb(pos)
        x = self.blocks[0](x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _checkpointed_block_forward(block, x):
    # activation checkpointing inside the unit: attention and MLP recomputed in backward
    x = x + checkpoint(lambda y: block.attn(block.ln1(y)), x, use_reentrant=False)
    return x + checkpoint(lambda y: block.mlp(block.ln2(y)), x, use_reentrant=False)


def _build(variant: str, tie: bool):
    cfg = GPTConfig(**{**CFG.to_dict(), "tie_weights": tie})
    model = TwiceGPT(cfg) if variant == "twice" else GPT(cfg)
    if variant == "checkpoint":
        for block in model.blocks:
            block.forward = functools.partial(_checkpointed_block_forward, block)
    if variant == "frozen":
        model.tok_emb.requires_grad_(False)
    return model


def _wrap(model, variant: str, api: str):
    kwargs = {"reshard_after_forward": variant != "no_reshard"}
    if variant.startswith("hybrid:"):  # e.g. hybrid:2x2 = (replicate, shard) mesh
        from torch.distributed.device_mesh import init_device_mesh

        shape = tuple(int(n) for n in variant.split(":")[1].split("x"))
        kwargs["mesh"] = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    if variant == "bf16":
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16)
    if api.startswith("wrapper"):  # wrapper or wrapper:<ShardingStrategy name>
        if ":" in api:
            kwargs = {"sharding_strategy": ShardingStrategy[api.split(":")[1]]}
            if api.endswith("HYBRID_SHARD") or api.endswith("ZERO2"):
                kwargs["device_mesh"] = _hybrid_mesh()
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                        **kwargs)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def _hybrid_mesh():
    """(replicate, shard): 2 x 2 at world size 4, 1 x 2 at 2, 1 x 1 at 1."""
    world = dist.get_world_size()
    return init_device_mesh("cpu", (2, 2) if world == 4 else (1, world),
                            mesh_dim_names=("replicate", "shard"))


def _global_batch(step: int, micro: int):
    return token_batch(step, micro, GLOBAL_BATCH, CFG.seq_len, CFG.vocab_size)


def _assert_grad_shards(model, reference, step):
    ref_params = dict(reference.named_parameters())
    prefixes = {id(m): (f"{n}." if n else "") for n, m in model.named_modules()}
    for unit in units_of(model):
        prefix = prefixes[id(unit.module)].replace("_fsdp_wrapped_module.", "")
        for slot in unit.handle.slots if unit.handle else []:
            ref = ref_params.get(prefix + slot.fqns[0])
            if ref is None or ref.grad is None:
                assert slot.shard_param.grad is None, f"{slot.fqns[0]} has a gradient"
                continue
            rank, world = dist.get_rank(unit.group), dist.get_world_size(unit.group)
            assert_rel_close(local_part(slot.shard_param.grad), shard0_rows(ref.grad, rank, world),
                             RTOL, f"step {step}: grad shard of {prefix + slot.fqns[0]}")


def _reference_backward(reference, x, y, micro: int, world_size: int) -> torch.Tensor:
    """The unwrapped model's loss on the global batch, and its gradient as the mean of the
    per-rank gradients summed in rank order.

    That is the concatenated batch's gradient, with the additions across ranks in the order the
    reduce-scatter uses ((g0 + g1) + g2 ...) / N. Backward through the whole batch at once would
    add them in another order, and AdamW turns that last-bit difference into an lr-sized one in
    any element whose gradient is near its eps (seen: a gradient of -7.3e-9 at world size 4 made
    a parameter 3.9e-6 apart after one step while all others stayed within 4e-9).
    """
    params = [p for p in reference.parameters() if p.requires_grad]
    per_rank, loss = [], torch.zeros(())
    for r in range(world_size):
        for m in range(micro):
            part = lm_loss(reference(rank_slice(x[m], r, world_size)),
                           rank_slice(y[m], r, world_size)) / micro
            part.backward()
            loss += part.detach() / world_size
        per_rank.append([p.grad for p in params])
        for p in params:
            p.grad = None
    for i, p in enumerate(params):
        grads = [g[i] for g in per_rank]
        if grads[0] is not None:
            p.grad = sum(grads[1:], grads[0].clone()) / world_size
    return loss


def _train(ctx, variant: str, api: str = "fully_shard", tie: bool = False):
    micro = 2 if variant == "no_sync" else 1
    torch.manual_seed(0)
    reference = _build(variant, tie)
    torch.manual_seed(0)
    model = _wrap(_build(variant, tie), variant, api)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        x, y = _global_batch(step, micro)
        xr, yr = rank_slice(x, ctx.rank, ctx.world_size), rank_slice(y, ctx.rank, ctx.world_size)
        loss = torch.zeros(())
        for m in range(micro):
            if m < micro - 1:
                with no_sync(model):
                    part = lm_loss(model(xr[m]), yr[m]) / micro
                    part.backward()
            else:
                part = lm_loss(model(xr[m]), yr[m]) / micro
                part.backward()
            loss += part.detach()
        dist.all_reduce(loss, group=ctx.group)
        ref_loss = _reference_backward(reference, x, y, micro, ctx.world_size)
        if variant != "bf16":
            _assert_grad_shards(model, reference, step)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((loss.item() / ctx.world_size, ref_loss.item()))
    tol = BF16_LOSS_RTOL if variant == "bf16" else RTOL
    for step, (ours, ref) in enumerate(losses):
        assert abs(ours - ref) <= tol * abs(ref), f"step {step}: loss {ours} vs {ref}"
    state = full_state_dict(model)
    for key, value in reference.state_dict().items():
        if variant == "bf16":
            diff = (state[key] - value).abs().max().item()
            assert diff <= BF16_PARAM_ATOL, f"{key}: bf16 run differs by {diff:.3g}"
        else:
            assert_rel_close(state[key], value, RTOL, key)
    plain = _build(variant, tie)
    plain.load_state_dict(state)  # the full state dict loads into the plain model
    if variant == "bf16":
        return losses, max((state[k] - v).abs().max().item()
                           for k, v in reference.state_dict().items())
    return losses


VARIANTS = ["plain", "no_reshard", "checkpoint", "frozen", "no_sync", "twice"]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_ten_adamw_steps_equal_single_process(variant, world_size):
    run_on_ranks(world_size, _train, variant)


@pytest.mark.parametrize(("world_size", "mesh"), [(1, "1x1"), (2, "2x1"), (2, "1x2"),
                                                  (4, "2x2"), (4, "4x1")])
def test_hybrid_sharding_on_a_2d_mesh_equals_single_process(world_size, mesh):
    """HSDP (fully_shard with a (replicate, shard) mesh): gathered within the shard group,
    gradients reduce-scattered there and averaged across the replicas."""
    run_on_ranks(world_size, _train, f"hybrid:{mesh}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD",
                                      "_HYBRID_SHARD_ZERO2"])
def test_every_sharding_strategy_of_the_wrapper_equals_single_process(world_size, strategy):
    run_on_ranks(world_size, _train, "plain", f"wrapper:{strategy}")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_tied_embedding_and_head_with_wrapper_api(world_size):
    run_on_ranks(world_size, _train, "plain", "wrapper", True)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bf16_mixed_precision_within_tolerance_of_fp32(world_size):
    losses, param_diff = run_on_ranks(world_size, _train, "bf16")[0]
    print(f"bf16: worst loss rel diff {max(abs(a - b) / b for a, b in losses):.2e}, "
          f"worst parameter abs diff {param_diff:.2e}")
    assert losses[-1][0] < losses[0][0]  # and it trains
