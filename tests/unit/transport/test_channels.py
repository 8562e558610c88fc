"""Channel semantics on real loopback sockets."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

import protocols as P
from asyncrl.transport import (
    ChannelClosed,
    ChannelPoller,
    WeightClient,
    WeightFetchError,
    WeightServer,
    ZmqChannel,
    end_context,
    is_loopback,
    private_context,
    shared_context,
)


def test_poller_names_the_channels_with_a_message_waiting():
    with ZmqChannel.bind(zmq.PULL, "tcp://127.0.0.1:0") as a, ZmqChannel.bind(zmq.PULL, "tcp://127.0.0.1:0") as b, \
            ZmqChannel.connect(zmq.PUSH, a.address) as to_a, ZmqChannel.connect(zmq.PUSH, b.address) as to_b:
        poller = ChannelPoller([a, b])
        assert poller.wait(0.01) == []
        to_b.send(P.Shutdown())
        assert poller.wait(30.0) == [b]  # returns as soon as b has a message (30 s only bounds a broken run)
        to_a.send(P.Shutdown())
        while len(ready := poller.wait(30.0)) < 2:  # a's message may still be on its way
            pass
        assert ready == [a, b]
        assert a.recv(0.0).msg == P.Shutdown() and b.recv(0.0).msg == P.Shutdown()
        assert poller.wait(0.0) == []


def test_end_context_returns_once_every_sent_message_has_left():
    # 64 messages of 256 KiB: far more than leaves the socket between the last send and close, so with
    # linger 0 most would be dropped; closed with a linger, ending the context waits until all have left.
    n, blob = 64, "x" * (256 * 1024)
    with ZmqChannel.bind(zmq.PULL, "tcp://127.0.0.1:0", hwm=n) as pull:
        ctx = private_context()
        push = ZmqChannel.connect(zmq.PUSH, pull.address, context=ctx, hwm=n)
        for i in range(n):
            push.send(P.Error(code=str(i), message=blob), timeout_s=30.0)
        push.close(linger_s=60.0)  # bounds only a broken run: a reachable peer ends the wait
        end_context(ctx)
        got = [pull.recv(30.0) for _ in range(n)]
        assert [e.msg.code for e in got if e is not None] == [str(i) for i in range(n)]
        assert all(e.msg.message == blob for e in got)


def test_end_context_refuses_the_shared_context():
    with pytest.raises(ValueError, match="private_context"):
        end_context(shared_context())


def test_recv_returns_none_after_its_timeout_instead_of_blocking():
    with ZmqChannel.bind(zmq.PULL, "tcp://127.0.0.1:0") as pull:
        t0 = time.monotonic()
        assert pull.recv(0.05) is None
        assert time.monotonic() - t0 < 60.0  # returned, did not hang (a hang guard, not a speed claim)


def _sample(n: int = 5) -> P.FinishedSample:
    return P.FinishedSample(
        sample_id="g/0", group_id="g", prompt_ids=P.Array.from_numpy(np.arange(3, dtype=np.int32)),
        response_ids=P.Array.from_numpy(np.arange(n, dtype=np.int32)),
        behav_logp=P.Array.from_numpy(np.zeros(n, np.float32)), versions=P.Array.from_numpy(np.ones(n, np.int32)),
        finish_reason="stop", worker_id="w")


def test_typed_channel_rejects_other_messages_and_multipart_frames_then_keeps_serving():
    with ZmqChannel.bind(zmq.PULL, "tcp://127.0.0.1:0", accept=P.FinishedSample) as pull, \
            ZmqChannel.connect(zmq.PUSH, pull.address) as push:
        push.send(P.Shutdown(reason="not a sample"))  # a valid message of the wrong type
        push.send_frames([P.encode(_sample()), b"extra", b"frames"])  # a sample with hostile extra frames
        push.send_frames([P.encode(_sample())[:-3]])  # truncated
        push.send(_sample(7))
        env = pull.recv(5.0)
        assert env is not None and env.msg == _sample(7) and env.payload is None
        assert pull.stats.rejected == {"unknown_tag": 1, "frames": 1, "malformed": 1}
        assert pull.stats.received == 1
        push.send(_sample(2))  # the frame after a rejected multipart message starts a new message
        assert pull.recv(5.0).msg == _sample(2)


def test_messages_through_the_reused_encode_buffer_arrive_intact_whatever_their_size_and_the_hwm():
    # One PUSH encodes every message into the same buffer: small and large ones alternate, and a high-water
    # mark of 1 with a slow reader makes sends wait (the retry path must send its own copy of the bytes).
    import threading

    sizes = [3, 70_000, 5, 300_000, 1, 9, 200_000, 2] * 4
    got: list = []
    with ZmqChannel.bind(zmq.PULL, "tcp://127.0.0.1:0", hwm=1, accept=P.FinishedSample) as pull, \
            ZmqChannel.connect(zmq.PUSH, pull.address, hwm=1) as push:
        def read() -> None:
            while len(got) < len(sizes) and (env := pull.recv(30.0)) is not None:
                got.append(env.msg)
                time.sleep(0.002)

        reader = threading.Thread(target=read)
        reader.start()
        for n in sizes:
            push.send(_sample(n), timeout_s=30.0)
        reader.join(60.0)
        assert got == [_sample(n) for n in sizes]
        assert pull.stats.rejected_total == 0


def test_closed_channel_refuses_use():
    ch = ZmqChannel.bind(zmq.PULL, "tcp://127.0.0.1:0")
    ch.close()
    with pytest.raises(ChannelClosed):
        ch.recv(0.0)


def test_router_needs_a_peer_identity_to_send():
    with ZmqChannel.bind(zmq.ROUTER, "tcp://127.0.0.1:0") as r:
        with pytest.raises(ValueError, match="peer identity"):
            r.send(P.Shutdown())


def test_bind_error_names_the_address():
    with ZmqChannel.bind(zmq.PULL, "tcp://127.0.0.1:0") as a:
        with pytest.raises(ValueError, match="cannot bind"):
            ZmqChannel.bind(zmq.PULL, a.address)


@pytest.mark.parametrize("addr,expected", [
    ("tcp://127.0.0.1:5555", True), ("tcp://localhost:1", True), ("ipc:///tmp/x", True),
    ("tcp://0.0.0.0:5555", False), ("tcp://10.1.2.3:1", False),
])
def test_is_loopback(addr, expected):
    assert is_loopback(addr) is expected


def _publish(server: WeightServer, version: int, arrays: dict[str, np.ndarray]) -> None:
    specs = [P.TensorSpec(name=k, dtype=str(v.dtype), shape=v.shape, nbytes=v.nbytes) for k, v in arrays.items()]
    ann = P.WeightAnnounce(version=version, fmt="fp32", manifest=specs, checksum=f"v{version}",
                           total_bytes=sum(v.nbytes for v in arrays.values()))
    server.publish(ann, list(arrays.values()))


def test_late_joiner_fetches_the_latest_version_and_hears_later_announcements():
    server = WeightServer()
    try:
        rng = np.random.default_rng(0)
        v1 = {"a": rng.standard_normal((3, 5)).astype(np.float32), "b": np.arange(7, dtype=np.int8)}
        _publish(server, 1, v1)
        client = WeightClient(server.announce_address, server.fetch_address)
        try:
            ann, bufs = client.fetch()  # joined after the announcement: fetch by request
            assert ann.version == 1
            for (_name, want), got in zip(v1.items(), bufs, strict=True):
                np.testing.assert_array_equal(np.frombuffer(got, want.dtype).reshape(want.shape), want)
            # PUB drops announcements until the subscription has propagated (slow joiner), so keep
            # publishing newer versions until one is heard; what is heard is the newest one.
            heard, version = None, 1
            deadline = time.monotonic() + 60  # a hang guard: the subscription propagates in milliseconds
            while (heard is None or heard.version < version) and time.monotonic() < deadline:
                if heard is None:
                    version += 1
                    _publish(server, version, {"a": v1["a"] + version, "b": v1["b"]})
                heard = client.poll_announce(0.2) or heard
            assert heard is not None and heard.version == version
            ann, bufs = client.fetch(version)
            np.testing.assert_array_equal(np.frombuffer(bufs[0], np.float32).reshape(3, 5), v1["a"] + version)
            with pytest.raises(WeightFetchError, match="not served"):
                client.fetch(99, timeout_s=60)  # the server's refusal ends the wait at once
        finally:
            client.close()
    finally:
        server.close()


def test_the_newest_in_a_format_is_the_newest_version_served_in_it_while_the_next_is_half_published():
    """A version's formats are published one after another: between them, "the newest" in the late format is the
    version before, never a refusal (a worker asking then would have left)."""
    server = WeightServer()
    client = WeightClient(server.announce_address, server.fetch_address)
    try:
        a = np.arange(6, dtype=np.float32)
        for version, fmt in ((0, "fp32"), (0, "int8"), (1, "fp32")):
            spec = P.TensorSpec(name="a", dtype="float32", shape=(6,), nbytes=a.nbytes)
            server.publish(P.WeightAnnounce(version=version, fmt=fmt, manifest=[spec], checksum=f"{fmt}{version}",
                                            total_bytes=a.nbytes), [a + version])
        for fmt, want in (("int8", 0), ("fp32", 1), ("", 1)):
            ann, bufs = client.fetch(-1, fmt=fmt)
            assert (ann.version, ann.fmt) == (want, fmt or "fp32")
            np.testing.assert_array_equal(np.frombuffer(bufs[0], np.float32), a + want)
        with client.stream(-1, fmt="int8", bucket_bytes=16) as stream:  # bucket by bucket, the same answer
            assert stream.version == 0
            for bucket in stream:
                bucket.release()
        with pytest.raises(WeightFetchError, match="in format 'nvfp4' is not served") as err:
            client.fetch(-1, fmt="nvfp4")
        assert err.value.code == "unknown_version"  # what a worker waiting for its first weights asks again on
    finally:
        client.close()
        server.close()


def test_publish_refuses_buffers_that_do_not_match_the_manifest():
    server = WeightServer()
    try:
        ann = P.WeightAnnounce(version=1, fmt="fp32", checksum="", total_bytes=8,
                               manifest=[P.TensorSpec(name="a", dtype="float32", shape=(2,), nbytes=8)])
        with pytest.raises(ValueError, match="manifest says 8 bytes"):
            server.publish(ann, [np.zeros(3, np.float32)])
        server.publish(ann, [np.zeros(2, np.float32)])
        with pytest.raises(ValueError, match="not newer"):
            server.publish(ann, [np.zeros(2, np.float32)])
    finally:
        server.close()


def test_delta_publication_is_served_only_to_a_fetch_that_names_its_base_and_rebuilds_the_version():
    from asyncrl.quant import apply_delta, load_published, make_delta, publish, quantize_model
    from asyncrl.transport.publication import delta_to_wire, from_wire, to_wire
    from tests.unit.quant.conftest import make_tiny_qwen2
    from tests.unit.quant.test_delta import same_bytes, versions

    pubs = [publish(sd, "int8", version=v) for v, sd in enumerate(versions(3, seed=8))]
    server = WeightServer()
    client = WeightClient(server.announce_address, server.fetch_address)
    try:
        server.publish(*to_wire(pubs[0]))
        for prev, cur in zip(pubs, pubs[1:], strict=False):
            server.publish(*to_wire(cur), *delta_to_wire(make_delta(prev, cur)))
        worker = quantize_model(make_tiny_qwen2(seed=99), "int8")
        ann, bufs = client.fetch(1, fmt="int8")  # no base named: the version whole
        assert isinstance(ann, P.WeightAnnounce)
        load_published(worker, from_wire(ann, bufs))
        ann, bufs = client.fetch(2, fmt="int8", base_version=1, base_checksum=pubs[1].checksum)
        assert isinstance(ann, P.WeightDelta) and ann.base_version == 1 and ann.total_bytes < ann.full_bytes
        assert sum(memoryview(b).nbytes for b in bufs) == ann.total_bytes
        apply_delta(worker, from_wire(ann, bufs))
        full = quantize_model(make_tiny_qwen2(seed=99), "int8")
        load_published(full, pubs[2])
        assert same_bytes(worker, full)
        assert server.deltas_served == 1 and server.delta_bytes_served == ann.total_bytes
        # a base the server has no delta from (a missed version, other bytes): the version whole
        for base, checksum in ((0, pubs[0].checksum), (1, "not-the-bytes-it-holds")):
            ann, _ = client.fetch(2, fmt="int8", base_version=base, base_checksum=checksum)
            assert isinstance(ann, P.WeightAnnounce) and ann.version == 2
        assert server.deltas_served == 1
    finally:
        client.close()
        server.close()
