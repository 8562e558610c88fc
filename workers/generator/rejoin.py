"""A generation worker's side of a controller or learner that restarted under it.

Owns: ``Peers``, where the worker's sample and weight sockets point (the last ``Welcome``'s setup), followed when
a ``Welcome`` names new ones (a restarted controller's sample port; a restarted learner's weight server, which
its ``WeightSync`` fetches from, the newest version first), and the bounded wait for a controller without a
learner: when none came back, the reason to leave, saying which role to start again.
Never: runs the engine loop or speaks the work protocol (``workers/generator/process.py``).

Invariant: after start-up, the comms thread alone calls these methods (it owns every socket).
"""

from __future__ import annotations

import logging

import zmq

import protocols as P
from asyncrl.transport import ZmqChannel
from workers.generator.join import ControlLink
from workers.generator.weights import WeightSync

log = logging.getLogger("asyncrl.worker")


class Peers:
    """The sample socket of the worker of ``link`` and the weight server ``weights`` fetches from, as ``setup``
    names them; ``no_learner_s``: how long to wait for a learner a restarted controller lacks."""

    def __init__(self, setup: P.WorkerSetup, weights: WeightSync, link: ControlLink, no_learner_s: float) -> None:
        self.setup, self.weights, self.link, self.no_learner_s = setup, weights, link, no_learner_s
        self.worker_id, self.controller = link.worker_id, link.controller
        self.not_ready_since: float | None = None
        self.push = self._connect(setup)
        weights.connect(setup)

    def _connect(self, setup: P.WorkerSetup) -> ZmqChannel:
        return ZmqChannel.connect(zmq.PUSH, setup.samples_address, name="worker-samples", curve=self.link.curve,
                                  context=self.link.ctx)

    def rejoined(self, welcome: P.Welcome) -> None:
        """A Welcome after the worker joined: the controller took it back after it restarted, or tells it
        where a restarted learner serves its weights. Follows every address that moved."""
        self.not_ready_since = None
        try:
            setup = welcome.worker_setup()
        except ValueError as e:
            log.warning("worker %s: a Welcome without a usable setup (%s); keeping its addresses", self.worker_id, e)
            return
        old = self.setup
        if setup.samples_address != old.samples_address:
            log.info("worker %s: samples now go to %s (was %s)", self.worker_id, setup.samples_address,
                     old.samples_address)
            self.push.close(linger_s=0)  # what waits there was for a controller that is gone
            self.push = self._connect(setup)
        if (setup.weights_announce, setup.weights_fetch) != (old.weights_announce, old.weights_fetch):
            log.info("worker %s: the learner now serves weights at %s (was %s)", self.worker_id,
                     setup.weights_fetch, old.weights_fetch)
            self.weights.connect(setup)
        self.setup = setup
        log.info("worker %s re-registered with the controller (version %d)", self.worker_id, welcome.latest_version)

    def not_ready(self, now: float) -> str:
        """The controller has no learner (it restarted): wait a bounded time for one to join it; after that, the
        reason to leave ("" while waiting)."""
        if self.not_ready_since is None:
            self.not_ready_since = now
            log.warning("worker %s: the controller has no learner (it restarted?); waiting up to %.0f s for one "
                        "to join", self.worker_id, self.no_learner_s)
        elif now - self.not_ready_since > self.no_learner_s:
            return (f"the controller at {self.controller} has had no learner for {self.no_learner_s:.0f} s (it "
                    f"restarted and no learner joined it): start the learner again (`asyncrl learner "
                    f"controller={self.controller}`), then this worker")
        return ""
