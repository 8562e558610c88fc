"""Bucketed streaming of weight versions over real loopback ZeroMQ sockets (asyncrl/transport/buckets.py,
asyncrl/quant/bucketload.py): a version streamed in buckets, loaded as it arrives, holds the bytes of the one-piece
load; a worker holds about one bucket of received bytes; a torn transfer leaves the version it held.

Versions are small updates of a tiny Qwen2 (tests/unit/quant/test_delta.py), published as the learner publishes
them (``publish_streamed``: each tensor served while the next is quantised, a delta from the version before).
Bucket sizes are small and odd so that buckets cut tensors, and elements, anywhere.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections.abc import Iterator, Mapping

import msgspec
import pytest
import torch

import protocols as P
from asyncrl.quant import QuantError, load_buckets, load_published, quantize_model
from asyncrl.quant.delta import held_checksum
from asyncrl.quant.held import held_digests
from asyncrl.transport import WeightClient, WeightFetchError, WeightServer
from asyncrl.transport.buckets import LiveBytes, bucket_digest
from asyncrl.transport.publication import from_wire, publish_streamed
from tests.unit.quant.conftest import make_tiny_qwen2
from tests.unit.quant.test_delta import CACHED, mixed_versions, same_bytes, versions, worker_on

pytestmark = pytest.mark.timeout(600)

HANG_S = 120.0
"""Hang guard of a fetch that should succeed (it ends in milliseconds)."""
DROPPED_S = 5.0
"""How long a worker waits for a bucket its server never sends (the only way a cut socket shows)."""


@pytest.fixture
def probe_ids():
    return torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(7))


def worker(fmt: str) -> torch.nn.Module:
    return quantize_model(make_tiny_qwen2(seed=99), fmt)


@contextlib.contextmanager
def served(fmt: str, n: int, *, server_cls=WeightServer, bucket_bytes: int = 0, make=versions, **kw) -> Iterator[tuple]:
    """``n`` versions of ``fmt`` published the learner's way on a server, and a client: (server, client, pubs).
    ``make(n, seed=...)``: the state dicts of the versions."""
    server = server_cls(keep_versions=n + 1, bucket_bytes=bucket_bytes, **kw)
    client = WeightClient(server.announce_address, server.fetch_address)
    try:
        pubs: list = []
        for v, sd in enumerate(make(n, seed=11)):
            pub, _ = publish_streamed(server, sd, fmt, version=v, prev=pubs[-1] if pubs else None)
            pubs.append(pub)
        yield server, client, pubs
    finally:
        client.close()
        server.close()


def stream_load(client: WeightClient, model, v: int, size: int, base=None, fmt: str = "int8", timeout_s=HANG_S):
    """Stream version ``v`` (from ``base``, a publication the model holds, as a delta) into ``model``."""
    with client.stream(v, fmt=fmt, bucket_bytes=size, timeout_s=timeout_s,
                       base_version=-1 if base is None else base.version,
                       base_checksum="" if base is None else base.checksum) as stream:
        assert stream.whole is None
        return load_buckets(model, stream, version=v)


@pytest.mark.parametrize("fmt", ["int8", "nvfp4"])
def test_bucketed_load_equals_the_single_piece_load_bit_for_bit_for_versions_and_a_delta_chain(fmt, probe_ids):
    sizes = [301, 4096, 777, 10**9, 1000]  # tensors and elements cut anywhere; one bucket for the whole version
    with served(fmt, 6) as (_, client, pubs):
        chained = worker(fmt)
        for v, pub in enumerate(pubs):
            one_piece = worker(fmt)
            load_published(one_piece, from_wire(*client.fetch(v, fmt=fmt, timeout_s=HANG_S)))
            got = stream_load(client, chained, v, sizes[v % len(sizes)], base=pubs[v - 1] if v else None, fmt=fmt)
            assert got.is_delta == (v > 0) and got.version == v and got.checksum == pub.checksum
            assert got.buckets == max(1, -(-got.stream_bytes // sizes[v % len(sizes)]))
            assert same_bytes(chained, one_piece) and held_checksum(chained) == pub.checksum
            with torch.no_grad():
                assert torch.equal(chained(probe_ids).logits, one_piece(probe_ids).logits)  # caches refreshed
            late = worker(fmt)  # a worker that joins at this version: the version whole, in buckets
            stream_load(client, late, v, 513, fmt=fmt)
            assert same_bytes(late, one_piece)


@pytest.mark.parametrize(("fmt", "kernel", "fused"), CACHED)
def test_bucketed_delta_chain_rebuilds_the_caches_a_full_load_builds_bit_for_bit(fmt, kernel, fused):
    """A delta streamed in buckets rebuilds the caches only where it wrote (its sparse parts, and the elements
    its dense parts changed): every buffer, caches included, equals a worker that loaded the version whole."""
    with served(fmt, 6, make=mixed_versions) as (_, client, pubs):
        w = worker_on(fmt, kernel, fused)
        load_published(w, pubs[0])
        for v in range(1, len(pubs)):
            stream_load(client, w, v, 777, base=pubs[v - 1], fmt=fmt)
            full = worker_on(fmt, kernel, fused)
            load_published(full, pubs[v])
            assert same_bytes(w, full), v


@pytest.mark.parametrize(("fmt", "kernel", "fused"), CACHED)
def test_bucketed_whole_version_over_the_one_before_rebuilds_the_caches_a_full_load_builds_bit_for_bit(fmt, kernel,
                                                                                                   fused):
    """A whole version streamed into a model that holds the version before writes only the bytes that changed
    and rebuilds only the caches of the linears written (1-byte codes at the elements written): every buffer,
    caches included, equals a worker that loaded the version in one piece; the digests are recorded."""
    with served(fmt, 4, make=mixed_versions) as (_, client, pubs):
        w = worker_on(fmt, kernel, fused)
        for v in range(len(pubs)):
            stream_load(client, w, v, 777, fmt=fmt)
            full = worker_on(fmt, kernel, fused)
            load_published(full, pubs[v])
            assert same_bytes(w, full), v
            assert held_digests(w) == {e.name: e.digest for e in pubs[v].manifest}


def test_bucketed_delta_of_a_version_that_changed_nothing_is_one_empty_bucket():
    sd = versions(1, seed=14)[0]
    server = WeightServer()
    client = WeightClient(server.announce_address, server.fetch_address)
    try:
        pub0, _ = publish_streamed(server, sd, "int8", version=0)
        pub1, delta = publish_streamed(server, sd, "int8", version=1, prev=pub0)
        assert delta is not None and delta.total_bytes() == 0
        w = worker("int8")
        load_published(w, pub0)
        loaded = stream_load(client, w, 1, 4096, base=pub0)
        assert (loaded.buckets, loaded.stream_bytes, loaded.undo_bytes) == (1, 0, 0) and loaded.is_delta
        assert held_checksum(w) == pub1.checksum
    finally:
        client.close()
        server.close()


def test_bucketed_publication_is_sent_while_it_is_still_being_quantized():
    """The learner cannot quantise its last tensor until a worker holds the first bucket: only streaming
    lets both finish. A one-piece fetch asked meanwhile is answered once the version is complete."""
    sds = versions(2, seed=12)
    last = sorted(sds[1])[-1]
    first_bucket = threading.Event()

    class Gated(Mapping):  # the learner's state dict, whose last tensor waits for the worker's first bucket
        def __init__(self, sd):
            self.sd = sd

        def __getitem__(self, name):
            if name == last:
                assert first_bucket.wait(HANG_S), "the worker got no bucket before the last tensor was quantised"
            return self.sd[name]

        def __iter__(self):
            return iter(self.sd)

        def __len__(self):
            return len(self.sd)

    server = WeightServer()
    client, other = (WeightClient(server.announce_address, server.fetch_address) for _ in range(2))
    try:
        pub0, _ = publish_streamed(server, sds[0], "int8", version=0)
        result: dict = {}

        def learner():
            try:
                result["pub"] = publish_streamed(server, Gated(sds[1]), "int8", version=1, prev=pub0)[0]
            except BaseException as e:  # noqa: B036 - reported below
                result["error"] = e

        t = threading.Thread(target=learner)
        t.start()
        deadline = time.monotonic() + HANG_S
        while server.latest_version < 1 and time.monotonic() < deadline:  # announced when it begins
            time.sleep(0.001)
        one_piece: dict = {}
        fetcher = threading.Thread(target=lambda: one_piece.update(v=other.fetch(1, fmt="int8", timeout_s=HANG_S)))
        fetcher.start()
        w = worker("int8")
        load_published(w, pub0)

        def buckets(stream):
            for b in stream:
                yield b
                first_bucket.set()

        with client.stream(1, fmt="int8", bucket_bytes=1000, base_version=0, base_checksum=pub0.checksum,
                           timeout_s=HANG_S) as stream:
            loaded = load_buckets(w, buckets(stream), version=1)
        t.join(HANG_S)
        fetcher.join(HANG_S)
        assert "error" not in result and loaded.is_delta and loaded.buckets > 1
        ref = worker("int8")
        load_published(ref, result["pub"])
        assert same_bytes(w, ref) and loaded.checksum == result["pub"].checksum
        ann, bufs = one_piece["v"]
        assert ann.checksum == result["pub"].checksum and len(bufs) == len(ann.manifest)
    finally:
        client.close()
        other.close()
        server.close()


def test_bucketed_load_holds_about_one_bucket_of_receive_buffers():
    size = 1024
    with served("int8", 2) as (_, client, pubs):
        total = pubs[1].total_bytes()
        assert total > 32 * size
        ann, bufs = client.fetch(1, fmt="int8", timeout_s=HANG_S)  # one piece: the whole version at once
        whole = LiveBytes()
        for b in bufs:
            whole.track(b)
        assert whole.now == total
        del ann, bufs
        client.live.reset_peak()
        w = worker("int8")
        loaded = stream_load(client, w, 1, size)
        assert loaded.stream_bytes == total and loaded.buckets == -(-total // size)
        assert 0 < client.live.peak <= size  # the receive buffers of one bucket, never two
        assert client.live.now == 0  # and none left once loaded
        # the worker moves to the next version whole: what it records to undo the load is what changed
        client.live.reset_peak()
        held = worker("int8")
        load_published(held, pubs[0])
        again = stream_load(client, held, 1, size)
        assert client.live.peak <= size and again.undo_bytes < loaded.undo_bytes


class Hostile(WeightServer):
    """A weight server that spoils bucket ``AT`` of every bucketed answer (``KIND``), for real, on the wire."""

    KIND = ""
    AT = 2

    def _send_bucket(self, peer, header, pieces):
        if header.index != self.AT:
            return super()._send_bucket(peer, header, pieces)
        if self.KIND == "dropped":  # never sent: what a cut connection looks like to the worker
            return True
        if self.KIND == "piece_dropped":
            return super()._send_bucket(peer, header, pieces[:-1])
        name, offset, data = pieces[-1]
        spoiled = bytearray(data)
        spoiled[len(spoiled) // 2] ^= 0x10
        pieces = [*pieces[:-1], (name, offset, memoryview(spoiled))]
        if self.KIND == "rehashed":  # the bucket's own digest fits the spoiled bytes: only the tensor's catches it
            header = msgspec.structs.replace(header, digest=bucket_digest([p for _, _, p in pieces]))
        return super()._send_bucket(peer, header, pieces)


@pytest.mark.parametrize("kind", ["flipped", "rehashed", "piece_dropped", "dropped"])
@pytest.mark.parametrize("delta", [False, True], ids=["whole", "delta"])
def test_bucketed_torn_transfer_leaves_the_previous_version_and_the_next_fetch_works(kind, delta):
    hostile = type("HostileServer", (Hostile,), {"KIND": kind})
    with served("int8", 3, server_cls=hostile) as (server, client, pubs):
        w = worker("int8")
        load_published(w, pubs[1])
        before = copy.deepcopy(w)
        with pytest.raises((WeightFetchError, QuantError)):
            stream_load(client, w, 2, 700, base=pubs[1] if delta else None,
                        timeout_s=DROPPED_S if kind == "dropped" else HANG_S)
        assert same_bytes(w, before) and held_checksum(w) == pubs[1].checksum  # buckets 0 and 1 were undone
        server.AT = -1  # the server mends: the same client, right after, loads the version
        stream_load(client, w, 2, 700, base=pubs[1] if delta else None)
        ref = worker("int8")
        load_published(ref, pubs[2])
        assert same_bytes(w, ref)


def test_bucketed_publication_the_learner_gives_up_is_refused_and_the_worker_keeps_its_version():
    sds = versions(2, seed=13)
    bad = dict(sds[1])
    name = sorted(k for k in bad if k.endswith("norm.weight"))[-1]
    bad[name] = bad[name].clone()
    bad[name][0] = float("nan")
    server = WeightServer()
    client = WeightClient(server.announce_address, server.fetch_address)
    try:
        pub0, _ = publish_streamed(server, sds[0], "int8", version=0)
        with pytest.raises(QuantError, match="non-finite"):
            publish_streamed(server, bad, "int8", version=1, prev=pub0)
        w = worker("int8")
        load_published(w, pub0)
        before = copy.deepcopy(w)
        with pytest.raises(WeightFetchError, match="given up"):
            stream_load(client, w, 1, 512, base=pub0)
        with pytest.raises(WeightFetchError, match="given up"):
            client.fetch(1, fmt="int8", timeout_s=HANG_S)
        assert same_bytes(w, before)
        ann, _ = client.fetch(-1, fmt="int8", timeout_s=HANG_S)  # the newest version is the one not given up
        assert ann.version == 0
    finally:
        client.close()
        server.close()


def test_bucketed_fetch_of_a_server_that_sends_no_buckets_gets_one_piece_and_old_fetches_still_work():
    with served("int8", 1) as (server, client, pubs):  # transport.bucket_mb=0: the server's own size is 0
        with client.stream(0, fmt="int8", timeout_s=HANG_S) as stream:  # -1: the server's size
            assert stream.whole is not None and stream.first is None
            w = worker("int8")
            load_published(w, from_wire(*stream.whole))
        server.bucket_bytes = 4096
        with client.stream(0, fmt="int8", timeout_s=HANG_S) as stream:
            assert stream.whole is None and stream.first.bucket_bytes == 4096
            load_buckets(worker("int8"), stream, version=0)
        ann, _ = client.fetch(0, fmt="int8", timeout_s=HANG_S)  # a fetch of protocol 1.5: no bucket fields
        assert isinstance(ann, P.WeightAnnounce) and ann.checksum == pubs[0].checksum


def test_bucketed_fetch_that_asks_for_no_bucket_is_refused_when_decoded():
    for bad in ({"bucket": -1}, {"bucket_bytes": -2}):
        raw = msgspec.msgpack.encode({"type": "weight_fetch", **bad})
        with pytest.raises(P.ProtocolError, match="bucket"):
            P.decode(raw)
