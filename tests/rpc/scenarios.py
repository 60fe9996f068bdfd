"""Small multi-process RPC programs for test_shutdown / test_shared_store, one per mode.

``python -m tests.rpc.scenarios MODE`` runs one rank (RANK, WORLD_SIZE, MASTER_ADDR /
MASTER_PORT as a launcher sets them) and prints ``key: value`` lines that the tests read;
:func:`run` starts every rank of a mode and returns each rank's output.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import shardwise.rpc as rpc
from shardwise.rpc import autograd as dist_autograd
from shardwise.rpc.current import get_agent

SHORT = 1.0  # seconds: the RPC timeout of the shutdown scenarios; serving lasts 3 x longer
STEPS, PAUSE = 6, 0.5


def run(mode: str, world: int, timeout: float = 120, extra_env=None) -> list[tuple[int, str]]:
    """Start ``world`` ranks of ``mode``; returns (exit code, stdout + stderr) per rank."""
    from tests.harness.ports import reserved_port

    with reserved_port() as port:  # until the ranks are done: rank 0's store binds it
        return _run_ranks(mode, world, timeout, port, extra_env)


def _run_ranks(mode, world, timeout, port, extra_env) -> list[tuple[int, str]]:
    from tests.harness import procs
    from tests.rpc.conftest import ROOT, python_path

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WORLD_SIZE=str(world), PYTHONPATH=python_path(), OMP_NUM_THREADS="1",
               **(extra_env or {}))
    # each rank a process of its own, started by tests/harness/procs.py
    programs = [procs.start(["-m", "tests.rpc.scenarios", mode], dict(env, RANK=str(r)), ROOT)
             for r in range(world)]
    out = procs.outputs(programs, timeout)
    return out


def lines(text: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)


# ---------------------------------------------------------------- parameter server
def make_model(seed: int) -> nn.Module:
    """The same weights for a seed, whichever thread builds it: the parameter server builds
    the trainers' models concurrently in its RPC threads, so seeding the process-wide RNG
    (torch.manual_seed) would let one trainer's model draw from another's seed."""
    gen = torch.Generator().manual_seed(seed)
    model = nn.Linear(4, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.rand(p.shape, generator=gen) - 0.5)
    return model


def param_rrefs(model_rref) -> list:
    return [rpc.RRef(p) for p in model_rref.local_value().parameters()]


def forward(model_rref, x):
    return model_rref.local_value()(x)


def weights(model_rref) -> list:
    return [p.detach().clone() for p in model_rref.local_value().parameters()]


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)


def _train_on_ps(rank: int, die_at: int | None) -> None:
    model = rpc.remote("ps", make_model, args=(rank,))
    opt = rpc.DistributedOptimizer(torch.optim.SGD,
                                   rpc.rpc_sync("ps", param_rrefs, args=(model,)), lr=0.1)
    reference = make_model(rank)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(STEPS):
        if step == die_at:
            os._exit(3)
        time.sleep(PAUSE)  # the trainer's other work: the job outlasts the RPC timeout
        x, y = _batch(rank, step)
        with dist_autograd.context() as cid:
            loss = nn.functional.mse_loss(rpc.rpc_sync("ps", forward, args=(model, x)), y)
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    got = rpc.rpc_sync("ps", weights, args=(model,))
    diff = max((a - b).abs().max().item() for a, b in zip(got, reference.parameters()))
    print(f"weights equal: {all(torch.equal(a, b) for a, b in zip(got, reference.parameters()))}")
    print(f"weights max diff: {diff:.3g}")


def _marker(rank: int) -> Path:
    return Path(os.environ["SCENARIO_DIR"]) / f"trainer{rank}.done"


def ps_shutdown(rank: int, world: int, die: int | None = None) -> None:
    """The parameter server calls shutdown() right after init_rpc (pytorch/examples)."""
    opts = rpc.TensorPipeRpcBackendOptions(rpc_timeout=SHORT, connect_timeout=30)
    name = "ps" if rank == 0 else f"trainer{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=opts)
    if rank != 0:
        _train_on_ps(rank, STEPS // 2 if rank == die else None)
        _marker(rank).touch()
    try:
        rpc.shutdown()
        print("shutdown: returned")
    except Exception as exc:  # noqa: BLE001 - printed for the test
        print(f"shutdown: {type(exc).__name__}: {exc}")
    if rank == 0:
        live = [r for r in range(1, world) if r != die]
        print(f"trainers done before ps left: {all(_marker(r).exists() for r in live)}")


# ---------------------------------------------------------------- store shared with c10d
def _rpc_round(rank: int, world: int) -> None:
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)
    peer = f"worker{(rank + 1) % world}"
    print(f"rpc: {rpc.rpc_sync(peer, torch.add, args=(torch.tensor(rank), 10)).item()}")


def _allreduce(rank: int) -> None:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print(f"allreduce: {t.item()}")


def shared_store(rank: int, world: int, order: str) -> None:
    """init_process_group and init_rpc on one MASTER_ADDR / MASTER_PORT, in either order."""
    if order == "pg_first":
        dist.init_process_group("gloo", rank=rank, world_size=world)
        _rpc_round(rank, world)
    elif order == "rpc_first":
        _rpc_round(rank, world)
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:  # shardwise's own init, whose store is not multi-tenant: RPC uses the group's
        from shardwise.distributed import init

        init("gloo")
        _rpc_round(rank, world)
    _allreduce(rank)
    rpc.shutdown()
    dist.destroy_process_group()
    print("done: yes")


# ---------------------------------------------------------------- init / shutdown cycles
def _counts() -> tuple[int, int]:
    return threading.active_count(), len(os.listdir("/proc/self/fd"))


def _refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError:
        return True
    return False


def cycles(rank: int, world: int, n: int = 10) -> None:
    """``n`` init_rpc / shutdown rounds (each with a call to the next worker); prints the
    thread and file-descriptor counts after the first and the last, and whether the agent's
    port and (rank 0) the store it hosted refuse connections after shutdown."""
    counts, ports_refused, store_refused = [], [], []
    store_port = int(os.environ["MASTER_PORT"])
    for _ in range(n):
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)
        peer = f"worker{(rank + 1) % world}"
        assert rpc.rpc_sync(peer, torch.add, args=(torch.tensor(rank), 10)).item() == rank + 10
        port = get_agent().transport.port
        rpc.shutdown()
        gc.collect()
        counts.append(_counts())
        ports_refused.append(_refused("127.0.0.1", port))
        if rank == 0:
            store_refused.append(_refused("127.0.0.1", store_port))
        dist_barrier_file(rank, world)
    print(f"first: {counts[0]}")
    print(f"last: {counts[-1]}")
    print(f"rpc port refused: {all(ports_refused)}")
    if rank == 0:
        print(f"store refused: {all(store_refused)}")


def dist_barrier_file(rank: int, world: int) -> None:
    """Wait until every rank finished this round (files: the store is closed between rounds),
    so rank 0 re-hosts the store only when nobody still talks to the old one."""
    where = Path(os.environ["SCENARIO_DIR"])
    n = len(list(where.glob(f"round*_r{rank}")))
    (where / f"round{n}_r{rank}").touch()
    while not all((where / f"round{n}_r{r}").exists() for r in range(world)):
        time.sleep(0.01)


def main() -> None:
    mode = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    # first use of an optimizer imports seconds' worth of torch: not inside a 1 s RPC
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1).step()
    if mode == "cycles":
        cycles(rank, world)
    elif mode == "ps_shutdown":
        ps_shutdown(rank, world)
    elif mode == "ps_dead_trainer":
        ps_shutdown(rank, world, die=1)
    else:
        shared_store(rank, world, mode)


if __name__ == "__main__":
    main()
