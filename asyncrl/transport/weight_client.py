"""A worker's side of the weight sockets: hearing announcements, fetching a version whole or in buckets.

Owns: ``WeightClient`` (SUB for announcements, DEALER for fetches; the wire sequences are described in
``asyncrl.transport.weights``) and ``BucketStream``, a version fetched bucket by bucket with one request
ahead: bucket ``k + 1`` is asked for as soon as bucket ``k``'s header arrives, so the server sends it while
the worker loads ``k``, and nothing more (the server sends nothing unasked). Each bucket is checked against
the stream so far (``asyncrl.transport.buckets.BucketLayout``: entries, pieces, sizes, digest) before it is
handed out; ``live`` counts the received payload bytes still alive in the process (``peak``: the most at once).
Never: interprets tensor bytes (``asyncrl.quant`` loads and verifies them); reads a bucket before the one
handed out before it was released by the loop that took it (the next ``__next__`` call).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import zmq

from asyncrl.transport.buckets import BucketLayout, LiveBytes, ReceivedBucket
from asyncrl.transport.channel import ChannelTimeout, Envelope, ZmqChannel
from asyncrl.transport.keys import CurveConfig
from protocols import Error, WeightAnnounce, WeightBucket, WeightChunk, WeightDelta, WeightFetch


class WeightFetchError(RuntimeError):
    """A fetch failed: timeout, unknown version, or chunks that do not match the manifest. ``code``: the code of
    the server's refusal (``Error.code``: ``unknown_version``, ``aborted``, ``busy``...), empty otherwise."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class WeightFetchCancelled(WeightFetchError):
    """A fetch was given up because its ``cancel`` event was set (the process is leaving)."""


