"""An RPC worker for the tests' shared pool: init (env://, as under torchrun), serve, stop."""

from __future__ import annotations

import logging
import os
import sys

import torch

import shardwise.rpc as rpc
from tests.rpc import helpers


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    opts = rpc.TensorPipeRpcBackendOptions(rpc_timeout=30, num_worker_threads=8)
    rpc.init_rpc(f"worker{rank}", rank=rank, rpc_backend_options=opts)
    helpers.STOP.wait(timeout=float(os.environ.get("RPC_WORKER_LIFETIME", "600")))
    rpc.shutdown(graceful=True, timeout=20)


if __name__ == "__main__":
    main()
