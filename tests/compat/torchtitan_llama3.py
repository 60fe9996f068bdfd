"""torchtitan's llama3 debug model, parallelized by torchtitan's own ``parallelize_llama`` and
trained as torchtitan's trainer does (FSDP's gradient division off, the loss divided by the
global token count, clipping, AdamW), with FSDP2 from torch or from shardwise. Run under
torchrun: ``python -m torch.distributed.run --standalone --nproc-per-node 2
torchtitan_llama3.py {torch|shardwise} {spmd_types|partial_dtensor}``; prints one LOSSES line
per rank.

torchtitan itself does not train on a CPU. The smallest patch that lets its own code run here,
kept in this file: its expert-parallel Triton kernels (imported at import time, used by no
dense model) become an empty module; its device fallback ("cuda" without an accelerator) is set
to "cpu"; the attention is torchtitan's own ``ScaledDotProductAttention`` (its flex attention
has no CPU backward). With torch's FSDP2 on gloo, ``set_force_sum_reduction_for_comms(True)``
is needed for the gradient divide factor (gloo has no PREMUL_SUM); shardwise needs nothing.
"""

import sys
import types

import torch
import torch.distributed as dist

STEPS = 5


def patch_torchtitan_for_cpu() -> None:
    kernels = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")

    def missing(name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def kernel(*args, **kwargs):
            raise RuntimeError(f"{name} needs Triton (a GPU); this test replaced it")

        return kernel

    kernels.__getattr__ = missing
    sys.modules[kernels.__name__] = kernels
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common.attention import ScaledDotProductAttention

    parallel_dims.device_type = "cpu"
    llama3.get_attention_config = lambda backend: ScaledDotProductAttention.Config()


def build(which: str, backend: str, world: int) -> torch.nn.Module:
    import torchtitan.distributed.fsdp as tt_fsdp
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.parallelize import parallelize_llama

    if which == "shardwise":
        import shardwise

        tt_fsdp.fully_shard = shardwise.fully_shard  # the import swap a user makes
    torch.manual_seed(0)
    model = model_registry("debugmodel", attn_backend="sdpa").model.build()
    parallelism = ParallelismConfig(data_parallel_shard_degree=world, spmd_backend=backend)
    parallelize_llama(model, parallel_dims=ParallelDims.from_config(parallelism, world),
                      training=TrainingConfig(), parallelism=parallelism,
                      compile_config=CompileConfig(), ac_config=None, dump_folder="")
    tt_fsdp.disable_fsdp_gradient_division(model)
    if which == "torch":
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return model


def train(model: torch.nn.Module, rank: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 2048, (2, 33), generator=gen)
        logits = model(tokens[:, :-1])
        total = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1),
            reduction="sum")
        global_tokens = torch.tensor(float(tokens[:, 1:].numel()))
        dist.all_reduce(global_tokens)
        (total / global_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(total.item() / tokens[:, 1:].numel())
    return losses


def main(which: str, backend: str) -> None:
    patch_torchtitan_for_cpu()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = train(build(which, backend, world), rank)
    print(f"LOSSES rank{rank} {' '.join(repr(x) for x in losses)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
