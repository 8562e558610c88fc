"""Weight publication and fetch over ZeroMQ.

Owns: announcing a new version (PUB) and serving the tensors of the latest versions on request
(ROUTER), so a worker that joins late, or that missed announcements (PUB drops for slow joiners),
still gets the newest weights by asking for them.
Never: interprets tensor bytes (quantization formats and checksums are ``asyncrl.quant``'s job; this
module only checks that what arrived matches the announced manifest); copies payloads on the server
side (frames are sent zero-copy from the published buffers, which must stay unchanged once published).

Wire sequence for one fetch: DEALER -> ``WeightFetch(version, fmt)``; ROUTER -> ``WeightAnnounce``, then
``count`` x [``WeightChunk`` header frame, raw payload frame], in manifest order. An unknown version
or format is answered with ``Error(code="unknown_version")``. One version may be published in several
formats (workers of different quantization formats); the first format published is the primary one. A fetch of
"the newest" (version -1) in a format gets the newest version served in that format: the formats of one version
are published one after another, and a worker of the last one must not be refused in between.

Deltas: a version may be published with a ``WeightDelta`` from the version before it (the publisher makes
it, ``asyncrl.quant.make_delta``). A fetch that names that base version and its checksum gets the delta:
``WeightDelta``, then one [``WeightChunk`` (dtype ``delta``), payload] pair per part that carries a frame. Any
other fetch (a worker that joins, one that missed a version, one that holds other bytes, a version published
whole) gets the full version, so a delta is never applied to the wrong base.

Buckets (``asyncrl.transport.buckets``): a fetch with ``bucket_bytes`` != 0 asks for the version (or its delta)
one bucket at a time: ``WeightFetch(bucket=k)`` -> ``WeightBucket`` then its pieces, [``WeightChunk``, payload];
the server sends nothing unasked, so a worker holds about one bucket. A version may also be served while it is
being published (``begin``: announced at once, each bucket sent as soon as its bytes are ready, a one-piece
fetch answered once the version is complete, ``finish``/``abort``); a request that has to wait is parked and
answered from the serving loop.

With ``curve`` keys both server sockets (PUB and ROUTER) accept only allow-listed clients, so an
unknown client neither hears announcements nor fetches weights (``asyncrl.transport.keys``, ``asyncrl.transport.zap``).
The worker's side is ``asyncrl.transport.weight_client``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import zmq

from asyncrl.transport.buckets import ItemStream
from asyncrl.transport.channel import ChannelClosed, ChannelTimeout, ZmqChannel
from asyncrl.transport.keys import CurveConfig
from asyncrl.transport.served import LivePublication, PublishedVersion
from asyncrl.transport.weight_client import WeightClient, WeightFetchCancelled, WeightFetchError
from protocols import (
    Error,
    WeightAnnounce,
    WeightBucket,
    WeightChunk,
    WeightDelta,
    WeightFetch,
)

__all__ = ["LivePublication", "PublishedVersion", "WeightClient", "WeightFetchCancelled", "WeightFetchError",
           "WeightServer"]

PARKED_POLL_S = 0.001
"""While requests wait for a version being published, the longest the serving loop waits for the publisher's
next tensor (it is woken by each one) before it reads new requests."""
PARK_LIMIT_S = 600.0
"""A request parked this long (a publication that never completes) is answered with an error."""
MAX_PARKED = 4096
"""Requests waiting at once beyond this are answered with an error (``busy``): no peer can grow the list."""


class WeightServer:
    """Serves published versions from a background thread that owns both sockets."""

    def __init__(
        self,
        announce_address: str = "tcp://127.0.0.1:0",
        fetch_address: str = "tcp://127.0.0.1:0",
        *,
        keep_versions: int = 2,
        send_timeout_s: float = 30.0,
        curve: CurveConfig | None = None,
        max_message_bytes: int = -1,
        bucket_bytes: int = 0,
    ) -> None:
        """``curve``: server keys (``load_server_keys``) or None for plain sockets. Requests are tiny
        ``WeightFetch`` messages: ``max_message_bytes`` > 0 disconnects a peer that sends more (uncounted).
        ``bucket_bytes``: the bucket size of a fetch that asks for the server's (``transport.bucket_mb``; 0: such a
        fetch gets the version in one piece)."""
        if bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be >= 0 (0: one piece), got {bucket_bytes}")
        self._pub = ZmqChannel.bind(zmq.PUB, announce_address, name="weights-pub", curve=curve)
        try:
            self._router = ZmqChannel.bind(zmq.ROUTER, fetch_address, name="weights-router", reply_errors=True,
                                           curve=curve, max_message_bytes=max_message_bytes)
        except ValueError:
            self._pub.close()
            raise
        self.announce_address = self._pub.address
        self.fetch_address = self._router.address
        self.keep_versions = keep_versions
        self.send_timeout_s = send_timeout_s
        self.bucket_bytes = bucket_bytes
        self._versions: OrderedDict[int, dict[str, PublishedVersion]] = OrderedDict()
        self._pub_lock = threading.Lock()  # the PUB socket is used by the publishing thread, one at a time
        self._parked: list[tuple[bytes, WeightFetch, float]] = []  # requests waiting for a version being made
        self._lock = threading.Lock()
        self._progress = threading.Event()  # set by a version being published at each tensor it adds
        self._stop = threading.Event()
        self.fetches_served = 0
        self.bytes_served = 0
        self.deltas_served = 0
        self.delta_bytes_served = 0
        self.buckets_served = 0
        self._thread = threading.Thread(target=self._run, name="weight-server", daemon=True)
        self._thread.start()

    @property
    def stats(self):
        return self._router.stats

    def as_metrics(self, prefix: str = "transport/weights") -> dict[str, float]:
        """Fetch-socket counters plus, with keys, the announcement socket's handshake counters."""
        out = self._router.stats.as_metrics(prefix)
        if self._pub.stats.secured:
            out |= {k.replace(f"{prefix}/auth", f"{prefix}/announce_auth"): v
                    for k, v in self._pub.stats.as_metrics(prefix).items() if k.startswith(f"{prefix}/auth")}
        out[f"{prefix}/fetches_served"] = float(self.fetches_served)
        out[f"{prefix}/deltas_served"] = float(self.deltas_served)
        out[f"{prefix}/bytes_served"] = float(self.bytes_served)
        out[f"{prefix}/buckets_served"] = float(self.buckets_served)
        return out

    @property
    def latest_version(self) -> int:
        with self._lock:
            return next(reversed(self._versions)) if self._versions else -1

    def publish(self, announce: WeightAnnounce, buffers: list, delta: WeightDelta | None = None,
                delta_buffers: list | None = None) -> None:
        """Make ``announce.version`` fetchable and announce it. Buffers must not change afterwards.
        ``delta``: the same version as changes from ``delta.base_version`` (with its payload buffers), served
        to a fetch that names that base."""
        self._add(PublishedVersion(announce, list(buffers), delta, list(delta_buffers or [])))

    def begin(self, version: int, fmt: str, *, aqn_seed: int = -1, aqn_sigma: float = 0.0,
              aqn_resample: str = "publication", delta_base: tuple[int, str] | None = None) -> LivePublication:
        """Start publishing ``version`` in ``fmt`` tensor by tensor: it is announced now (with an empty manifest)
        and served in buckets as its bytes arrive (``LivePublication``). ``delta_base``: (version, checksum) of
        the version a delta of it is made from, alongside."""
        announce = WeightAnnounce(version=version, fmt=fmt, manifest=[], checksum="", total_bytes=0,
                                  aqn_seed=aqn_seed, aqn_sigma=aqn_sigma, aqn_resample=aqn_resample)
        entry = PublishedVersion(announce, [], complete=False, delta_base=delta_base, full_items=ItemStream(),
                                 delta_items=None if delta_base is None else ItemStream())
        self._add(entry)
        return LivePublication(self, entry)

    def _add(self, entry: PublishedVersion) -> None:
        announce = entry.announce
        with self._lock:
            latest = next(reversed(self._versions)) if self._versions else -1
            same = announce.version == latest and announce.fmt not in self._versions[latest]
            if announce.version < latest or (announce.version == latest and not same):
                raise ValueError(f"version {announce.version} ({announce.fmt}) is not newer than the latest "
                                 "published one")
            self._versions.setdefault(announce.version, {})[announce.fmt] = entry
            while len(self._versions) > self.keep_versions:
                self._versions.popitem(last=False)
        with self._pub_lock:  # announced now, from the publishing thread (the serving loop may wait in a poll)
            try:
                self._pub.send(announce, timeout_s=0.0)  # PUB never blocks; drops for absent subscribers
            except (ChannelTimeout, ChannelClosed):
                pass

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._parked:  # answer each as soon as what it waits for is there
                self._progress.wait(PARKED_POLL_S)
                self._progress.clear()
                self._retry_parked()
            env = self._router.recv(timeout_s=0.0 if self._parked else 0.02)
            while env is not None:  # every request already here
                self._handle(env)
                env = self._router.recv(timeout_s=0.0)

    def _handle(self, env) -> None:
        if not isinstance(env.msg, WeightFetch):
            self._router.stats.reject("unexpected", f"{type(env.msg).__name__} on the weight socket")
            self._send_quiet(Error(code="unexpected", message="this socket only answers WeightFetch"), env.sender())
        elif not self._dispatch(env.sender(), env.msg):
            if len(self._parked) >= MAX_PARKED:
                self._send_quiet(Error(code="busy", message=f"{MAX_PARKED} requests already wait for a version being "
                                                             "published; ask again"), env.sender())
            else:
                self._parked.append((env.sender(), env.msg, time.monotonic()))

    def _retry_parked(self) -> None:
        parked, self._parked = self._parked, []
        for peer, req, since in parked:
            if time.monotonic() - since > PARK_LIMIT_S:
                self._send_quiet(Error(code="timeout", message=f"version {req.version} was not complete after "
                                                                f"{PARK_LIMIT_S:.0f} s"), peer)
            elif not self._dispatch(peer, req):
                self._parked.append((peer, req, since))

    def _dispatch(self, peer: bytes, req: WeightFetch) -> bool:
        """Answer ``req``; False when it has to wait for a version being published (park it)."""
        if req.bucket_bytes > 0 or (req.bucket_bytes < 0 and self.bucket_bytes > 0):
            return self._serve_bucket(peer, req)
        return self._serve(peer, req)

    def _entry(self, peer: bytes, req: WeightFetch) -> PublishedVersion | None:
        """Under the lock: the version ``req`` asks for, or None after answering with the error."""
        version, fmt = req.version, req.fmt
        if version < 0 and self._versions:
            version = self._newest(fmt)
        formats = self._versions.get(version, {})
        entry = formats.get(fmt) if fmt else next(iter(formats.values()), None)
        if entry is None:
            known = {v: list(f) for v, f in self._versions.items()}
            self._send_quiet(Error(code="unknown_version", message=f"version {version} in format {fmt or 'primary'!r} "
                                                                    f"is not served; available: {known}"), peer)
        elif entry.aborted:
            self._send_quiet(Error(code="aborted", message=f"version {version} was given up while it was being "
                                                            f"published: {entry.aborted}"), peer)
            entry = None
        return entry

    def _newest(self, fmt: str) -> int:
        """Under the lock: the newest version served in ``fmt`` (any format if empty) and not given up; else
        the newest version (its refusal names what is served)."""
        for version, formats in reversed(self._versions.items()):
            entries = [formats[fmt]] if fmt in formats else [] if fmt else list(formats.values())
            if any(not e.aborted for e in entries):
                return version
        return next(reversed(self._versions))

    def _serve_bucket(self, peer: bytes, req: WeightFetch) -> bool:
        size = req.bucket_bytes if req.bucket_bytes > 0 else self.bucket_bytes
        with self._lock:
            entry = self._entry(peer, req)
            if entry is None:
                return True
            items, is_delta = entry.stream(req)
            if items is None or not items.ready(req.bucket, size):
                return False
            try:
                cut = items.cut(req.bucket, size)
            except IndexError as e:
                self._send_quiet(Error(code="unknown_bucket", message=str(e)), peer)
                return True
            ann, delta = entry.announce, entry.delta
            total, done = items.total, items.done
        digest = items.digest(cut, size, keep=size == self.bucket_bytes)
        base = entry.delta_base if is_delta and entry.delta_base is not None else (-1, "")
        header = WeightBucket(
            version=ann.version, fmt=ann.fmt, index=cut.index, bucket_bytes=size, nbytes=cut.nbytes,
            pieces=len(cut.pieces), digest=digest, entries=[it.spec for it in cut.entries],
            parts=[it.part for it in cut.entries if it.part is not None], base_version=base[0],
            base_checksum=base[1], last=cut.last, checksum=ann.checksum if cut.last else "",
            buckets=cut.index + 1 if cut.last else 0, total_bytes=total if cut.last else 0,
            full_bytes=(delta.full_bytes if delta is not None and is_delta else ann.total_bytes) if done else 0,
            aqn_seed=ann.aqn_seed, aqn_sigma=ann.aqn_sigma, aqn_resample=ann.aqn_resample)
        if not self._send_bucket(peer, header, cut.pieces):
            return True
        self.buckets_served += 1
        self.bytes_served += cut.nbytes
        if cut.last:
            self.fetches_served += 1
            if is_delta:
                self.deltas_served += 1
        if is_delta:
            self.delta_bytes_served += cut.nbytes
        return True

    def _send_bucket(self, peer: bytes, header: WeightBucket, pieces: list[tuple[str, int, memoryview]]) -> bool:
        """Send a bucket's header and pieces; False when the peer could not take them."""
        try:
            self._router.send(header, to=peer, timeout_s=self.send_timeout_s)
            for i, (name, offset, data) in enumerate(pieces):
                chunk = WeightChunk.for_piece(name, version=header.version, index=i, count=len(pieces), offset=offset,
                                              nbytes=data.nbytes)
                self._router.send(chunk, to=peer, payload=data, timeout_s=self.send_timeout_s)
        except (ChannelTimeout, ChannelClosed) as e:
            self._router.stats.reject("fetch_aborted", str(e))
            return False
        return True

    def _serve(self, peer: bytes, req: WeightFetch) -> bool:
        with self._lock:
            entry = self._entry(peer, req)
            if entry is None:
                return True
            if not entry.complete:
                return False
        delta = entry.delta
        if (delta is not None and req.base_version >= 0 and req.base_version == delta.base_version
                and req.base_checksum == delta.base_checksum):
            self._serve_delta(peer, delta, entry.delta_buffers)
            return True
        ann = entry.announce
        try:
            self._router.send(ann, to=peer, timeout_s=self.send_timeout_s)
            for i, (spec, buf) in enumerate(zip(ann.manifest, entry.buffers, strict=True)):
                chunk = WeightChunk.for_entry(spec, version=ann.version, index=i, count=len(ann.manifest))
                self._router.send(chunk, to=peer, payload=memoryview(buf).cast("B"),
                                  timeout_s=self.send_timeout_s)
        except (ChannelTimeout, ChannelClosed) as e:
            self._router.stats.reject("fetch_aborted", str(e))
            return True
        self.fetches_served += 1
        self.bytes_served += ann.total_bytes
        return True

    def _serve_delta(self, peer: bytes, delta: WeightDelta, buffers: list) -> None:
        moving = delta.payload_parts()
        try:
            self._router.send(delta, to=peer, timeout_s=self.send_timeout_s)
            for i, (part, buf) in enumerate(zip(moving, buffers, strict=True)):
                chunk = WeightChunk.for_delta_part(part, version=delta.version, index=i, count=len(moving))
                self._router.send(chunk, to=peer, payload=memoryview(buf).cast("B"), timeout_s=self.send_timeout_s)
        except (ChannelTimeout, ChannelClosed) as e:
            self._router.stats.reject("fetch_aborted", str(e))
            return
        self.fetches_served += 1
        self.deltas_served += 1
        self.bytes_served += delta.total_bytes
        self.delta_bytes_served += delta.total_bytes

    def _send_quiet(self, msg, peer: bytes) -> None:
        try:
            self._router.send(msg, to=peer, timeout_s=0.0)
        except (ChannelTimeout, ChannelClosed):
            pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._pub_lock:
            self._pub.close()
        self._router.close()


