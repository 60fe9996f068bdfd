"""Two workers on one host exchanging CUDA tensors under a device map (needs a GPU)."""

from __future__ import annotations

import multiprocessing as mp
import sys

import torch

import shardwise.rpc as rpc
from tests.harness.ports import reserved_port


def where_and_double(t: torch.Tensor):
    return str(t.device), t * 2


def _run(rank: int, port: int, q) -> None:
    last = torch.cuda.device_count() - 1
    maps = {"w1": {"cuda:0": f"cuda:{last}"}} if rank == 0 else {}
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                           device_maps=maps, rpc_timeout=60)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        x = torch.arange(1 << 20, device="cuda:0", dtype=torch.float32)
        dev, y = rpc.rpc_sync("w1", where_and_double, args=(x,))
        q.put((dev == f"cuda:{last}", str(y.device) == "cuda:0", bool(torch.equal(y, x * 2))))
    rpc.shutdown()


def main() -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with reserved_port() as port:  # until the workers are done: w0's store binds it
        procs = [ctx.Process(target=_run, args=(r, port, q)) for r in range(2)]
        for p in procs:
            p.start()
        result = q.get(timeout=100)
        for p in procs:
            p.join(30)
    print("cuda ok" if all(result) else f"cuda FAILED {result}")
    sys.exit(0 if all(result) else 1)


if __name__ == "__main__":
    main()
