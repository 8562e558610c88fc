"""The learner's side of the controller: answering a batch request, building the ``TrainBatch``.

Owns: the answer to ``BatchRequest`` (a batch, an ``Error`` for a step this controller cannot serve, or
``Shutdown`` once ``learner.time_budget_s`` is spent or a ``learner.stop_on`` alarm set
``ControllerCore.stop_reason``), serving a retained batch again to a learner that resumed before
training on it, the ``BatchRecord`` written (and flushed) before a batch leaves, and the ``TrainBatch``
with its batch metrics (reward mean/std, response metrics, filtered groups, staleness, gate capacity,
live workers) built from the scored groups.
Never: touches a socket; decides admission or scoring (``gate``, ``assembler``, ``scoring``).

Invariant: a batch step is logged once, before the learner can train on it; a batch served again (a
learner that resumed from a checkpoint taken while it was on its way) is not logged again.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

import protocols as P
from asyncrl.config import TrainConfig
from asyncrl.controller.assembler import Batch, BatchAssembler
from asyncrl.controller.gate import StalenessGate
from asyncrl.controller.scored import ScoredGroup, response_metrics
from asyncrl.controller.scoring import GroupScorer
from asyncrl.controller.workers import WorkerRegistry
from asyncrl.log import BatchRecord, TrajectoryLogWriter
from asyncrl.log.replay import train_sample

log = logging.getLogger("asyncrl.controller")
Reply = tuple[bytes, Any]


class LearnerSide(Protocol):
    """What this module reads and sets of the controller (``ControllerCore``, which imports this module)."""

    cfg: TrainConfig
    scorer: GroupScorer
    gate: StalenessGate
    assembler: BatchAssembler
    workers: WorkerRegistry
    log: TrajectoryLogWriter
    counters: Counter
    learner_peer: bytes | None
    pending_batch: int | None
    budget_admitted_step: int | None
    stop_reason: str | None
    max_consumed_staleness: int

    def budget_spent(self, now: float) -> bool: ...

    def budget_elapsed(self, now: float) -> float: ...


def request_batch(core: LearnerSide, peer: bytes, msg: P.BatchRequest, now: float) -> list[Reply]:
    """The controller's answer to the learner's ``BatchRequest`` for step ``msg.step``."""
    if peer != core.learner_peer:
        core.counters["control/not_learner"] += 1
        return [(peer, P.Error(code="not_learner", message="only the registered learner may ask for batches"))]
    if core.stop_reason is not None:  # learner.stop_on: finish as at the time budget
        core.pending_batch = None
        return [(peer, P.Shutdown(reason=core.stop_reason))]
    # A step asked for inside the budget is served however long its batch takes: the same request again (the
    # learner re-sends it after each Welcome its 5 s probe gets) is not checked again. Checking it again would
    # make a slow first batch end a run with no step, on a slow machine only.
    if msg.step != core.budget_admitted_step:
        if core.budget_spent(now):
            core.pending_batch = None
            budget = core.cfg.learner.time_budget_s
            log.info("learner.time_budget_s=%g spent (%.1f s): no batch %d", budget, core.budget_elapsed(now),
                     msg.step)
            return [(peer, P.Shutdown(reason=f"learner.time_budget_s={budget:g} spent before step {msg.step}"))]
        core.budget_admitted_step = msg.step
    core.pending_batch = msg.step
    return try_batch(core)


def try_batch(core: LearnerSide) -> list[Reply]:
    """The learner's pending batch if it can be served now (else nothing; it stays pending)."""
    if core.pending_batch is None or core.learner_peer is None:
        return []
    step, next_step = core.pending_batch, core.assembler.next_step
    if step < next_step:
        # The learner resumed from a checkpoint taken while this batch was on its way to it
        # (stopped between receiving and training): serve the same batch again; it is logged once.
        core.pending_batch = None
        try:
            retained = core.assembler.retained_batch(step)
        except ValueError as e:
            return [(core.learner_peer, P.Error(code="wrong_step", message=str(e)))]
        core.counters["batches/resent"] += 1
        return [(core.learner_peer, train_batch(core, retained))]
    if step > next_step:
        core.pending_batch = None
        return [(core.learner_peer, P.Error(code="wrong_step", message=(
            f"learner asked for batch {step}, the controller is at batch {next_step}; "
            "resume both from the same checkpoint")))]
    batch = core.assembler.try_assemble()
    if batch is None:
        return []
    core.counters["data/filtered_groups"] += len(batch.filtered)
    core.max_consumed_staleness = max(core.max_consumed_staleness, batch.max_staleness)
    core.log.append(BatchRecord(step=batch.step, sample_ids=list(batch.sample_ids), logged_at=time.time()))
    core.log.flush()  # the batch record is durable before the learner trains on it
    core.pending_batch = None
    return [(core.learner_peer, train_batch(core, batch))]


def train_batch(core: LearnerSide, batch: Batch) -> P.TrainBatch:
    """The ``TrainBatch`` of an assembled (or retained) batch: every sample with its reward and advantage."""
    scored = [ScoredGroup.of(g) for g in batch.groups]
    samples, rewards = [], []
    for sg in scored:
        for s, r, a in zip(sg.group.samples, sg.rewards, sg.advantages, strict=True):
            samples.append(train_sample(s.payload, advantage=a, reward=r))
            rewards.append(r)
    metrics = batch_metrics(scored, samples, rewards, stop_ids=getattr(core.scorer, "stop_ids", ()),
                            filtered=len(batch.filtered), max_staleness=batch.max_staleness,
                            gate_capacity=core.gate.capacity(), workers_alive=len(core.workers))
    return P.TrainBatch(step=batch.step, samples=samples, metrics=metrics)


def batch_metrics(scored: Sequence[ScoredGroup], samples: Sequence[P.TrainSample], rewards: Sequence[float], *,
                  stop_ids: Sequence[int], filtered: int, max_staleness: int, gate_capacity: int,
                  workers_alive: int) -> dict[str, float]:
    """The controller's metrics of one batch (``TrainBatch.metrics``; docs/metrics.md)."""
    return {
        "train/reward_mean": float(np.mean(rewards)),
        "train/reward_std": float(np.std(rewards)),
        **response_metrics([list(sg.rewards) for sg in scored], [s.response_ids for s in samples],
                           stop_ids),
        "data/filtered_groups": float(filtered),
        "staleness/max": float(max_staleness),
        "gate/capacity": float(gate_capacity),
        "workers/alive": float(workers_alive),
    }