CANCEL_CHECK_S = 0.2
"""How often a fetch with a ``cancel`` event looks at it while it waits for the server."""
DRAIN_S = 5.0
"""After a bucketed fetch stopped early, the longest wait for the bucket already asked for (read and dropped,
so the next fetch starts on a clean socket)."""


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
        self.live = LiveBytes()

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

    def _request(self, req: WeightFetch, timeout_s: float, cancel: threading.Event | None) -> None:
        if cancel is not None and cancel.is_set():
            raise WeightFetchCancelled(f"fetch of version {req.version} cancelled before it was sent")
        if req.bucket == 0:  # a new fetch: drop what is left of one given up earlier (a timeout, a failed load)
            while self._dealer.recv(0.0) is not None:
                pass
        try:
            self._dealer.send(req, timeout_s=timeout_s)
        except ChannelTimeout:
            raise WeightFetchError(f"timed out after {timeout_s}s sending the request for version {req.version}: "
                                   f"the weight server is unreachable{self._refused_hint()}") from None

    def _recv(self, deadline: float, timeout_s: float, what: str, version: int,
              cancel: threading.Event | None) -> Envelope:
        """The next message of a fetch (WeightFetchError on a timeout or the server's ``Error``)."""
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
            raise WeightFetchError(f"weight server refused: {env.msg.message}", code=env.msg.code)
        return env

    def fetch(self, version: int = -1, timeout_s: float = 60.0, fmt: str = "",
              cancel: threading.Event | None = None, base_version: int = -1,
              base_checksum: str = "") -> tuple[WeightAnnounce | WeightDelta, list]:
        """All tensors of ``version`` (-1: latest), checked against the manifest, in manifest order; or, when
        ``base_version``/``base_checksum`` name what the caller holds and the server has a delta from it, the
        ``WeightDelta`` and its payload frames (checked against its parts).

        ``cancel``: when it is set, the fetch stops waiting and raises ``WeightFetchCancelled`` (a reply
        that arrives later is never read: the caller is leaving and closes the client)."""
        deadline = time.monotonic() + timeout_s
        self._request(WeightFetch(version=version, fmt=fmt, base_version=base_version, base_checksum=base_checksum),
                      timeout_s, cancel)
        ann = self._recv(deadline, timeout_s, "the announcement", version, cancel).msg
        return self._read_whole(ann, deadline, timeout_s, cancel, base_version, base_checksum)

    def _read_whole(self, ann, deadline: float, timeout_s: float, cancel: threading.Event | None,
                    base_version: int, base_checksum: str) -> tuple[WeightAnnounce | WeightDelta, list]:
        """The chunks that follow a one-piece answer ``ann`` (a ``WeightAnnounce`` or ``WeightDelta``)."""
        version = getattr(ann, "version", -1)
        if isinstance(ann, WeightDelta):
            if ann.base_version != base_version or ann.base_checksum != base_checksum:
                raise WeightFetchError(f"the server sent a delta from version {ann.base_version}, this client holds "
                                       f"{base_version}")
            frames: list = []
            moving = ann.payload_parts()
            for i, part in enumerate(moving):
                env = self._recv(deadline, timeout_s, f"delta part {i}", version, cancel)
                chunk = env.msg
                if not isinstance(chunk, WeightChunk) or chunk != WeightChunk.for_delta_part(
                        part, version=ann.version, index=i, count=len(moving)):
                    raise WeightFetchError(f"delta part {i} does not match {part.name!r}: {chunk!r}")
                frames.append(env.payload)
            return ann, frames
        if not isinstance(ann, WeightAnnounce):
            raise WeightFetchError(f"expected WeightAnnounce, got {type(ann).__name__}")
        buffers: list = []
        for i, spec in enumerate(ann.manifest):
            env = self._recv(deadline, timeout_s, f"chunk {i}", version, cancel)
            chunk = env.msg
            if not isinstance(chunk, WeightChunk) or not chunk.describes(spec, version=ann.version, index=i):
                raise WeightFetchError(f"chunk {i} does not match manifest entry {spec.name!r}: {chunk!r}")
            buffers.append(env.payload)
        return ann, buffers

    def stream(self, version: int = -1, timeout_s: float = 60.0, fmt: str = "",
               cancel: threading.Event | None = None, base_version: int = -1, base_checksum: str = "",
               bucket_bytes: int = -1) -> BucketStream:
        """``version`` (-1: latest) in buckets of ``bucket_bytes`` (-1: the server's size), or the delta from
        ``base_version``/``base_checksum`` when the server has it: a ``BucketStream`` whose first bucket's header
        is read (``first``), or whose ``whole`` holds the one-piece answer of a server that sends none (protocol
        1.5, or ``transport.bucket_mb=0``). ``timeout_s`` bounds each bucket's wait. Close it (``with``)."""
        if bucket_bytes == 0 or bucket_bytes < -1:
            raise ValueError(f"bucket_bytes must be > 0 or -1 (the server's size), got {bucket_bytes}")
        out = BucketStream(self, WeightFetch(version=version, fmt=fmt, base_version=base_version,
                                             base_checksum=base_checksum, bucket_bytes=bucket_bytes),
                           timeout_s, cancel)
        out.open()
        return out

    def _refused_hint(self) -> str:
        if self._dealer.stats.auth.get("refused"):
            return "; the server refused this client's CURVE key (not in its allow-list: `asyncrl keys add`)"
        return ""

    def close(self) -> None:
        self._sub.close()
        self._dealer.close()


