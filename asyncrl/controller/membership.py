"""Who is in the run: ``Membership``, the controller's table of its learner and its generation workers.

Owns: the registered learner (its reply address and weight server), the workers (``WorkerRegistry``) with
their back-offs and quarantines (``Quarantine``), and every change to them: a learner (re)joining, a worker
joining, speaking (heartbeats, work requests), leaving, going silent, being dropped for not reading its
replies, or quarantined after ``rollout.quarantine_after`` invalid samples in a row. A worker that goes has
its groups reissued (``GroupBuffer.reassign_from``) and an event logged. The rules of who may (re)join: a
learner only at a version whose batch this controller can serve, a second process never under the id of a
worker that is still live. Each refusal says exactly what to restart.
Never: reads a clock (times are passed in), touches a socket, or applies what a learner's joining means for
the rest of the controller (its version, its pending batch, the Welcomes: ``ControllerCore``).

Invariant: a learner at version ``k`` asks for batch ``k`` next; the controller can serve it only
when ``k`` is its next batch or a batch it still retains (emitted, not yet trained on). Any other
``k`` would train on batches the trajectory log does not hold, or skip some, so a replay of the
log would no longer reproduce the weights.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Collection, Sequence
from typing import Any

import protocols as P
from asyncrl.config.roles import worker_formats
from asyncrl.controller.buffer import GroupBuffer
from asyncrl.controller.quarantine import Quarantine
from asyncrl.controller.workers import WorkerInfo, WorkerRegistry
from asyncrl.log import EventRecord, TrajectoryLogWriter
from protocols.values import QUARANTINED

log = logging.getLogger("asyncrl.controller")

LIVE_HEARTBEATS = 3
"""A worker heard from within this many heartbeat periods is live: a second process that says Hello
under its id is refused. A registration silent for longer is taken over (a worker restarted under
the same id after it was killed)."""

LEARNER_COMMAND = "`asyncrl learner controller=ADDR` (under torchrun for several ranks)"
CONTROLLER_RESUME = "`asyncrl controller resume=RUN_DIR`"


class Membership:
    """``rollout``: the run's ``rollout`` settings (heartbeat, dead_after_s, quarantine_after); ``buffer``: where a
    leaving worker's groups are reissued; ``log``: where joins and departures are recorded; ``counters``: the
    controller's; ``publish_formats``: the weight formats a worker may fetch, the default first."""

    def __init__(self, rollout: Any, buffer: GroupBuffer, log: TrajectoryLogWriter, counters: Counter,
                 publish_formats: Sequence[str]) -> None:
        self.rollout, self.buffer, self.log, self.counters = rollout, buffer, log, counters
        self.publish_formats = list(publish_formats)
        self.workers = WorkerRegistry()
        self.quarantine = Quarantine(rollout.quarantine_after)
        self.learner_peer: bytes | None = None
        self.weights_addresses: tuple[str, str] | None = None  # the learner's weight server (announce, fetch)

    # ----------------------------------------------------------------------------- the learner
    def learner_refusal(self, peer: bytes, msg: P.Hello, *, version: int, next_step: int,
                        retained: Collection[int]) -> str | None:
        """Why a learner's Hello from ``peer`` is refused (counted, logged), naming what to restart; None when it
        may (re)join at ``msg.version``. ``version``: the newest version the controller has been told of;
        ``next_step``: its next batch; ``retained``: the batches it emitted and keeps for a learner that resumes
        before them."""
        start = msg.version if msg.version >= 0 else None
        weights = msg.capabilities.get("weights_announce", ""), msg.capabilities.get("weights_fetch", "")
        if self.learner_peer is not None and self.learner_peer != peer:
            reason: str | None = "a learner is already registered with this controller"
        elif start is None:
            reason = (f"the learner names no version (Hello.version), the controller is at version {version}; "
                      "resume the learner and the controller from the same run folder")
        elif start != next_step and start not in retained:
            reason = _version_refusal(start, version=version, next_step=next_step)
        elif not all(weights):
            reason = ("the learner's Hello must name its weight server: capabilities "
                      "weights_announce and weights_fetch (the addresses workers fetch from)")
        else:
            return None
        self.counters["control/rejected_hello"] += 1
        log.warning("refused a learner: %s", reason)
        return reason

    def register_learner(self, peer: bytes, msg: P.Hello) -> bool:
        """Register the learner of an accepted Hello; True when a learner that restarted serves its weights
        elsewhere now (every worker must be told)."""
        weights = msg.capabilities["weights_announce"], msg.capabilities["weights_fetch"]
        moved = self.weights_addresses is not None and weights != self.weights_addresses
        self.learner_peer, self.weights_addresses = peer, weights
        return moved

    # ----------------------------------------------------------------------------- the workers
    def worker_hello(self, peer: bytes, msg: P.Hello, now: float) -> WorkerInfo | P.Reject | P.Error:
        """Register the worker of a Hello (one registered under its id before is forgotten first: its work is
        reissued), or the refusal: not a generator, no learner yet, a format this run does not publish, a
        quarantined id, or the id of another live worker."""
        if msg.role != "generator":
            return P.Reject(reason=f"role {msg.role!r} cannot join; expected generator or learner")
        if self.learner_peer is None:
            return P.Error(code="not_ready", message="the learner has not published weights yet; retry")
        formats, caps = self.publish_formats, msg.capabilities
        actor, fmt = worker_formats(caps.get("engine", "native"), caps.get("quant_format", ""), formats[0])
        if fmt not in formats:
            self.counters["control/rejected_format"] += 1
            return P.Reject(reason=f"this run publishes weights as {formats}; start the worker with "
                                   f"quant.fmt={formats[0]} (or start the run with quant.extra_formats=[{fmt}])")
        if msg.peer_id in self.quarantine:
            self.counters["control/rejected_quarantined"] += 1
            return P.Reject(reason=self.quarantine.refusal(msg.peer_id))
        if (conflict := self._conflict(msg.peer_id, peer, now)) is not None:
            self.counters["control/duplicate_worker_id"] += 1
            log.warning("refused a second worker %s: %s", msg.peer_id, conflict)
            return P.Reject(reason=conflict)
        if msg.peer_id in self.workers:  # joined again (restart, lost Welcome): its old work is reissued
            self.forget(msg.peer_id, reason="joined again")
        w = self.workers.join(msg.peer_id, peer=peer, quant_format=fmt, now=now, host=caps.get("host", ""),
                              pid=caps.get("pid", ""))
        w.actor_format = actor
        self.log.append(EventRecord(event="worker_joined", data={"worker": msg.peer_id, "fmt": fmt},
                                    logged_at=time.time()))
        log.info("worker %s joined (%s)", msg.peer_id, fmt)
        return w

    def _conflict(self, worker_id: str, peer: bytes, now: float) -> str | None:
        """Why a Hello under ``worker_id`` from reply address ``peer`` must be refused; None when it may join.
        The same reply address saying Hello again is the same process (a lost Welcome, a re-registration);
        another address under a live worker's id is a second process started with the same ``worker_id=``."""
        existing = self.workers.get(worker_id)
        if existing is None or existing.peer == peer:
            return None
        silent_s = now - existing.last_seen
        if silent_s > min(self.rollout.dead_after_s, LIVE_HEARTBEATS * self.rollout.heartbeat_s):
            return None
        where = f" (pid {existing.pid} on {existing.host})" if existing.pid else ""
        return (f"worker id {worker_id!r} is already taken by a live worker{where}, heard {silent_s:.1f} s ago; "
                f"start this one with another worker_id=NAME, or stop the other first")

    def heard(self, peer: bytes, worker_id: str, now: float, *, before: str) -> WorkerInfo | P.Shutdown | P.Error:
        """The registered worker ``worker_id`` (heard from now) when ``peer`` speaks for it; else the answer: the
        reason it was quarantined, or an ``Error`` asking for a Hello ``before`` what it sent."""
        if (reason := self.quarantine.shutdown_reason(worker_id, peer)) is not None:
            return P.Shutdown(reason=reason)
        w = self.workers.get(worker_id)
        if w is None or w.peer != peer:  # a peer may only speak for itself
            self.counters["control/unknown_worker"] += 1
            return P.Error(code="not_registered", message=f"send Hello before {before}")
        w.last_seen = now
        return w

    def forget(self, worker_id: str, *, reason: str) -> None:
        """``worker_id`` left, died or joined again: its work is reissued, its rejections in a row forgotten."""
        if self.workers.pop(worker_id, None) is None:
            return
        self.quarantine.forget(worker_id)
        reissued = self.buffer.reassign_from(worker_id)
        self.counters["workers/left"] += 1
        self.counters["samples/reissued"] += len(reissued)
        self.log.append(EventRecord(event="worker_left", logged_at=time.time(),
                                    data={"worker": worker_id, "reason": reason, "reissued": str(len(reissued))}))
        log.info("worker %s %s; reissuing %d samples", worker_id, reason, len(reissued))

    def drop_peer(self, peer: bytes) -> None:
        """A peer was dropped for not reading its replies: a worker behind it is forgotten (work reissued)."""
        for wid in self.workers.behind(peer):
            self.forget(wid, reason="dropped: it does not read the controller's replies")

    def reap(self, now: float) -> None:
        """Forget every worker silent for more than ``rollout.dead_after_s`` (its work is reissued)."""
        for wid, silent_s in self.workers.silent(now, self.rollout.dead_after_s):
            self.counters["workers/dead"] += 1
            self.forget(wid, reason=f"missed heartbeats for {silent_s:.1f}s")

    def rejected(self, worker_id: str, sample_id: str, why: str, now: float) -> list[tuple[bytes, Any]]:
        """A sample of ``worker_id`` failed validation (``why``): it is backed off and, after
        ``rollout.quarantine_after`` in a row, quarantined: its other groups go to other workers and it is told
        why in the returned ``Shutdown``."""
        shutdown = self.quarantine.rejected(worker_id, why, now)
        log.error("rejected %s from %s: %s; group reissued to another worker first (%d rejected in a row)",
                  sample_id, worker_id, why, self.quarantine.in_a_row(worker_id))
        w = self.workers.get(worker_id)
        if shutdown is None or w is None:
            return []
        self.workers.pop(worker_id)
        self.quarantine.quarantine(worker_id, w.peer, shutdown)
        reissued = self.buffer.reassign_from(worker_id)
        self.counters["workers/quarantined"] += 1
        self.counters["samples/reissued"] += len(reissued)
        self.log.append(EventRecord(event="worker_quarantined", logged_at=time.time(),
                                    data={"worker": worker_id, "reason": shutdown, "reissued": str(len(reissued))}))
        log.error("worker %s quarantined: %s; its other %d samples in flight go to other workers",
                  worker_id, shutdown.removeprefix(QUARANTINED), len(reissued))
        return [(w.peer, P.Shutdown(reason=shutdown))]


def _version_refusal(start: int, *, version: int, next_step: int) -> str:
    """Why a learner at version ``start`` (neither the next batch nor a retained one) cannot (re)join."""
    if start > next_step:  # the controller restarted from an older checkpoint than the live learner's state
        return (f"the learner is at version {start}, but this controller resumed from the run's checkpoint of "
                f"version {next_step} and serves batch {next_step} next; stop this learner and start it again "
                f"with {LEARNER_COMMAND}: it resumes from the run's newest checkpoint, the one this controller "
                "resumed from")
    return (f"the learner starts at version {start}, the controller is at version {version} and serves batch "
            f"{next_step} next (the learner's newest checkpoint is older: it was stopped without one); stop the "
            f"controller and restart it with {CONTROLLER_RESUME}, then start the learner again with "
            f"{LEARNER_COMMAND}")
