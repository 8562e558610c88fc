"""PeerOutbox over real ZeroMQ sockets on loopback: a peer that never reads is dropped and counted,
the loop never waits on it, and a reading peer gets every reply meanwhile."""

from __future__ import annotations

import zmq

import protocols as P
from asyncrl.controller.outbox import PeerOutbox
from asyncrl.transport import ZmqChannel


def test_a_peer_that_does_not_read_is_dropped_and_a_reading_peer_gets_every_reply():
    router = ZmqChannel.bind(zmq.ROUTER, "tcp://127.0.0.1:0", name="ctl", hwm=50)
    reader = ZmqChannel.connect(zmq.DEALER, router.address, identity=b"reader")
    hog = ZmqChannel.connect(zmq.DEALER, router.address, identity=b"hog", hwm=50)
    dropped = []
    outbox = PeerOutbox(router.send, max_pending=20, on_drop=dropped.append)
    hog_rcvbuf = 1  # the hog's socket reads nothing; its pipes fill
    hog._sock.setsockopt(zmq.RCVHWM, hog_rcvbuf)
    for ch, who in ((reader, "reader"), (hog, "hog")):
        ch.send(P.Heartbeat(peer_id=who, time=0.0))
    seen = set()
    while len(seen) < 2:
        env = router.recv(5.0)
        seen.add(env.peer)
    big = P.Error(code="busy", message="x" * 60_000)  # large replies fill the hog's socket buffers quickly
    got = 0
    turns = 0
    while not dropped or turns < 100:
        turns += 1
        for _ in range(10):  # the hog asks ten times per turn, the reader once
            outbox.put(b"hog", big)
        outbox.put(b"reader", P.NoWork(retry_after_s=0.05))
        outbox.flush()  # never waits: a full pipe to the hog leaves its replies queued
        assert reader.recv(10.0) is not None  # the reader's reply of this turn went out at once
        got += 1
        assert turns < 5000, "the hog was never dropped"
    assert dropped == [b"hog"] and outbox.muted(b"hog") and outbox.counters["control/peers_dropped"] == 1
    assert outbox.counters["control/reply_dropped"] > 0 and outbox.pending(b"hog") == 0
    muted_before = outbox.counters["control/muted_peer_reply_dropped"]  # the turns after the drop
    outbox.put(b"hog", P.NoWork())  # later replies to it are not even queued
    assert outbox.pending(b"hog") == 0 and outbox.counters["control/muted_peer_reply_dropped"] == muted_before + 1
    assert got == turns and outbox.pending(b"reader") == 0
    for ch in (reader, hog, router):
        ch.close()


def test_the_learner_is_never_dropped_and_a_disconnected_peer_loses_only_its_own_replies():
    router = ZmqChannel.bind(zmq.ROUTER, "tcp://127.0.0.1:0", name="ctl", hwm=5)
    learner = ZmqChannel.connect(zmq.DEALER, router.address, identity=b"learner", hwm=5)
    learner.send(P.Heartbeat(peer_id="learner", time=0.0))
    assert router.recv(5.0).peer == b"learner"
    outbox = PeerOutbox(router.send, max_pending=3)
    outbox.protected.add(b"learner")
    for _ in range(50):
        outbox.put(b"learner", P.NoWork())
    assert outbox.pending(b"learner") == 50 and not outbox.muted(b"learner")  # far past max_pending, kept
    outbox.flush()
    assert not outbox.muted(b"learner")
    n = 0
    while outbox.pending(b"learner") or n < 50:
        outbox.flush()
        if learner.recv(0.02) is not None:
            n += 1
    assert n == 50
    outbox.put(b"gone", P.NoWork())  # an identity that is not connected
    outbox.flush()
    assert outbox.pending(b"gone") == 0 and outbox.counters["control/reply_dropped"] == 1
    learner.close()
    router.close()
