"""torchtitan's own FSDP code on shardwise: its llama3 debug model, parallelized by
``parallelize_llama`` (``fully_shard`` per block, ``fully_shard([norm, lm_head])``,
``dp_mesh_dims`` under its default ``spmd_types`` backend, ``set_gradient_divide_factor(1.0)``)
with shardwise's ``fully_shard`` swapped in, gives torch FSDP2's per-step losses on 2 ranks
(torchrun, gloo). The program and the CPU patch it needs: torchtitan_llama3.py."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (CI installs it)")
pytestmark = pytest.mark.slow

PROGRAM = Path(__file__).with_name("torchtitan_llama3.py")
RTOL = 1e-6


def _losses(which: str, backend: str) -> dict[str, list[float]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(PROGRAM), which, backend],
        capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = re.findall(r"^LOSSES (rank\d) (.*)$", done.stdout, flags=re.M)
    assert len(lines) == 2, done.stdout[-2000:]
    return {rank: [float(x) for x in values.split()] for rank, values in lines}


def test_torchtitans_parallelize_with_our_fully_shard_gives_fsdp2s_losses():
    theirs = _losses("torch", "partial_dtensor")  # torch refuses spmd_types' plain parameters
    for backend in ("spmd_types", "partial_dtensor"):
        ours = _losses("shardwise", backend)
        for rank, expected in theirs.items():
            assert len(ours[rank]) == len(expected)
            for step, (mine, torch_loss) in enumerate(zip(ours[rank], expected, strict=True)):
                assert abs(mine - torch_loss) <= RTOL * abs(torch_loss), (
                    f"{backend}, {rank}, step {step}: ours {mine}, torch {torch_loss}")
