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
formats (workers of different quantization formats); the first format published is the primary one.

Deltas: a version may be published with a ``WeightDelta`` from the version before it (the publisher makes
it, ``asyncrl.quant.make_delta``). A fetch that names that base version and its checksum gets the delta:
``WeightDelta``, then one [``WeightChunk`` (dtype ``delta``), payload] pair per part that carries a frame. Any
other fetch (a worker that joins, one that missed a version, one that holds other bytes, a version published
whole) gets the full version, so a delta is never applied to the wrong base.

With ``curve`` keys both server sockets (PUB and ROUTER) accept only allow-listed clients, so an
unknown client neither hears announcements nor fetches weights (``asyncrl.transport.keys``, ``asyncrl.transport.zap``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict

import zmq

from asyncrl.transport.channel import ChannelClosed, ChannelTimeout, ZmqChannel
from asyncrl.transport.keys import CurveConfig
from protocols import Error, WeightAnnounce, WeightChunk, WeightDelta, WeightFetch


class WeightFetchError(RuntimeError):
    """A fetch failed: timeout, unknown version, or chunks that do not match the manifest."""


class WeightFetchCancelled(WeightFetchError):
    """A fetch was given up because its ``cancel`` event was set (the process is leaving)."""


CANCEL_CHECK_S = 0.2
"""How often a fetch with a ``cancel`` event looks at it while it waits for the server."""


@dataclasses.dataclass
class PublishedVersion:
    announce: WeightAnnounce
    buffers: list  # bytes-like, one per manifest entry, in manifest order
    delta: WeightDelta | None = None  # the same version as changes from the version before it
    delta_buffers: list = dataclasses.field(default_factory=list)  # one per part that carries a frame

    def __post_init__(self) -> None:
        specs = self.announce.manifest
        if len(specs) != len(self.buffers):
            raise ValueError(f"manifest has {len(specs)} entries but {len(self.buffers)} buffers were given")
        for spec, buf in zip(specs, self.buffers, strict=True):
            if memoryview(buf).nbytes != spec.nbytes:
                raise ValueError(f"tensor {spec.name!r}: manifest says {spec.nbytes} bytes, buffer has "
                                 f"{memoryview(buf).nbytes}")
        if self.delta is not None:
            moving = self.delta.payload_parts()
            if (self.delta.version, self.delta.checksum) != (self.announce.version, self.announce.checksum):
                raise ValueError("the delta is of another version than the announcement")
            if len(moving) != len(self.delta_buffers) or any(
                    memoryview(b).nbytes != p.nbytes for p, b in zip(moving, self.delta_buffers, strict=False)):
                raise ValueError("the delta's buffers do not match its parts")


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
    ) -> None:
        """``curve``: server keys (``load_server_keys``) or None for plain sockets. Requests are tiny
        ``WeightFetch`` messages: ``max_message_bytes`` > 0 disconnects a peer that sends more (uncounted)."""
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
        self._versions: OrderedDict[int, dict[str, PublishedVersion]] = OrderedDict()
        self._pending_announce: list[WeightAnnounce] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.fetches_served = 0
        self.bytes_served = 0
        self.deltas_served = 0
        self.delta_bytes_served = 0
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
        entry = PublishedVersion(announce, list(buffers), delta, list(delta_buffers or []))
        with self._lock:
            latest = next(reversed(self._versions)) if self._versions else -1
            same = announce.version == latest and announce.fmt not in self._versions[latest]
            if announce.version < latest or (announce.version == latest and not same):
                raise ValueError(f"version {announce.version} ({announce.fmt}) is not newer than the latest "
                                 "published one")
            self._versions.setdefault(announce.version, {})[announce.fmt] = entry
            while len(self._versions) > self.keep_versions:
                self._versions.popitem(last=False)
            self._pending_announce.append(announce)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                pending, self._pending_announce = self._pending_announce, []
            for ann in pending:
                try:
                    self._pub.send(ann, timeout_s=0.0)  # PUB never blocks; drops for absent subscribers
                except ChannelTimeout:
                    pass
            env = self._router.recv(timeout_s=0.02)
            if env is None:
                continue
            if not isinstance(env.msg, WeightFetch):
                self._router.stats.reject("unexpected", f"{type(env.msg).__name__} on the weight socket")
                self._send_quiet(Error(code="unexpected", message="this socket only answers WeightFetch"),
                                 env.sender())
                continue
            self._serve(env.sender(), env.msg)

    def _serve(self, peer: bytes, req: WeightFetch) -> None:
        version, fmt = req.version, req.fmt
        with self._lock:
            if version < 0 and self._versions:
                version = next(reversed(self._versions))
            formats = self._versions.get(version, {})
            entry = formats.get(fmt) if fmt else next(iter(formats.values()), None)
            known = {v: list(f) for v, f in self._versions.items()}
        if entry is None:
            self._send_quiet(
                Error(code="unknown_version",
                      message=f"version {version} in format {fmt or 'primary'!r} is not served; available: {known}"),
                peer,
            )
            return
        delta = entry.delta
        if (delta is not None and req.base_version >= 0 and req.base_version == delta.base_version
                and req.base_checksum == delta.base_checksum):
            self._serve_delta(peer, delta, entry.delta_buffers)
            return
        ann = entry.announce
        try:
            self._router.send(ann, to=peer, timeout_s=self.send_timeout_s)
            for i, (spec, buf) in enumerate(zip(ann.manifest, entry.buffers, strict=True)):
                chunk = WeightChunk.for_entry(spec, version=ann.version, index=i, count=len(ann.manifest))
                self._router.send(chunk, to=peer, payload=memoryview(buf).cast("B"),
                                  timeout_s=self.send_timeout_s)
        except (ChannelTimeout, ChannelClosed) as e:
            self._router.stats.reject("fetch_aborted", str(e))
            return
        self.fetches_served += 1
        self.bytes_served += ann.total_bytes

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
        self._pub.close()
        self._router.close()


