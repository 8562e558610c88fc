"""A generation worker's side of a controller or learner that restarted under it.

Owns: where the worker's sample and weight sockets point, and following them when a ``Welcome``
names new ones (a controller that restarted binds a new sample port; a learner that restarted serves
its weights from a new server, and the controller tells every worker), the first fetch from a new
weight server, and the worker's bounded wait for a controller without a learner. Where the worker
cannot go on (the learner came back at a version older than the weights this worker's engine already
holds, or no learner came back at all), it leaves with one line that says which role to start again.
Never: runs the engine loop or speaks the work protocol (``workers/generator/process.py``).

Invariant: the comms thread alone calls these methods (it owns every socket).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

import protocols as P
from asyncrl.transport import WeightClient, WeightFetchCancelled, WeightFetchError, ZmqChannel

if TYPE_CHECKING:
    import threading

    from asyncrl.transport import CurveConfig

log = logging.getLogger("asyncrl.worker")

REFETCH_TIMEOUT_S = 60.0
"""The first fetch from a learner's new weight server (it publishes its version before it joins)."""


class RejoinMixin:
    """Mixed into ``GeneratorWorker``; the attributes below are the worker's own."""

    worker_id: str
    controller: str
    identity: str
    curve: CurveConfig | None
    ctx: zmq.Context
    setup: P.WorkerSetup | None = None  # the WorkerSetup of the last Welcome (where samples and weights go)
    push: ZmqChannel | None
    weights: WeightClient | None
    weights_version: int
    weights_checksum: str = ""  # of the version the engine holds (WeightAnnounce.checksum)
    wire_fmt: str
    drain_s: float
    stop: threading.Event
    gave_up: str
    refetch: bool = False  # a new weight server: fetch its newest version before polling its announcements
    not_ready_since: float | None = None
    no_learner_limit_s: float  # the worker's no_learner_s= (asyncrl.config.roles.WorkerRoleConfig)
    _take_weights: Callable[[Any, Any, float], None]  # GeneratorWorker's: hand fetched weights to the engine

    def _weight_client(self, setup: P.WorkerSetup) -> WeightClient:
        return WeightClient(setup.weights_announce, setup.weights_fetch, identity=f"{self.identity}-w".encode(),
                            curve=self.curve)

    def _rejoined(self, welcome: P.Welcome) -> None:
        """A Welcome after the worker joined: the controller took it back after it restarted, or tells it
        where a restarted learner serves its weights. Follows every address that moved."""
        try:
            setup = welcome.worker_setup()
        except ValueError as e:
            log.warning("worker %s: a Welcome without a usable setup (%s); keeping its addresses", self.worker_id, e)
            return
        old = self.setup
        if old is not None and setup.samples_address != old.samples_address and self.push is not None:
            log.info("worker %s: samples now go to %s (was %s)", self.worker_id, setup.samples_address,
                     old.samples_address)
            self.push.close(linger_s=0)  # what waits there was for a controller that is gone
            self.push = ZmqChannel.connect(zmq.PUSH, setup.samples_address, name="worker-samples",
                                           curve=self.curve, context=self.ctx)
        moved = old is None or (setup.weights_announce, setup.weights_fetch) != (old.weights_announce,
                                                                                  old.weights_fetch)
        if moved and self.weights is not None:
            log.info("worker %s: the learner now serves weights at %s (was %s)", self.worker_id,
                     setup.weights_fetch, old.weights_fetch if old else "?")
            self.weights.close()
            self.weights = self._weight_client(setup)
            self.refetch = True
        self.setup = setup
        log.info("worker %s re-registered with the controller (version %d)", self.worker_id, welcome.latest_version)

    def _fetch_from_new_learner(self) -> bool:
        """The newest version of a new weight server; True if the engine got new weights. A learner that
        came back at an older version than this engine's cannot be followed: the worker leaves."""
        t0 = time.perf_counter()
        assert self.weights is not None
        try:
            ann, buffers = self.weights.fetch(-1, timeout_s=REFETCH_TIMEOUT_S, fmt=self.wire_fmt, cancel=self.stop)
        except WeightFetchCancelled:
            return False
        except (WeightFetchError, ValueError) as e:  # tried again next turn
            log.error("worker %s: no weights from the learner's new server yet: %s", self.worker_id, e)
            return False
        self.refetch = False
        same = ann.version == self.weights_version and ann.checksum == self.weights_checksum
        if ann.version < self.weights_version or (ann.version == self.weights_version and not same):
            # it resumed from a checkpoint older than the weights this engine holds, which cannot be replaced
            # by a version that is not newer
            self._give_up(f"the learner came back at version {ann.version}, and this worker holds other weights of "
                          f"version {self.weights_version} (it resumed from an older checkpoint); its engine cannot go "
                          f"back: start this worker again (`asyncrl worker controller={self.controller}` with its "
                          "settings)")
            return False
        if same:  # the learner stopped with a checkpoint of the version this worker holds, and came back there
            return False
        self._take_weights(ann, buffers, t0)
        return True

    def _not_ready(self, now: float) -> None:
        """The controller has no learner (it restarted): wait a bounded time for one to join it."""
        if self.not_ready_since is None:
            self.not_ready_since = now
            log.warning("worker %s: the controller has no learner (it restarted?); waiting up to %.0f s for one "
                        "to join", self.worker_id, self.no_learner_limit_s)
        elif now - self.not_ready_since > self.no_learner_limit_s:
            self._give_up(f"the controller at {self.controller} has had no learner for {self.no_learner_limit_s:.0f} "
                          f"s (it restarted and no learner joined it): start the learner again (`asyncrl learner "
                          f"controller={self.controller}`), then this worker")

    def _give_up(self, reason: str) -> None:
        """Leave at once (unfinished samples handed back), exit 1 with ``reason`` as the last line."""
        if not self.gave_up:
            log.error("worker %s leaves: %s", self.worker_id, reason)
            self.gave_up = reason
            self.drain_s = 0.0
            self.stop.set()
