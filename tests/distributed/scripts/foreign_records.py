"""A healthy two-node job into whose store someone copies the launcher records of another job
that used the same secret (``SHARDWISE_RPC_SECRET``, as multi-node jobs set): rank 0 (node 0)
runs a thread that, for the job's whole life, writes every millisecond the record named by
``argv[1]`` as the other job's launcher signed it, both under the constant scope launchers
signed with before records were bound to their job and under another job's identity (a lost
mark and "finished": under the constant scope only, so that the record stays one value). Each
rank then sleeps ``argv[2]`` seconds (node 1's ranks ``argv[3]`` more), and node 1's ranks
check that the store (node 0's launcher) is still there, then each exits 0. With SECONDS
``until-told``, the ranks wait instead until the test sets the store key ``test/told``.
Usage: foreign_records.py {failed|job_stopped|finished|node_lost} SECONDS|until-told EXTRA"""

import os
import secrets
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from shardwise.distributed import signed_store
from shardwise.launch import job_secret

RECORDS = {
    "failed": [("shardwise/attempt_0/failed/1",
                "shardwise: rank 1 failed (it raised)\nTraceback: another job's error")],
    "job_stopped": [("shardwise/job_stopped", "node 1's launcher received SIGTERM")],
    "finished": [("shardwise/attempt_0/finished/1", "1")],
    "node_lost": [("shardwise/node_lost/1", "1"), ("shardwise/next_attempt", "0")],
}
OLD_SCOPE = "shardwise-launcher"


def copy(kind: str, stop: threading.Event) -> None:
    secret = job_secret.of_rank()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=30))
    other_job = f"{OLD_SCOPE}|job={secrets.token_hex(32)}"
    scopes = (OLD_SCOPE,) if kind in ("node_lost", "finished") else (OLD_SCOPE, other_job)
    sealed = [(key, signed_store.seal(key, value, secret, scope))
              for key, value in RECORDS[kind] for scope in scopes]
    while not stop.is_set():
        for key, raw in sealed:
            store.set(key, raw)
            time.sleep(0.001)


def main() -> None:
    kind, seconds, extra = sys.argv[1], sys.argv[2], float(sys.argv[3])
    stop = threading.Event()
    if os.environ["RANK"] == "0":
        threading.Thread(target=copy, args=(kind, stop), daemon=True).start()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=30))
    print(f"rank {os.environ['RANK']} pid {os.getpid()}", flush=True)
    node = os.environ["GROUP_RANK"]
    if seconds == "until-told":
        store.wait(["test/told"], timedelta(seconds=600))
    else:
        time.sleep(float(seconds) + (extra if node == "1" else 0.0))
    stop.set()
    if node == "1":
        try:
            store.set(f"still_there/{os.environ['RANK']}", "1")
        except (RuntimeError, dist.DistError) as exc:
            print(f"rank {os.environ['RANK']}: the store was gone ({exc})", flush=True)
    print(f"rank {os.environ['RANK']} done", flush=True)


if __name__ == "__main__":
    main()
