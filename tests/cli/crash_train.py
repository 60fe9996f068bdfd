"""Run as a script: `shardwise train`'s loop in one process (ddp, world size 1), checkpoints
every 2 steps, killed (os._exit) at a given point of its second save.

    python crash_train.py CKPT_DIR STORE_FILE POINT INDEX MODE      MODE: sync | async
"""

import dataclasses
import os
import sys

import torch
import torch.distributed as dist

from shardwise.cli.train_loop import train
from tests.cli.test_resume_strategies import END, TINY


def main() -> None:
    directory, store, point, index, mode = sys.argv[1:6]
    firsts = []

    def die(at: str, i: int) -> None:
        if at == "chunk" and i == 0:
            firsts.append(at)  # the first chunk of each save
        if len(firsts) == 2 and at == point and i == int(index):
            os._exit(17)

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    cfg = dataclasses.replace(TINY, steps=END, checkpoint_dir=directory, checkpoint_every=2,
                              async_checkpoint=mode == "async")
    train(cfg, dist.group.WORLD, torch.device("cpu"), _fault_hook=die)
    os._exit(0)


if __name__ == "__main__":
    main()
