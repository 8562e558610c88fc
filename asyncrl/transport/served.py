"""What a weight server holds per published version, complete or still being made.

Owns: ``PublishedVersion`` (a version in one format: its announcement and buffers, its delta from the version
before, and the same as item streams for bucketed fetches, ``asyncrl.transport.buckets``) and
``LivePublication``, the publisher's handle on a version being published tensor by tensor
(``WeightServer.begin``). ``asyncrl.transport.weights`` serves them.
Never: touches a socket, or copies a buffer (streams are views of the published buffers, which must not change).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Protocol

from asyncrl.transport.buckets import ItemStream
from protocols import DeltaPart, TensorSpec, WeightAnnounce, WeightDelta, WeightFetch


class _Server(Protocol):
    _lock: threading.Lock
    _progress: threading.Event
    _parked: list


@dataclasses.dataclass
class PublishedVersion:
    announce: WeightAnnounce
    buffers: list  # bytes-like, one per manifest entry, in manifest order
    delta: WeightDelta | None = None  # the same version as changes from the version before it
    delta_buffers: list = dataclasses.field(default_factory=list)  # one per part that carries a frame
    complete: bool = True  # False while a streamed publication (``begin``) is still being made
    delta_base: tuple[int, str] | None = None  # (version, checksum) a delta of this version starts from
    aborted: str = ""  # why a streamed publication was given up
    full_items: ItemStream | None = None  # the version as a stream of items, for bucketed fetches
    delta_items: ItemStream | None = None

    def __post_init__(self) -> None:
        if self.complete:
            self.check()
        if self.delta is not None:
            self.delta_base = (self.delta.base_version, self.delta.base_checksum)

    def check(self) -> None:
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

    def stream(self, req: WeightFetch) -> tuple[ItemStream | None, bool]:
        """The item stream a bucketed fetch gets (None: not made yet), and whether it is the delta: the delta
        to a fetch that names its base, else the version whole (built from the buffers on first use)."""
        if (self.delta_base is not None and req.base_version >= 0
                and (req.base_version, req.base_checksum) == self.delta_base):
            if self.delta_items is None and self.delta is not None:
                self.delta_items = ItemStream.of(self.delta.manifest, self.delta_buffers, self.delta.parts)
            return self.delta_items, True
        if self.full_items is None and self.complete:
            self.full_items = ItemStream.of(self.announce.manifest, self.buffers)
        return self.full_items, False


class LivePublication:
    """A version being published in buckets (``WeightServer.begin``): ``add`` each tensor (and, with a delta,
    ``add_delta`` its part) as soon as it is made, then ``finish`` with the complete version, or ``abort``.
    Buffers must not change once added. Use from one thread."""

    def __init__(self, server: _Server, entry: PublishedVersion) -> None:
        self._server, self._entry = server, entry

    def add(self, spec: TensorSpec, buffer) -> None:
        with self._server._lock:
            assert self._entry.full_items is not None
            self._entry.full_items.add(spec, buffer)
        self._wake()

    def add_delta(self, spec: TensorSpec, part: DeltaPart, frame) -> None:
        """Entry ``spec``'s part of the delta from ``delta_base`` (``frame``: its bytes; None for ``same``)."""
        with self._server._lock:
            if self._entry.delta_items is None:
                raise ValueError("this publication was begun without a delta_base")
            self._entry.delta_items.add(spec, b"" if frame is None else frame, part)
        self._wake()

    def _wake(self) -> None:
        if self._server._parked:  # a request waits for bytes: the serving loop looks again
            self._server._progress.set()

    def finish(self, announce: WeightAnnounce, buffers: list, delta: WeightDelta | None = None,
               delta_buffers: list | None = None) -> None:
        """The complete version (as ``WeightServer.publish`` takes it): one-piece fetches are answered from now on.
        ValueError (and the publication aborted) when it does not match what was added."""
        e = self._entry
        try:
            if (announce.version, announce.fmt) != (e.announce.version, e.announce.fmt):
                raise ValueError(f"finishing version {e.announce.version} ({e.announce.fmt}) with "
                                 f"{announce.version} ({announce.fmt})")
            done = PublishedVersion(announce, list(buffers), delta, list(delta_buffers or []))
            _same_items(e.full_items, announce.manifest, None)
            if delta is not None and (e.delta_base != (delta.base_version, delta.base_checksum)):
                raise ValueError(f"the delta starts at {delta.base_version}, the publication was begun for "
                                 f"{e.delta_base}")
            if e.delta_items is not None:
                if delta is None:
                    raise ValueError("the publication was begun with a delta and finished without one")
                _same_items(e.delta_items, delta.manifest, delta.parts)
        except ValueError as exc:
            self.abort(str(exc))
            raise
        with self._server._lock:
            e.announce, e.buffers, e.delta, e.delta_buffers = done.announce, done.buffers, done.delta, done.delta_buffers
            for items in (e.full_items, e.delta_items):
                if items is not None:
                    items.done = True
            e.complete = True
        self._server._progress.set()

    def abort(self, reason: str) -> None:
        """Give the version up: every fetch of it, waiting or to come, is answered with an error."""
        with self._server._lock:
            self._entry.aborted = reason or "the learner gave this version up"
        self._server._progress.set()


def _same_items(items: ItemStream | None, manifest: list[TensorSpec], parts: list[DeltaPart] | None) -> None:
    if items is None:
        raise ValueError("no items were added")
    added = {(it.spec.name, it.spec.digest, None if it.part is None else it.part.nbytes) for it in items.items}
    listed: list[DeltaPart | None] = list(parts) if parts is not None else [None] * len(manifest)
    want = {(e.name, e.digest, None if p is None else p.nbytes) for e, p in zip(manifest, listed, strict=True)}
    if added != want or len(items.items) != len(manifest):
        raise ValueError(f"the items added ({len(items.items)}) are not the version's {len(manifest)} entries")
