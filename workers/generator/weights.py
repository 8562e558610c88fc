"""A generation worker's weights: the newest version fetched and handed to the engine (whole, as a delta from
the version it holds, or bucket by bucket as it arrives), also from the new server of a learner that restarted.

Owns: ``WeightSync``, the weight client, the format fetched, the version (and checksum) handed to the engine,
whether the next fetch goes to a new server first, and the weight counters of the heartbeats and Goodbye. A
learner that came back older than the weights the engine holds cannot be followed: the worker gives up, saying so.
Never: opens the control socket or speaks the work protocol (``workers/generator/process.py``).

Invariant: after start-up, the comms thread alone calls these methods (it owns every socket).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import protocols as P
from asyncrl.engine.base import RolloutEngine
from asyncrl.learner.memory import malloc_trim
from asyncrl.transport import WeightClient, WeightFetchCancelled, WeightFetchError
from workers.generator.args import built
from workers.generator.join import ControlLink

log = logging.getLogger("asyncrl.worker")

FIRST_WEIGHTS_TIMEOUT_S = 120.0
"""The first weight fetch (the learner may still be publishing its first version)."""
WEIGHTS_TIMEOUT_S = 60.0
"""Fetching an announced version; on failure the worker keeps its current weights."""
FIRST_WEIGHTS_RETRY_S = 0.5
"""Between asks for the first weights while the server has none in this worker's format yet."""
TRANSIENT_REFUSALS = ("unknown_version", "aborted", "busy")
"""Refusals of the server that a later ask can get past: the version in this format is not out yet, it was given
up while being published, or too many requests wait already."""
REFETCH_TIMEOUT_S = 60.0
"""The first fetch from a learner's new weight server (it publishes its version before it joins)."""


