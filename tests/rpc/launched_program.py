"""init_rpc under a launcher (torchrun, ``shardwise run``, two ``shardwise run`` nodes): env://
as torch's RPC tutorial writes it, one call to the next worker, shutdown."""

from __future__ import annotations

import os

import torch

import shardwise.rpc as rpc


def where(x: torch.Tensor) -> tuple[str, torch.Tensor]:
    return rpc.get_worker_info().name, x + 1


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)
    name, value = rpc.rpc_sync(f"worker{(rank + 1) % world}", where, args=(torch.tensor(rank),))
    print(f"rpc ok: rank {rank} -> {name} = {value.item()}", flush=True)
    rpc.shutdown()


if __name__ == "__main__":
    main()
