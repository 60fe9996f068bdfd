"""CommCounter sees every collective torch.distributed issues and counts its logical bytes.

World size 4 as 2 nodes x 2 ranks (local_world_size=2). Expected figures are written out from
the formulas (n = 4, a float32 buffer of 12 elements = 48 bytes):
all-gather of a 48-byte shard: 3 x 48 sent, 2 x 48 of it to the other node; reduce-scatter of
48 bytes: 3 x 12 sent, 2 x 12 across; all-reduce of 48 bytes: 2 x 3/4 x 48 = 72 sent, 48 across.
"""


import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

from shardwise.distributed import CommCounter, CommStats, init_device_mesh
from shardwise.dp.fast_collectives import all_gather_flat, reduce_scatter_flat
from shardwise.dp.shm_reduce import DISABLE_VAR
from tests.harness import WORLD_SIZES, run_on_ranks

B = 48  # bytes of a 12-element float32 buffer


def _buf():
    return torch.arange(12, dtype=torch.float32) + dist.get_rank()


def _stats(comm, kind, group=None):
    s = comm.get(kind, group)
    return (s.calls, s.bytes, s.sent_bytes, s.cross_node_bytes)


def _each_kind_body(ctx):
    rank = ctx.rank
    with CommCounter(local_world_size=2) as comm:
        dist.broadcast(_buf(), src=1)
        dist.all_reduce(_buf())
        dist.all_gather_into_tensor(torch.empty(48), _buf())
        dist.all_gather([torch.empty(12) for _ in range(4)], _buf())
        dist.reduce_scatter_tensor(torch.empty(3), _buf())
        dist.all_to_all_single(torch.empty(12), _buf())
        dist.all_to_all_single(torch.empty(4 * (rank + 1), 1),
                               torch.ones(10, 1), output_split_sizes=[rank + 1] * 4,
                               input_split_sizes=[1, 2, 3, 4])
        dist.reduce(_buf(), dst=0)
        dist.gather(_buf(), [torch.empty(12) for _ in range(4)] if rank == 0 else None, dst=0)
        dist.scatter(torch.empty(12), [_buf() for _ in range(4)] if rank == 0 else None, src=0)
        ops = [dist.P2POp(dist.isend, _buf(), (rank + 1) % 4),
               dist.P2POp(dist.irecv, torch.empty(12), (rank - 1) % 4)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        dist.barrier()
    kinds = ("broadcast", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "reduce",
             "gather", "scatter", "send", "recv", "barrier")
    return {k: _stats(comm, k) for k in kinds}, set(comm.group_ranks.values())


def test_each_kind_is_counted_by_its_formula_on_2_nodes_of_2():
    results = run_on_ranks(4, _each_kind_body)
    for rank, (got, groups) in enumerate(results):
        assert groups == {(0, 1, 2, 3)}
        assert got["broadcast"] == ((1, B, 3 * B, 2 * B) if rank == 1 else (1, 0, 0, 0))
        assert got["all_reduce"] == (1, B, 72, 48)
        assert got["all_gather"] == (2, 2 * B, 2 * 3 * B, 2 * 2 * B)  # two all-gathers
        # reduce-scatter: part i (12 bytes) to rank i
        assert got["reduce_scatter"] == (1, B, 36, 24)
        # all-to-all: equal parts of 12 bytes, then rows of 4 bytes split 1, 2, 3, 4
        remote = [2, 3] if rank < 2 else [0, 1]
        uneven_sent = 4 * (10 - (rank + 1))
        uneven_cross = 4 * sum(r + 1 for r in remote)
        assert got["all_to_all"] == (2, B + 40, 36 + uneven_sent, 24 + uneven_cross)
        to_root = 0 if rank == 0 else B
        assert got["reduce"] == (1, B, to_root, B if rank >= 2 else 0)
        assert got["gather"] == (1, B, to_root, B if rank >= 2 else 0)
        assert got["scatter"] == ((1, 4 * B, 3 * B, 2 * B) if rank == 0 else (1, 0, 0, 0))
        # ring of sends: 1 -> 2 and 3 -> 0 cross nodes
        assert got["send"] == (1, B, B, B if rank in (1, 3) else 0)
        assert got["recv"] == (1, 0, 0, 0)
        assert got["barrier"] == (1, 0, 0, 0)


def _release(mesh):
    """Destroy the mesh's own groups (never the world) so that the pool's long-lived ranks do
    not pile up a group per test."""
    for group in {id(g): g for g in mesh.get_all_groups()}.values():
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)


def _subgroups_body(ctx):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with CommCounter(local_world_size=2) as comm:
        dist.all_reduce(_buf(), group=mesh.get_group("dp"))  # {0, 2}, {1, 3}: across nodes
        dist.all_reduce(_buf(), group=mesh.get_group("tp"))  # {0, 1}, {2, 3}: inside a node
    seen = (_stats(comm, "all_reduce", mesh.get_group("dp")),
            _stats(comm, "all_reduce", mesh.get_group("tp")),
            comm.group_ranks[mesh.get_group("dp").group_name], comm.table())
    _release(mesh)
    return seen


def test_groups_are_counted_apart_and_nodes_follow_global_ranks():
    for rank, (dp, tp, dp_ranks, table) in enumerate(run_on_ranks(4, _subgroups_body)):
        assert dp == (1, B, B, B)  # 2 (n-1)/n B = B with n = 2, all of it to the other node
        assert tp == (1, B, B, 0)
        assert dp_ranks == (rank % 2, rank % 2 + 2)
        assert "all_reduce" in table and str(list(dp_ranks)) in table


