"""The launchers' own connections (launch/node_link.py, node_peers.py): only a holder of the
job's secret, in the same attempt of the same job, can connect; a recorded handshake cannot be
replayed; a client that never finishes its handshake blocks no one; a node is lost when its
connection closes without a "bye" or goes silent, and only then."""

import logging
import socket
import threading
import time

import pytest

from shardwise.launch import node_link
from shardwise.launch.node_peers import Hub, Member, probe

SECRET = b"job secret"
CONTEXT = b"i" * 32 + (0).to_bytes(4, "big")  # an attempt's identity and number


@pytest.fixture
def hub():
    h = Hub("127.0.0.1", 3, SECRET, timeout=30.0)
    h.job_id = b"j" * 32
    h.begin(0, CONTEXT)
    yield h
    h.close()


def _member(hub, node, secret=SECRET, context=CONTEXT, attempt=0, timeout=30.0):
    m = Member(node, 3, secret, timeout, "127.0.0.1", hub.port)
    m.begin(attempt, context)
    _until(lambda: node in hub.round.channels, f"the hub admitted node {node}")
    return m


def _until(predicate, what):
    deadline = time.monotonic() + 60  # only stops a hang: each event comes within a beat
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_members_with_the_secret_connect_and_hear_each_others_reports(hub):
    one, two = _member(hub, 1), _member(hub, 2)
    _until(lambda: hub.heard_since(time.monotonic() - 5), "both members beat")
    assert hub.lost(time.monotonic()) == [] and one.lost(time.monotonic()) == []
    one.send("failed", text="rank 2 raised")
    _until(lambda: two.failure() is not None, "the hub relays node 1's report")
    assert hub.failure() == (1, "rank 2 raised") and two.failure() == (1, "rank 2 raised")
    two.close()
    one.close()


@pytest.mark.parametrize("who", ["another secret", "another job", "another attempt"])
def test_a_launcher_of_another_secret_job_or_attempt_cannot_connect(hub, who, caplog):
    kwargs = {"another secret": {"secret": b"other secret"},
              "another job": {"context": b"j" * 32 + (0).to_bytes(4, "big")},
              "another attempt": {"context": b"i" * 32 + (1).to_bytes(4, "big"),
                                  "attempt": 1}}[who]
    with caplog.at_level(logging.WARNING, "shardwise.launch"), \
            pytest.raises(node_link.LinkError, match="could not reach node 0's launcher"):
        _member(hub, 1, timeout=1.0, **kwargs)
    _until(lambda: "dropped a connection" in caplog.text, "the hub logs what it dropped")
    assert hub.round.channels == {}


def test_a_recorded_handshake_cannot_be_replayed(hub, caplog):
    # record what a true member sends, through a relay, then send the same bytes again
    sent = bytearray()
    relay = socket.create_server(("127.0.0.1", 0))

    def forward():
        inner, _ = relay.accept()
        outer = socket.create_connection(("127.0.0.1", hub.port))
        hello = inner.recv(node_link._HELLO)
        sent.extend(hello)
        outer.sendall(hello)
        inner.sendall(outer.recv(len(node_link.MAGIC) + node_link.NONCE_BYTES + 32))
        proof = inner.recv(32)
        sent.extend(proof)
        outer.sendall(proof)
        time.sleep(0.5)
        inner.close()
        outer.close()

    threading.Thread(target=forward, daemon=True).start()
    node_link.connect("127.0.0.1", relay.getsockname()[1], 1, node_link.MEMBER, 0,
                      node_link.link_key(SECRET, CONTEXT), 30.0).close()
    _until(lambda: 1 in hub.round.channels, "the true member was admitted")
    first = hub.round.channels[1]
    with caplog.at_level(logging.WARNING, "shardwise.launch"):
        replay = socket.create_connection(("127.0.0.1", hub.port))
        replay.sendall(bytes(sent))
        _until(lambda: "did not prove the job's secret" in caplog.text, "the replay is dropped")
        replay.close()
    assert hub.round.channels[1] is first  # the replay was never admitted as node 1


def test_a_client_that_never_finishes_its_handshake_blocks_no_one(hub):
    stalled = [socket.create_connection(("127.0.0.1", hub.port)) for _ in range(3)]
    stalled[0].sendall(node_link.MAGIC)  # half a hello, then nothing
    member = _member(hub, 1)
    _until(lambda: 1 in hub.round.channels, "the member is admitted")
    assert probe("127.0.0.1", hub.port, 1, SECRET, 30.0) == (True, b"j" * 32)
    assert probe("127.0.0.1", hub.port, 1, b"another secret", 30.0) is None
    member.close()
    for sock in stalled:
        sock.close()


def test_a_closed_connection_is_a_lost_node_and_a_bye_is_not(hub):
    one, two = _member(hub, 1), _member(hub, 2)
    two.close()  # says "bye"
    one.round.channels[0].sock.shutdown(socket.SHUT_RDWR)  # as when its launcher is killed
    _until(lambda: hub.lost(time.monotonic()) == [1], "node 1 is lost, node 2 left")
    _until(lambda: one.lost(time.monotonic()) == [0], "and node 1 lost node 0")
    assert probe("127.0.0.1", hub.port, 1, SECRET, 30.0) == (False, b"j" * 32)


def test_silence_for_the_timeout_is_a_lost_node():
    hub = Hub("127.0.0.1", 2, SECRET, timeout=30.0)
    hub.begin(0, CONTEXT)
    try:
        member = _member(hub, 1)
        now = time.monotonic()
        assert hub.lost(now) == [] and member.lost(now) == []
        assert hub.lost(now + 31) == [1] and member.lost(now + 31) == [0]
        assert not hub.never_connected([1])
        member.close()
    finally:
        hub.close()


def test_a_node_that_never_connects_is_lost_without_evidence():
    hub = Hub("127.0.0.1", 2, SECRET, timeout=30.0)
    hub.begin(0, CONTEXT)
    try:
        assert hub.lost(time.monotonic() + 31) == [1] and hub.never_connected([1])
    finally:
        hub.close()
