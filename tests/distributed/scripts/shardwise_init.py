"""shardwise's own init under a launcher (ours or torchrun), then one all-reduce."""

import torch
import torch.distributed as dist

from shardwise.distributed import destroy, init

init()
t = torch.ones(1)
dist.all_reduce(t)
print(f"rank {dist.get_rank()} backend={dist.get_backend()} total={int(t.item())}", flush=True)
destroy()
