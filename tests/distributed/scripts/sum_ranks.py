"""Every rank joins (plain torch init: the launch env must be enough) and prints the rank sum."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
print(f"sum={int(t.item())} world={dist.get_world_size()}", flush=True)
dist.destroy_process_group()