def _fast_body(ctx, impl):
    n = ctx.world_size
    shard, full = torch.arange(6, dtype=torch.float32), torch.arange(6.0 * n)
    with CommCounter(local_world_size=2) as comm:
        all_gather_flat(torch.empty(6 * n), shard, impl=impl)
    gathered = comm.get()
    with CommCounter(local_world_size=2) as comm:
        reduce_scatter_flat(torch.empty(6), full, impl=impl)
    scattered = comm.get()
    return (gathered.bytes, gathered.sent_bytes, gathered.cross_node_bytes,
            scattered.sent_bytes, scattered.cross_node_bytes,
            sorted({k for k, _ in comm.counts}))


@pytest.mark.parametrize("world_size", (2, 4))
def test_fast_collectives_count_the_logical_bytes_of_the_plain_ones(world_size):
    fast = run_on_ranks(world_size, _fast_body, "fast")
    plain = run_on_ranks(world_size, _fast_body, "plain")
    n, shard = world_size, 24
    for rank in range(world_size):
        assert fast[rank][:5] == plain[rank][:5]
        remote = 2 if world_size == 4 else 0
        assert plain[rank][:5] == (shard, (n - 1) * shard, remote * shard,
                                   (n - 1) * shard, remote * shard)
        assert fast[rank][5] == ["recv", "send"] and plain[rank][5] == ["reduce_scatter"]


def _backward_and_dtensor_body(ctx):
    lin = torch.nn.Linear(4, 4)
    lin.weight.register_hook(lambda g: dist.all_reduce(g) or g)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    with CommCounter(local_world_size=2) as comm:
        lin(torch.ones(2, 4)).sum().backward()  # the hook's all-reduce runs inside backward
        dt = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])
        dt.full_tensor()  # a functional all-gather of the 8 / n x 4 shard
    return _stats(comm, "all_reduce"), _stats(comm, "all_gather")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_collectives_in_backward_hooks_and_in_dtensor_are_seen(world_size):
    n = world_size
    for reduced, gathered in run_on_ranks(world_size, _backward_and_dtensor_body):
        assert reduced[:3] == (1, 64, 2 * (n - 1) * 64 // n)
        shard = 8 // n * 4 * 4  # DTensor skips the all-gather on a mesh of one rank
        assert gathered[:3] == ((1, shard, (n - 1) * shard) if n > 1 else (0, 0, 0))


def _off_body(ctx):
    before = (dist.all_reduce, dist.broadcast, torch._C._len_torch_dispatch_stack())
    comm = CommCounter(local_world_size=1)
    dist.all_reduce(_buf())  # not entered yet: not counted
    with comm:
        inside = torch._C._len_torch_dispatch_stack()
        dist.all_reduce(_buf())
    dist.all_reduce(_buf())  # after the block: not counted
    after = (dist.all_reduce, dist.broadcast, torch._C._len_torch_dispatch_stack())
    return before == after, before[2], inside, comm.get()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_nothing_is_left_installed_outside_the_block(world_size):
    n = world_size
    for same, outside, inside, total in run_on_ranks(world_size, _off_body):
        assert same and outside == 0 and inside == 1
        assert total == CommStats(1, 48, 2 * (n - 1) * 48 // n, 2 * (n - 1) * 48 // n)


def test_bad_arguments_are_errors():
    with pytest.raises(ValueError, match="local_world_size must be positive"):
        CommCounter(local_world_size=0)
    with pytest.raises(ValueError, match="unknown collective kind 'allreduce'"):
        CommCounter().get("allreduce")


def _ddp_body(ctx):
    from shardwise import DistributedDataParallel
    from shardwise.models import GPT, GPTConfig, lm_loss

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=2, d_model=16)
    # the gloo path's collectives are what this counts (on one host DDP would otherwise
    # average through shared memory: tests/dp/test_shm_reduce.py)
    with pytest.MonkeyPatch.context() as patch, CommCounter(local_world_size=2) as comm:
        patch.setenv(DISABLE_VAR, "1")
        model = DistributedDataParallel(GPT(cfg))
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1))
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    state = sum(t.numel() * 4 for t in model.module.state_dict().values())
    grads = sum(p.grad.numel() * 4 for p in model.parameters())
    return _stats(comm, "broadcast"), _stats(comm, "all_reduce"), state, grads


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ddp_wrap_and_backward_are_counted(world_size):
    n = world_size
    for rank, (bcast, reduced, state, grads) in enumerate(run_on_ranks(world_size, _ddp_body)):
        if n == 1:  # nothing to communicate: DDP issues no collective
            assert bcast == reduced == (0, 0, 0, 0)
            continue
        # rank 0's state reaches the others at wrap time
        assert bcast[1:3] == ((state, (n - 1) * state) if rank == 0 else (0, 0))
        # every gradient is all-reduced once, from its bucket during backward; plus, at wrap
        # time, the ranks' 4-byte agreement on the reduction path (gloo or shared memory) and
        # the model agreement's two 8-byte all-reduces (dp/agree.py)
        assert reduced[0] >= 4 and reduced[1] == grads + 4 + 2 * 8
        expected = 2 * (n - 1) * grads / n  # up to one element's rounding per bucket
        assert abs(reduced[2] - expected) <= 4 * reduced[0] * n
