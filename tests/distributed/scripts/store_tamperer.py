"""A healthy job under `shardwise run` with an outsider in it: rank 0 also runs a thread that
knows only the rendezvous store's address (a plain TCPStore client, no secret) and, for the
job's whole life, deletes one record (by default rank 1's progress record; on two nodes, node
1's liveness record ``shardwise/node_beat/1``) or writes the first genuine copy it read back
over it, every millisecond. Every rank stays alive for ``argv[2]`` seconds, then exits 0.
Usage: store_tamperer.py {delete|replay} SECONDS [KEY]"""

import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

PROGRESS_OF_RANK_1 = "shardwise/progress/attempt_0/rank_1"


def tamper(mode: str, key: str, stop: threading.Event) -> None:
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=30))
    copy = None
    while not stop.is_set():
        if mode == "delete":
            store.delete_key(key)
        elif copy is None:
            copy = store.get(key) if store.check([key]) else None
        else:
            store.set(key, copy)
        time.sleep(0.001)


def main() -> None:
    mode, seconds = sys.argv[1], float(sys.argv[2])
    key = sys.argv[3] if len(sys.argv) > 3 else PROGRESS_OF_RANK_1
    stop = threading.Event()
    if os.environ["RANK"] == "0":
        threading.Thread(target=tamper, args=(mode, key, stop), daemon=True).start()
    time.sleep(seconds)
    stop.set()
    print(f"rank {os.environ['RANK']} done", flush=True)


if __name__ == "__main__":
    main()