class BucketStream:
    """One version fetched in buckets (``WeightClient.stream``; module docstring). Iterate it for
    ``ReceivedBucket``s: each is checked against the stream (WeightFetchError otherwise) and must be released
    (``ReceivedBucket.release``, the loader does) before the next is read. ``first``: bucket 0's header (the
    version, its form: ``is_delta``, the base); ``last``: the last header once read (its ``checksum``)."""

    def __init__(self, client: WeightClient, req: WeightFetch, timeout_s: float,
                 cancel: threading.Event | None) -> None:
        self._client, self._req, self._timeout_s, self._cancel = client, req, timeout_s, cancel
        self.layout = BucketLayout()
        self.whole: tuple[WeightAnnounce | WeightDelta, list] | None = None
        self.first: WeightBucket | None = None
        self.last: WeightBucket | None = None
        self._header: WeightBucket | None = None  # read, its pieces not yet
        self._asked = -1  # the last bucket asked for

    def open(self) -> None:
        self._ask(0, self._req)
        deadline = time.monotonic() + self._timeout_s
        msg = self._client._recv(deadline, self._timeout_s, "bucket 0", self._req.version, self._cancel).msg
        if isinstance(msg, WeightBucket):
            self.first = self._header = msg
            return
        self.whole = self._client._read_whole(msg, deadline, self._timeout_s, self._cancel, self._req.base_version,
                                              self._req.base_checksum)
        self._asked = -1

    @property
    def version(self) -> int:
        if self.first is not None:
            return self.first.version
        assert self.whole is not None
        return self.whole[0].version

    def _ask(self, k: int, req: WeightFetch) -> None:
        self._client._request(req, self._timeout_s, self._cancel)
        self._asked = k

    def __iter__(self) -> Iterator[ReceivedBucket]:
        return self

    def __next__(self) -> ReceivedBucket:
        if self.first is None or self.layout.done:
            raise StopIteration
        k = self.layout.next_index
        deadline = time.monotonic() + self._timeout_s
        h = self._header
        if h is None:
            msg = self._client._recv(deadline, self._timeout_s, f"bucket {k}", self.first.version, self._cancel).msg
            if not isinstance(msg, WeightBucket):
                raise WeightFetchError(f"expected bucket {k} of version {self.first.version}, got "
                                       f"{type(msg).__name__}")
            h = msg
        self._header = None
        try:
            self.layout.check_header(h)
        except ValueError as e:
            raise WeightFetchError(f"version {self.first.version}: {e}") from None
        if not h.last:  # the next bucket travels while this one is loaded
            f = self.first
            base = (f.base_version, f.base_checksum) if f.is_delta else (-1, "")
            self._ask(k + 1, WeightFetch(version=f.version, fmt=f.fmt, base_version=base[0], base_checksum=base[1],
                                         bucket_bytes=f.bucket_bytes, bucket=k + 1))
        chunks, payloads = [], []
        for i in range(h.pieces):
            env = self._client._recv(deadline, self._timeout_s, f"bucket {k} piece {i}", h.version, self._cancel)
            if not isinstance(env.msg, WeightChunk) or env.payload is None:
                raise WeightFetchError(f"bucket {k} piece {i} of version {h.version}: got {type(env.msg).__name__}")
            self._client.live.track(env.payload)
            chunks.append(env.msg)
            payloads.append(memoryview(env.payload))
        try:
            self.layout.check_pieces(h, chunks, payloads)
        except ValueError as e:
            raise WeightFetchError(f"version {h.version}: {e}") from None
        if h.last:
            self.last = h
        return ReceivedBucket(h, [(c.name, c.offset, p) for c, p in zip(chunks, payloads, strict=True)])

    def close(self) -> None:
        """Read and drop the bucket asked for and not read (the loop stopped early; anything left of the bucket
        before it too), within ``DRAIN_S``, so the next fetch starts on a clean socket."""
        if self.first is None or self._asked < self.layout.next_index or self.layout.done:
            return
        deadline = time.monotonic() + min(self._timeout_s, DRAIN_S)
        h, self._header = self._header, None
        try:
            while not (isinstance(h, WeightBucket) and h.index == self._asked):
                h = self._client._recv(deadline, DRAIN_S, "a bucket to drop", self.first.version, None).msg
            for _ in range(h.pieces):
                self._client._recv(deadline, DRAIN_S, "a piece to drop", self.first.version, None)
        except WeightFetchError:
            pass
        self._asked = -1

    def __enter__(self) -> BucketStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
