"""rpc_sync / rpc_async / remote with every kind of payload, remote errors and timeouts."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import shardwise.rpc as rpc
from tests.rpc import helpers


def _payload():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    return {
        "scalar": torch.tensor(3.5),  # 0-dim
        "noncontig": base.t()[::2],  # transposed and strided
        "nested": [base[:2], (torch.arange(5), {"deep": torch.ones(2, 2, dtype=torch.bool)})],
        "dtypes": [base.to(torch.bfloat16), base.to(torch.float16), base.to(torch.complex64),
                   torch.randint(0, 9, (4,), dtype=torch.int64, generator=g)],
        "empty": torch.empty(0, 3),
        "other": ("text", 7, None, 2.5),
    }


def _assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.mark.fresh
def test_rpc_sync_positional_and_keyword(rpc_world):
    x = torch.arange(6.0).reshape(2, 3)
    got = rpc.rpc_sync("worker1", helpers.add, args=(x, torch.ones(3)), kwargs={"scale": 2})
    assert torch.equal(got, (x + 1) * 2)
    assert torch.equal(rpc.rpc_sync(1, torch.add, args=(x, 5)), x + 5)  # by rank, torch func


def test_payload_round_trip_every_call_type(rpc_world):
    payload = _payload()
    args, kwargs = rpc.rpc_sync("worker1", helpers.echo, args=(payload, 1), kwargs={"k": payload})
    _assert_same(args, (payload, 1))
    _assert_same(kwargs, {"k": payload})
    fut = rpc.rpc_async("worker2", helpers.echo, args=(payload,), kwargs={"flag": True})
    assert isinstance(fut, torch.futures.Future)
    args, kwargs = fut.wait()
    _assert_same(args, (payload,))
    assert kwargs == {"flag": True}
    rref = rpc.remote("worker2", helpers.echo, args=(payload,), kwargs={"n": 3})
    args, kwargs = rref.to_here()
    _assert_same(args, (payload,))
    assert kwargs == {"n": 3}


def test_noncontiguous_tensor_arrives_with_its_values(rpc_world):
    base = torch.randn(64, 32)
    view = base[:, 1::3]
    assert not view.is_contiguous()
    got = rpc.rpc_sync("worker1", helpers.identity, args=(view,))
    assert torch.equal(got, view)


def test_tensor_requiring_grad_keeps_the_flag_and_parameters_stay_parameters(rpc_world):
    p = torch.nn.Parameter(torch.randn(3))
    t = torch.randn(2, requires_grad=True)
    got_p, got_t = rpc.rpc_sync("worker1", helpers.identity, args=((p, t),))
    assert isinstance(got_p, torch.nn.Parameter) and torch.equal(got_p, p)
    assert got_t.requires_grad and torch.equal(got_t, t)


def test_256_mb_tensor_round_trip(rpc_world):
    big = torch.empty(64 * 1024 * 1024, dtype=torch.float32)  # 256 MiB
    big[::4096] = torch.arange(big[::4096].numel(), dtype=torch.float32)
    got = rpc.rpc_sync("worker1", helpers.identity, args=(big,))
    assert got.shape == big.shape and torch.equal(got[::4096], big[::4096])
    assert torch.equal(got, big)
    del got, big


def test_many_calls_in_flight(rpc_world):
    futs = [rpc.rpc_async(f"worker{1 + i % 2}", helpers.add, args=(torch.tensor(float(i)),))
            for i in range(300)]
    assert [f.wait().item() for f in futs] == [i + 1.0 for i in range(300)]


def test_concurrent_callers_with_mixed_sizes_each_get_their_own_answer(rpc_world):
    # Frames from several threads share one connection (queued and sent together) and arrive
    # in batches (small ones through the reader's buffer, large ones straight into tensors).
    sizes = [0, 1, 256, 20_000, 300_000, 3]
    errors: list[BaseException] = []

    def caller(thread: int) -> None:
        try:
            futs = []
            for i in range(60):
                x = torch.full((sizes[i % len(sizes)],), float(thread * 1000 + i))
                futs.append((x, rpc.rpc_async(f"worker{1 + i % 2}", helpers.add, args=(x,))))
            for x, fut in futs:
                got = fut.wait()
                assert got.shape == x.shape and torch.equal(got, x + 1)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_blocking_calls_get_threads_of_their_own(rpc_world):
    # Eight calls that each wait until all eight run: the callee's pool must run them at once.
    futs = [rpc.rpc_async("worker1", helpers.meet, args=("eight", 8)) for _ in range(8)]
    assert sorted(f.wait() for f in futs) == list(range(8))


def test_call_to_self_runs_locally(rpc_world):
    assert rpc.rpc_sync("worker0", helpers.add, args=(2,), kwargs={"b": 3}) == 5
    rref = rpc.remote("worker0", helpers.Tracked, args=(9,))
    assert rref.is_owner() and rref.to_here().value == 9


def test_nested_rpc_from_a_callee(rpc_world):
    assert rpc.rpc_sync("worker1", helpers.call_other, args=("worker2", helpers.my_name)) \
        == "worker2"


def test_callee_calls_back_into_a_caller_that_waits_for_it(rpc_world):
    # worker0 reads its connection to worker1 itself while it waits; worker1 runs the call on
    # its reader and calls worker0 back over the same connection
    assert rpc.rpc_sync("worker1", helpers.call_other, args=("worker0", helpers.my_name)) \
        == "worker0"
    futs = [rpc.rpc_async("worker1", helpers.call_other, args=("worker0", helpers.my_name))
            for _ in range(20)]
    assert [f.wait() for f in futs] == ["worker0"] * 20


def test_remote_exception_has_type_and_remote_traceback(rpc_world):
    with pytest.raises(ValueError) as info:
        rpc.rpc_sync("worker1", helpers.boom, args=("it broke",))
    text = str(info.value)
    assert "it broke" in text and "worker1" in text
    assert "helpers.py" in text and "in boom" in text  # the remote traceback
    fut = rpc.rpc_async("worker2", helpers.boom, args=("async too",))
    with pytest.raises(ValueError, match="async too"):
        fut.wait()
    rref = rpc.remote("worker2", helpers.boom, args=("remote too",))
    with pytest.raises(ValueError, match="remote too"):
        rref.to_here()


def test_timeouts_fire(rpc_world):
    with pytest.raises(TimeoutError, match="timed out after 0.3 s"):
        rpc.rpc_sync("worker1", helpers.sleep_then, args=(3.0,), timeout=0.3)
    fut = rpc.rpc_async("worker2", helpers.sleep_then, args=(3.0,), timeout=0.2)
    with pytest.raises(TimeoutError):
        fut.wait()
    rref = rpc.remote("worker1", helpers.sleep_then, args=(2.0, "late"))
    with pytest.raises(TimeoutError):
        rref.to_here(timeout=0.2)
    assert rref.to_here(timeout=10) == "late"  # the value still arrives


def test_worker_info_and_bad_destinations(rpc_world):
    info = rpc.get_worker_info("worker2")
    assert (info.name, info.id) == ("worker2", 2)
    assert rpc.get_worker_info().name == "worker0"
    with pytest.raises(ValueError, match="unknown RPC worker 'nobody'"):
        rpc.rpc_sync("nobody", helpers.identity, args=(1,))


def test_functions_must_be_importable_by_name(rpc_world):
    with pytest.raises(TypeError, match="importable name"):
        rpc.rpc_sync("worker1", lambda: 1)

    def local():
        return 1

    with pytest.raises(TypeError, match="importable name"):
        rpc.rpc_sync("worker1", local)


def test_peer_cannot_name_dangerous_functions(rpc_world):
    with pytest.raises(rpc.ForbiddenCallable, match="never resolves"):
        rpc.rpc_sync("worker1", os.getpid)
    with pytest.raises(rpc.ForbiddenCallable, match="never resolves"):
        rpc.rpc_sync("worker1", eval, args=("1+1",))
    # the worker still serves
    assert rpc.rpc_sync("worker1", helpers.add, args=(1,)) == 2
