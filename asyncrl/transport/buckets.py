"""Bucketed streaming of a weight version: the byte stream a version travels as, cut into fixed-size buckets.

Owns: ``ItemStream``, the items of one wire form of a version (whole: its manifest entries and their tensor
bytes; a delta: its parts and their frames) in stream order, which may still grow while the learner
publishes, and ``cut``, bucket ``k`` of size ``B`` out of it (the entries that start in it, its pieces, its
digest); on the worker's side, ``BucketLayout``, the check that each received bucket is the next slice of that
stream (entries, pieces, byte counts, digest), and ``ReceivedBucket``, what a loader gets.

The stream: the items' bytes back to back, in the order the publisher made them; bucket ``k`` is its bytes
``[k*B, (k+1)*B)`` (the last bucket fewer). An item belongs to the bucket its first byte is in (an item with no
bytes, a delta's ``same`` part, to the bucket of the position it sits at; past the last byte, to the last
bucket). A bucket is ready once the stream holds a byte past its end (so more is certain to follow) or the
version is complete (then its size and whether it is the last are known). Wire form: ``protocols.WeightBucket``.

Never: interprets tensor bytes beyond hashing them (``asyncrl.quant`` loads and verifies them).
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
import weakref
from typing import Any

import xxhash

from protocols import DeltaPart, TensorSpec, WeightBucket, WeightChunk

DIGEST_ALGO = "xxh3_128"


def bucket_digest(pieces: list[memoryview]) -> str:
    """XXH3-128 of a bucket's bytes, its pieces in order: ``"xxh3_128:<hex>"``."""
    h = xxhash.xxh3_128()
    for p in pieces:
        h.update(p)
    return f"{DIGEST_ALGO}:{h.hexdigest()}"


def _u8(buf: Any) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


@dataclasses.dataclass(frozen=True)
class Item:
    spec: TensorSpec
    part: DeltaPart | None  # a delta's part of this entry; None for a whole version
    data: memoryview  # the item's bytes (empty for a ``same`` part)
    start: int  # where they start in the stream


@dataclasses.dataclass(frozen=True)
class Cut:
    """Bucket ``index``: its entries (those that start in it), its pieces (entry name, offset in the entry's
    bytes, bytes), its byte count and whether it is the version's last bucket."""

    index: int
    entries: list[Item]
    pieces: list[tuple[str, int, memoryview]]
    nbytes: int
    last: bool


