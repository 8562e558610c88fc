"""Two real processes exchange every message kind over tcp and ipc; backpressure bounds memory."""

from __future__ import annotations

import os

import numpy as np
import psutil
import pytest
import zmq

import protocols as P
from asyncrl.transport import ChannelTimeout, ZmqChannel
from tests.integration.wire_peer import example_messages, payload

pytestmark = pytest.mark.integration
PEER = os.path.join(os.path.dirname(__file__), "wire_peer.py")


def test_examples_cover_every_message_kind():
    assert {type(m) for m in example_messages()} == set(P.MESSAGE_TYPES)


@pytest.fixture(params=["tcp", "ipc"])
def address(request, tmp_path):
    return "tcp://127.0.0.1:0" if request.param == "tcp" else f"ipc://{tmp_path}/sock"


def test_router_echoes_every_message_kind_to_a_dealer_process(procs, address):
    with ZmqChannel.bind(zmq.ROUTER, address) as router:
        child = procs.python(PEER, "dealer", router.address)
        seen = []
        for _ in example_messages():
            env = router.recv(30.0)
            assert env is not None, "dealer process sent nothing"
            seen.append(type(env.msg))
            router.send(env.msg, to=env.peer, payload=env.payload)
        assert child.wait(timeout=30) == 0
        assert seen == [type(m) for m in example_messages()]
        assert router.stats.rejected_total == 0


def test_pull_receives_every_message_kind_pushed_by_another_process(procs, address):
    with ZmqChannel.bind(zmq.PULL, address) as pull:
        child = procs.python(PEER, "push", pull.address)
        got = []
        while True:
            env = pull.recv(30.0)
            assert env is not None
            if isinstance(env.msg, P.Shutdown) and env.msg.reason == "end":
                break
            got.append(env)
        assert child.wait(timeout=30) == 0
        assert [e.msg for e in got] == example_messages()
        chunk = next(e for e in got if isinstance(e.msg, P.WeightChunk))
        assert bytes(chunk.payload) == payload(chunk.msg)


def test_router_keeps_serving_after_garbage_frames_and_answers_with_error(procs):
    with ZmqChannel.bind(zmq.ROUTER, "tcp://127.0.0.1:0", reply_errors=True) as router, \
            ZmqChannel.connect(zmq.DEALER, router.address) as dealer:
        rng = np.random.default_rng(0)
        for _ in range(200):
            dealer.send_frames([rng.bytes(int(rng.integers(0, 64)))])
        dealer.send(P.Heartbeat(peer_id="w", time=1.0))
        env = router.recv(10.0)
        assert isinstance(env.msg, P.Heartbeat)
        assert router.stats.rejected_total == 200
        errors = [dealer.recv(5.0) for _ in range(200)]
        assert all(isinstance(e.msg, P.Error) for e in errors)


def test_push_blocks_at_the_high_water_mark_so_sender_memory_stays_bounded(procs):
    hwm, size = 4, 1 << 20
    with ZmqChannel.bind(zmq.PUSH, "tcp://127.0.0.1:0", hwm=hwm) as push:
        child = procs.python(PEER, "stall", push.address, str(hwm), stdout=-1)
        assert child.stdout.readline().strip() == b"ready"
        me = psutil.Process()
        rss0 = me.memory_info().rss
        blob = P.WeightChunk(version=0, index=0, count=1, name="x", dtype="uint8", shape=(size,), nbytes=size)
        data = bytes(size)
        sent = 0
        with pytest.raises(ChannelTimeout):
            for _ in range(10_000):
                push.send(blob, payload=data, timeout_s=1.0)
                sent += 1
        # Queued at most: our HWM + the receiver's HWM + what the kernel socket buffers hold.
        assert sent < 10_000
        assert sent <= 2 * hwm + 16, sent
        assert me.memory_info().rss - rss0 < (2 * hwm + 32) * size