class WeightSync:
    """The weights the worker of ``link`` hands to ``engine``, fetched in format ``fmt`` (see module docstring);
    ``give_up(reason)`` makes the worker leave (a learner it cannot follow)."""

    client: WeightClient | None = None

    def __init__(self, engine: RolloutEngine, fmt: str, link: ControlLink, give_up: Callable[[str], None]) -> None:
        self.engine, self.fmt, self.link, self.give_up = engine, fmt, link, give_up
        self.version = -1  # newest version handed to the engine (applied at its next step)
        self.checksum = ""  # of that version (WeightAnnounce.checksum)
        self.refetch = False  # a new weight server: fetch its newest version before polling its announcements
        self.stream_ok = callable(getattr(engine, "load_stream", None))  # bucket by bucket as it arrives (native)
        self.delta_ok = False  # whether the engine applies weight deltas (set once its first weights are in)
        self.sync_s = 0.0  # seconds spent fetching + unpacking + handing over new versions (comms thread)
        self.syncs = 0
        self.deltas = 0  # of those, versions fetched as a delta from the one before (transport.delta)
        self.bytes = 0  # payload bytes fetched, whole versions and deltas

    def __str__(self) -> str:
        return f"{self.syncs} weight versions fetched ({self.deltas} as deltas), {self.bytes / 1e6:.1f} MB"

    def connect(self, setup: P.WorkerSetup) -> None:
        """Fetch from the weight server ``setup`` names (a new one: its newest version first)."""
        if self.client is not None:
            self.client.close()
            self.refetch = True
        self.client = WeightClient(setup.weights_announce, setup.weights_fetch,
                                   identity=f"{self.link.identity}-w".encode(), curve=self.link.curve)

    @property
    def _client(self) -> WeightClient:
        return built(self.client, "weight client")

    def load(self, version: int, timeout_s: float = FIRST_WEIGHTS_TIMEOUT_S,
             cancel: threading.Event | None = None) -> None:
        t0 = time.perf_counter()
        # The previous version's frames (and, at the first fetch, the fp32 skeleton the engine was quantized
        # from) are free by now but mostly stay in glibc's heap: give them back before the next arrives
        # (docs/benchmarks.md §8, where the job's memory goes).
        malloc_trim()
        base, base_checksum = self._delta_base()
        if self.stream_ok:
            self._stream(version, timeout_s, cancel, base, base_checksum, t0)
            return
        ann, buffers = self._client.fetch(version, timeout_s=timeout_s, fmt=self.fmt, cancel=cancel,
                                          base_version=base, base_checksum=base_checksum)
        if ann.version <= self.version:
            return
        self.take(ann, buffers, t0)

    def first(self, cancel: threading.Event) -> None:
        """The newest version served in this worker's format, waiting up to ``FIRST_WEIGHTS_TIMEOUT_S`` for one:
        a learner publishes a version's formats one after another, and a worker of a new format (or one that
        starts before the first publication) is refused until its format is out. Any other failure raises."""
        deadline = time.monotonic() + FIRST_WEIGHTS_TIMEOUT_S
        while True:
            try:
                self.load(-1, timeout_s=max(1.0, deadline - time.monotonic()), cancel=cancel)
                return
            except WeightFetchCancelled:
                raise
            except WeightFetchError as e:
                if e.code not in TRANSIENT_REFUSALS or time.monotonic() >= deadline:
                    raise
                log.info("worker %s: no weights in %s yet (%s); asking again", self.link.worker_id, self.fmt, e)
                if cancel.wait(FIRST_WEIGHTS_RETRY_S):
                    raise WeightFetchCancelled("stopped while waiting for the first weights") from None

    def _stream(self, version: int, timeout_s: float, cancel: threading.Event | None, base: int,
                base_checksum: str, t0: float) -> None:
        """The version in buckets, each loaded into the engine as it arrives (``transport.bucket_mb``); a learner
        that sends none (``bucket_mb=0``, protocol 1.5) answers in one piece, handed over as before. On an error
        the engine holds the version before; the next fetch after a failed delta is whole."""
        engine: Any = self.engine
        with self._client.stream(version, timeout_s=timeout_s, fmt=self.fmt, cancel=cancel, base_version=base,
                                 base_checksum=base_checksum) as stream:
            if stream.whole is not None:
                ann, buffers = stream.whole
                if ann.version > self.version:
                    self.take(ann, buffers, t0)
                return
            if stream.version <= self.version:
                return
            try:
                loaded = engine.load_stream(stream.version, stream)
            except Exception:
                if base >= 0:
                    self.checksum = ""
                raise
        self.version, self.checksum = loaded.version, loaded.checksum
        self._count(loaded.stream_bytes, loaded.is_delta, t0)

    def _delta_base(self) -> tuple[int, str]:
        """(version, checksum) of the weights handed to the engine, offered as the base of a delta: only for an
        engine that applies deltas (native), and never after one failed to apply (that fetch goes whole)."""
        if not self.delta_ok or self.version < 0 or not self.checksum:
            return -1, ""
        return self.version, self.checksum

    def take(self, ann: Any, buffers: Any, t0: float) -> None:
        """Hand fetched weights to the engine (applied at its next step); ``t0``: when the fetch began."""
        from asyncrl.transport.publication import from_wire

        self.engine.update_weights(ann.version, from_wire(ann, buffers))
        self.checksum = ann.checksum
        self.version = ann.version
        self._count(ann.total_bytes, isinstance(ann, P.WeightDelta), t0)

    def _count(self, nbytes: int, delta: bool, t0: float) -> None:
        self.deltas += int(delta)
        self.bytes += nbytes
        self.sync_s += time.perf_counter() - t0
        self.syncs += 1

    def poll(self, stop: threading.Event) -> bool:
        """Fetch and hand over the newest announced version; True if the engine got new weights."""
        if self.refetch:
            return self._from_new_server(stop)
        if getattr(self.engine, "take_delta_failure", lambda: False)():
            # the engine kept the version before the delta: fetch the newest whole, from what it holds
            log.error("worker %s: a weight delta did not apply; fetching the newest version whole", self.link.worker_id)
            self.version, self.checksum = self.engine.version, ""
            try:
                self.load(-1, timeout_s=WEIGHTS_TIMEOUT_S)
            except (WeightFetchError, ValueError) as e:
                log.error("could not load the newest weights, keeping v%d: %s", self.engine.version, e)
                return False
            return True
        ann = self._client.poll_announce(0.0, fmt=self.fmt)
        if ann is None or ann.version <= self.version:
            return False
        try:
            self.load(ann.version, timeout_s=WEIGHTS_TIMEOUT_S)
        except (WeightFetchError, ValueError) as e:  # QuantError is a ValueError: keep the old version
            log.error("could not load weights v%d, keeping v%d: %s", ann.version, self.engine.version, e)
            return False
        return True

    def _from_new_server(self, stop: threading.Event) -> bool:
        """The newest version of a new weight server; True if the engine got new weights. A learner that
        came back at an older version than this engine's cannot be followed: the worker leaves."""
        t0 = time.perf_counter()
        try:
            ann, buffers = self._client.fetch(-1, timeout_s=REFETCH_TIMEOUT_S, fmt=self.fmt, cancel=stop)
        except WeightFetchCancelled:
            return False
        except (WeightFetchError, ValueError) as e:  # tried again next turn
            log.error("worker %s: no weights from the learner's new server yet: %s", self.link.worker_id, e)
            return False
        self.refetch = False
        same = ann.version == self.version and ann.checksum == self.checksum
        if ann.version < self.version or (ann.version == self.version and not same):
            # it resumed from a checkpoint older than the weights this engine holds, which cannot be replaced
            # by a version that is not newer
            self.give_up(f"the learner came back at version {ann.version}, and this worker holds other weights of "
                         f"version {self.version} (it resumed from an older checkpoint); its engine cannot go "
                         f"back: start this worker again (`asyncrl worker controller={self.link.controller}` with its settings)")
            return False
        if same:  # the learner stopped with a checkpoint of the version this worker holds, and came back there
            return False
        self.take(ann, buffers, t0)
        return True
