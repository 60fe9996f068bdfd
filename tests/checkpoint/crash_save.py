"""Run as a script: save a checkpoint and die (os._exit) at a given point of the save.

    python crash_save.py DIR POINT INDEX MODE      MODE: sync | async
"""

import os
import sys

import torch

from shardwise.checkpoint import async_save, save


def main() -> None:
    directory, point, index, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]

    def die(at: str, i: int) -> None:
        if at == point and i == index:
            os._exit(17)

    state = {"a": torch.full((50, 40), 2.0), "b": torch.full((40,), 2.0), "v": 2}
    if mode == "sync":
        save(state, checkpoint_id=directory, _fault_hook=die)
    else:
        async_save(state, checkpoint_id=directory, _fault_hook=die).result()
    os._exit(0)


if __name__ == "__main__":
    main()