class WeightClient:
    """A worker's side: hears announcements and fetches versions. Use from one thread."""

    def __init__(self, announce_address: str, fetch_address: str, *, identity: bytes | None = None,
                 curve: CurveConfig | None = None) -> None:
        """``curve``: client keys (``load_client_keys``) or None for plain sockets."""
        self._sub = ZmqChannel.connect(zmq.SUB, announce_address, name="weights-sub", curve=curve)
        try:
            self._dealer = ZmqChannel.connect(zmq.DEALER, fetch_address, name="weights-dealer",
                                              identity=identity, zero_copy_recv=True, hwm=0, curve=curve)
        except ValueError:
            self._sub.close()
            raise

    @property
    def stats(self):
        return self._dealer.stats

    def poll_announce(self, timeout_s: float = 0.0, fmt: str = "") -> WeightAnnounce | None:
        """The newest announcement (of format ``fmt``, if given) received so far (drains the queue)."""
        newest = None
        env = self._sub.recv(timeout_s)
        while env is not None:
            ann = env.msg
            if (isinstance(ann, WeightAnnounce) and (not fmt or ann.fmt == fmt)
                    and (newest is None or ann.version > newest.version)):
                newest = ann
            env = self._sub.recv(0.0)
        return newest

    def fetch(self, version: int = -1, timeout_s: float = 60.0, fmt: str = "",
              cancel: threading.Event | None = None, base_version: int = -1,
              base_checksum: str = "") -> tuple[WeightAnnounce | WeightDelta, list]:
        """All tensors of ``version`` (-1: latest), checked against the manifest, in manifest order; or, when
        ``base_version``/``base_checksum`` name what the caller holds and the server has a delta from it, the
        ``WeightDelta`` and its payload frames (checked against its parts).

        ``cancel``: when it is set, the fetch stops waiting and raises ``WeightFetchCancelled`` (a reply
        that arrives later is never read: the caller is leaving and closes the client)."""
        deadline = time.monotonic() + timeout_s
        if cancel is not None and cancel.is_set():
            raise WeightFetchCancelled(f"fetch of version {version} cancelled before it was sent")
        try:
            self._dealer.send(WeightFetch(version=version, fmt=fmt, base_version=base_version,
                                          base_checksum=base_checksum), timeout_s=timeout_s)
        except ChannelTimeout:
            raise WeightFetchError(f"timed out after {timeout_s}s sending the request for version {version}: the "
                                   f"weight server is unreachable{self._refused_hint()}") from None

        def next_msg(what: str):
            while True:
                left = max(0.0, deadline - time.monotonic())
                env = self._dealer.recv(left if cancel is None else min(left, CANCEL_CHECK_S))
                if env is not None or left <= CANCEL_CHECK_S or cancel is None:
                    break
                if cancel.is_set():
                    raise WeightFetchCancelled(f"fetch of version {version} cancelled while waiting for {what}")
            if env is None:
                raise WeightFetchError(f"timed out after {timeout_s}s waiting for {what} of version {version}"
                                       f"{self._refused_hint()}")
            if isinstance(env.msg, Error):
                raise WeightFetchError(f"weight server refused: {env.msg.message}")
            return env

        ann = next_msg("the announcement").msg
        if isinstance(ann, WeightDelta):
            if ann.base_version != base_version or ann.base_checksum != base_checksum:
                raise WeightFetchError(f"the server sent a delta from version {ann.base_version}, this client holds "
                                       f"{base_version}")
            frames: list[memoryview] = []
            moving = ann.payload_parts()
            for i, part in enumerate(moving):
                env = next_msg(f"delta part {i}")
                chunk = env.msg
                if not isinstance(chunk, WeightChunk) or chunk != WeightChunk.for_delta_part(
                        part, version=ann.version, index=i, count=len(moving)):
                    raise WeightFetchError(f"delta part {i} does not match {part.name!r}: {chunk!r}")
                frames.append(env.payload)
            return ann, frames
        if not isinstance(ann, WeightAnnounce):
            raise WeightFetchError(f"expected WeightAnnounce, got {type(ann).__name__}")
        buffers: list[memoryview] = []
        for i, spec in enumerate(ann.manifest):
            env = next_msg(f"chunk {i}")
            chunk = env.msg
            if not isinstance(chunk, WeightChunk) or not chunk.describes(spec, version=ann.version, index=i):
                raise WeightFetchError(f"chunk {i} does not match manifest entry {spec.name!r}: {chunk!r}")
            buffers.append(env.payload)
        return ann, buffers

    def _refused_hint(self) -> str:
        if self._dealer.stats.auth.get("refused"):
            return "; the server refused this client's CURVE key (not in its allow-list: `asyncrl keys add`)"
        return ""

    def close(self) -> None:
        self._sub.close()
        self._dealer.close()

