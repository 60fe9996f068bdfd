"""Who reads a connection ([Note: reading role] in connection.py), over both channels: a thread
waiting for its reply reads it itself; a call is run by the reader that read it while the other
reader goes on reading; a second call while one runs goes to the pool (``defer``)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.rpc.pairs import shm_pair, tcp_pair


@pytest.fixture(params=["tcp", "shm"])
def make_pair(request):
    made = []

    def make(on_frame, defer=None):
        pair = (tcp_pair if request.param == "tcp" else shm_pair)(on_frame, lambda *_: None,
                                                                   defer)
        made.append(pair)
        return pair

    yield make
    for pair in made:
        for conn in pair:
            conn.close()
        for conn in pair:
            conn.join(10)


def test_a_thread_waiting_for_its_reply_reads_it_itself(make_pair):
    fut, seen = torch.futures.Future(), []

    def on_frame(peer, payload, buffers):
        seen.append((bytes(payload), threading.current_thread()))
        if bytes(payload) == b"reply":
            fut.set_result(None)

    sender, reader = make_pair(on_frame)
    later = threading.Timer(0.3, sender.send, args=(b"reply", []))
    later.start()
    reader.wait_reply(fut)  # returns once the reply was read (by this thread)
    assert fut.done()
    assert seen == [(b"reply", threading.current_thread())]
    later.join()
    # afterwards the reader threads read again
    got = threading.Event()
    seen.clear()
    reader._on_frame = lambda *a: got.set()
    sender.send(b"next", [])
    assert got.wait(10)


def test_a_call_runs_on_the_reader_while_the_other_reader_reads(make_pair):
    release, ran_on, deferred = threading.Event(), [], []

    def blocking_call():
        ran_on.append(threading.current_thread().name)
        assert release.wait(20)  # set by a frame that arrives while this call runs

    def on_frame(peer, payload, buffers):
        if bytes(payload) == b"call":
            return blocking_call
        if bytes(payload) == b"release":
            release.set()
        return None

    sender, reader = make_pair(on_frame, defer=deferred.append)
    sender.send(b"call", [])
    deadline = time.monotonic() + 10
    while not ran_on and time.monotonic() < deadline:
        time.sleep(0.01)
    sender.send(b"release", [])
    assert release.wait(10)
    assert ran_on and ran_on[0].startswith(reader.reader_name), ran_on
    assert deferred == []


def test_a_second_call_while_one_runs_goes_to_the_pool(make_pair):
    release, started, deferred = threading.Event(), threading.Event(), []

    def first():
        started.set()
        assert release.wait(20)

    def second():
        pass

    def on_frame(peer, payload, buffers):
        name = bytes(payload)
        if name == b"first":
            return first
        if name == b"second":
            return second
        if name == b"release":
            release.set()
        return None

    sender, reader = make_pair(on_frame, defer=deferred.append)
    sender.send(b"first", [])
    assert started.wait(10)
    sender.send(b"second", [])
    sender.send(b"release", [])
    assert release.wait(10)
    deadline = time.monotonic() + 10
    while second not in deferred and time.monotonic() < deadline:
        time.sleep(0.01)
    assert deferred == [second]
