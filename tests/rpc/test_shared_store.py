"""init_process_group and init_rpc on one MASTER_PORT: one store, in either order."""

from __future__ import annotations

import pytest

from tests.rpc.scenarios import lines, run


@pytest.mark.parametrize("order", ["pg_first", "rpc_first", "shardwise_init"])
def test_process_group_and_rpc_share_master_port(order):
    ranks = run(order, 2)
    for rank, (code, text) in enumerate(ranks):
        assert code == 0, text
        out = lines(text)
        assert out["rpc"] == str(rank + 10), text  # the peer added 10 to this rank
        assert out["allreduce"] == "3.0" and out["done"] == "yes", text