class ItemStream:
    """One wire form of a version as a stream of items (see module docstring). ``add`` from the publishing
    thread, ``ready``/``cut`` from the server's: the caller serialises them (``WeightServer``'s lock)."""

    def __init__(self) -> None:
        self.items: list[Item] = []
        self._starts: list[int] = []
        self.total = 0
        self.done = False
        self._digests: dict[tuple[int, int], str] = {}

    @classmethod
    def of(cls, specs: list[TensorSpec], buffers: list, parts: list[DeltaPart] | None = None) -> ItemStream:
        """The complete stream of a version published in one go: whole (``parts`` None: one buffer per entry)
        or a delta (one part per entry, one buffer per part that carries a frame), in manifest order."""
        out = cls()
        bufs = iter(buffers)
        for i, spec in enumerate(specs):
            part = None if parts is None else parts[i]
            out.add(spec, b"" if part is not None and part.kind == "same" else next(bufs), part)
        out.done = True
        return out

    def add(self, spec: TensorSpec, data: Any, part: DeltaPart | None = None) -> None:
        view = _u8(data)
        want = spec.nbytes if part is None else part.nbytes
        if view.nbytes != want:
            raise ValueError(f"tensor {spec.name!r}: {want} bytes expected, the buffer has {view.nbytes}")
        if self.done:
            raise ValueError(f"tensor {spec.name!r} added to a version already complete")
        self.items.append(Item(spec, part, view, self.total))
        self._starts.append(self.total)
        self.total += view.nbytes

    def buckets(self, size: int) -> int:
        """How many buckets of ``size`` a complete stream is (at least one)."""
        return max(1, -(-self.total // size))

    def ready(self, k: int, size: int) -> bool:
        return self.done or self.total > (k + 1) * size

    def cut(self, k: int, size: int) -> Cut:
        """Bucket ``k`` of ``size`` bytes; call when ``ready`` (IndexError for a bucket past the last)."""
        lo, hi_full = k * size, (k + 1) * size
        last = self.done and hi_full >= self.total
        if self.done and k >= self.buckets(size):
            raise IndexError(f"bucket {k} of a version of {self.buckets(size)} buckets of {size} bytes")
        hi = min(hi_full, self.total)
        first_entry = bisect.bisect_left(self._starts, lo)
        end_entry = len(self.items) if last else bisect.bisect_left(self._starts, hi_full)
        pieces = []
        j = max(0, bisect.bisect_right(self._starts, lo) - 1)
        while j < len(self.items) and self.items[j].start < hi:
            it = self.items[j]
            a, b = max(lo, it.start), min(hi, it.start + it.data.nbytes)
            if b > a:
                pieces.append((it.spec.name, a - it.start, it.data[a - it.start:b - it.start]))
            j += 1
        return Cut(k, self.items[first_entry:end_entry], pieces, hi - lo if hi > lo else 0, last)

    def digest(self, cut: Cut, size: int, *, keep: bool) -> str:
        """The digest of a cut bucket; ``keep``: remember it (the server's own bucket size: every worker asks
        for the same buckets; other sizes are hashed per request, so no asker can grow this table)."""
        key = (cut.index, size)
        if key in self._digests:
            return self._digests[key]
        d = bucket_digest([p for _, _, p in cut.pieces])
        if keep and (self.done or not cut.last):
            self._digests[key] = d
        return d


@dataclasses.dataclass
class ReceivedBucket:
    """A bucket as a worker received and checked it: its header and its pieces (entry name, offset in that
    entry's bytes, bytes). ``release()`` drops the pieces (the loader calls it once they are written), so the
    receive buffers go before the next bucket is read."""

    header: WeightBucket
    pieces: list[tuple[str, int, memoryview]]

    def release(self) -> None:
        self.pieces = []


class BucketLayout:
    """The worker's check that the buckets it receives are, one after the other, the slices of one stream
    (module docstring): every piece is the next bytes of the entry the stream is at, every bucket holds its
    full size but the last, the entries of a bucket start in it, and the bytes match the bucket's digest.
    ``check`` raises ``ValueError`` naming what is wrong (the caller turns it into a failed fetch)."""

    def __init__(self) -> None:
        self.first: WeightBucket | None = None
        self.lengths: list[tuple[str, int]] = []  # (entry name, stream bytes), in stream order
        self.listed = 0  # stream bytes of every entry listed so far
        self.cursor = 0  # entry index the stream is at
        self.offset = 0  # bytes of that entry already received
        self.position = 0  # stream bytes received
        self.next_index = 0
        self.done = False

    def check_header(self, h: WeightBucket) -> None:
        if self.done:
            raise ValueError(f"bucket {h.index} after the last bucket")
        if h.index != self.next_index:
            raise ValueError(f"bucket {h.index} where bucket {self.next_index} was expected (one dropped?)")
        if self.first is None:
            self.first = h
        elif _version_fields(h) != _version_fields(self.first):
            raise ValueError(f"bucket {h.index} is of another version or form than bucket 0: {_version_fields(h)} "
                             f"!= {_version_fields(self.first)}")
        lo, hi = h.index * h.bucket_bytes, (h.index + 1) * h.bucket_bytes
        if self.position != lo:
            raise ValueError(f"bucket {h.index} starts at stream byte {lo}, {self.position} bytes were received")
        if not h.last and h.nbytes != h.bucket_bytes:
            raise ValueError(f"bucket {h.index} of {h.nbytes} bytes is not the last but is short of "
                             f"{h.bucket_bytes}")
        parts: list[DeltaPart | None] = list(h.parts) or [None] * len(h.entries)
        for e, p in zip(h.entries, parts, strict=True):
            if not (lo <= self.listed and (h.last or self.listed < hi)):
                raise ValueError(f"entry {e.name!r} starts at stream byte {self.listed}, outside bucket {h.index}")
            n = e.nbytes if p is None else p.nbytes
            self.lengths.append((e.name, n))
            self.listed += n

    def check_pieces(self, h: WeightBucket, chunks: list[WeightChunk], payloads: list[memoryview]) -> None:
        got = 0
        for i, (c, data) in enumerate(zip(chunks, payloads, strict=True)):
            self._skip_empty()
            if self.cursor >= len(self.lengths):
                raise ValueError(f"bucket {h.index} piece {i} ({c.name!r}) lies past every entry listed so far")
            name, n = self.lengths[self.cursor]
            if (c.version, c.index, c.count, c.name, c.offset) != (h.version, i, h.pieces, name, self.offset) \
                    or c.nbytes != data.nbytes or c.nbytes < 1 or self.offset + c.nbytes > n:
                raise ValueError(f"bucket {h.index} piece {i} is {c.name!r} bytes [{c.offset}, +{c.nbytes}) of "
                                 f"version {c.version}; the stream is at {name!r} byte {self.offset} of {n}")
            self.offset += c.nbytes
            got += c.nbytes
            if self.offset == n:
                self.cursor, self.offset = self.cursor + 1, 0
        if got != h.nbytes:
            raise ValueError(f"bucket {h.index} says {h.nbytes} bytes, its pieces hold {got}")
        if bucket_digest(payloads) != h.digest:
            raise ValueError(f"bucket {h.index}'s bytes do not match its digest (corrupted in transit)")
        self.position += got
        self.next_index += 1
        if h.last:
            self._skip_empty()
            if self.cursor != len(self.lengths) or self.position != h.total_bytes or self.listed != h.total_bytes:
                raise ValueError(f"the last bucket ends the stream at byte {self.position} of {self.listed} listed "
                                 f"and {h.total_bytes} announced")
            self.done = True

    def _skip_empty(self) -> None:
        while self.cursor < len(self.lengths) and self.lengths[self.cursor][1] == 0:
            self.cursor += 1


def _version_fields(h: WeightBucket) -> tuple:
    return (h.version, h.fmt, h.bucket_bytes, h.base_version, h.base_checksum, h.aqn_seed, h.aqn_sigma,
            h.aqn_resample)


class LiveBytes:
    """How many payload bytes received by a client are still alive anywhere in the process (each received
    zmq frame is followed by a finalizer), and the most there were at once."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self._lock = threading.Lock()  # a frame may be freed on another thread than the one that received it

    def track(self, payload: Any) -> None:
        owner = getattr(payload, "obj", None)  # the zmq.Frame a zero-copy payload is a view of
        n = memoryview(payload).nbytes
        if owner is None:
            return
        try:
            weakref.finalize(owner, self._freed, n)
        except TypeError:  # not weak-referenceable (bytes): not counted
            return
        with self._lock:
            self.now += n
            self.peak = max(self.peak, self.now)

    def _freed(self, n: int) -> None:
        with self._lock:
            self.now -= n

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.now
