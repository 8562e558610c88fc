"""Who may (re)join a running controller: a learner at its version, a worker under its id.

Owns: the rule that a learner (started fresh, restarted from its checkpoint, or still live after the
controller restarted) is accepted only at a version whose batch this controller can serve, and the
rule that a second process may not take the id of a worker that is still live. Each refusal says
exactly what to restart. Standard library and ``protocols`` only.
Never: changes controller state (``ControllerCore`` applies the verdict) or reads messages.

Invariant: a learner at version ``k`` asks for batch ``k`` next; the controller can serve it only
when ``k`` is its next batch or a batch it still retains (emitted, not yet trained on). Any other
``k`` would train on batches the trajectory log does not hold, or skip some, so a replay of the
log would no longer reproduce the weights.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

import protocols as P
from asyncrl.controller.workers import WorkerInfo

log = logging.getLogger("asyncrl.controller")

LIVE_HEARTBEATS = 3
"""A worker heard from within this many heartbeat periods is live: a second process that says Hello
under its id is refused. A registration silent for longer is taken over (a worker restarted under
the same id after it was killed)."""

LEARNER_COMMAND = "`asyncrl learner controller=ADDR` (under torchrun for several ranks)"
CONTROLLER_RESUME = "`asyncrl controller resume=RUN_DIR`"


def learner_refusal(start: int | None, *, version: int, next_step: int, retained: Collection[int]) -> str | None:
    """Why a learner at version ``start`` cannot (re)join, naming what to restart; None when it can.

    ``version``: the newest version the controller has been told of; ``next_step``: its next batch;
    ``retained``: the batches it emitted and still keeps for a learner that resumes before them."""
    if start is None:
        return (f"the learner names no version (Hello.version), the controller is at version {version}; "
                "resume the learner and the controller from the same run folder")
    if start == next_step or start in retained:
        return None
    if start > next_step:  # the controller restarted from an older checkpoint than the live learner's state
        return (f"the learner is at version {start}, but this controller resumed from the run's checkpoint of "
                f"version {next_step} and serves batch {next_step} next; stop this learner and start it again "
                f"with {LEARNER_COMMAND}: it resumes from the run's newest checkpoint, the one this controller "
                "resumed from")
    return (f"the learner starts at version {start}, the controller is at version {version} and serves batch "
            f"{next_step} next (the learner's newest checkpoint is older: it was stopped without one); stop the "
            f"controller and restart it with {CONTROLLER_RESUME}, then start the learner again with "
            f"{LEARNER_COMMAND}")


def worker_conflict(worker_id: str, existing: WorkerInfo | None, *, peer: bytes, now: float,
                    heartbeat_s: float, dead_after_s: float) -> str | None:
    """Why a Hello under ``worker_id`` from reply address ``peer`` must be refused; None when it may join.

    The same reply address saying Hello again is the same process (a lost Welcome, a re-registration);
    another address under a live worker's id is a second process started with the same ``worker_id=``."""
    if existing is None or existing.peer == peer:
        return None
    silent_s = now - existing.last_seen
    if silent_s > min(dead_after_s, LIVE_HEARTBEATS * heartbeat_s):
        return None
    where = f" (pid {existing.pid} on {existing.host})" if existing.pid else ""
    return (f"worker id {worker_id!r} is already taken by a live worker{where}, heard {silent_s:.1f} s ago; "
            f"start this one with another worker_id=NAME, or stop the other first")


def learner_join(core: Any, peer: bytes, msg: P.Hello) -> list[tuple[bytes, Any]]:
    """``core``: the ``ControllerCore`` (typed loosely: core imports this module). A learner joins, rejoins (a controller that restarted under it, a probe while it waits), or
    comes back from its checkpoint; workers registered here are told its new weight server."""
    def refuse(reason: str) -> list[tuple[bytes, Any]]:
        core.counters["control/rejected_hello"] += 1
        log.warning("refused a learner: %s", reason)
        return [(peer, P.Reject(reason=reason))]

    if core.learner_peer is not None and core.learner_peer != peer:
        return refuse("a learner is already registered with this controller")
    start = msg.version if msg.version >= 0 else None
    refusal = learner_refusal(start, version=core.version.version, next_step=core.assembler.next_step,
                              retained=core.assembler.retained_steps())
    if refusal is not None:
        return refuse(refusal)
    assert start is not None  # learner_refusal refuses a learner without a version
    weights = msg.capabilities.get("weights_announce", ""), msg.capabilities.get("weights_fetch", "")
    if not all(weights):
        return refuse("the learner's Hello must name its weight server: capabilities "
                      "weights_announce and weights_fetch (the addresses workers fetch from)")
    moved = core.weights_addresses is not None and weights != core.weights_addresses
    core.learner_peer = peer
    core.weights_addresses = weights
    core.pending_batch = None  # a request of an earlier learner process; the learner asks again after its Welcome
    if start > core.version.version:
        log.info("learner starts at version %d", start)
        core.version.set(start)
    out: list[tuple[bytes, Any]] = [(peer, P.Welcome(protocol_version=P.PROTOCOL_VERSION, server_id="controller",
                                                     latest_version=core.version.version))]
    if moved:  # a learner that restarted serves its weights elsewhere: every worker fetches from there now
        core.counters["control/learner_rejoined"] += 1
        log.info("learner rejoined at version %d with a new weight server; telling %d workers", start,
                 len(core.workers))
        out += [(w.peer, P.Welcome(protocol_version=P.PROTOCOL_VERSION, server_id="controller",
                                   latest_version=core.version.version, setup=core.worker_setup(w.quant_format)))
                for w in core.workers.values()]
    return out
