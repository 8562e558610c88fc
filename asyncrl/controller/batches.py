"""The learner's batches: ``BatchDesk``, the one object that answers batch requests.

Owns: the step the learner asked for and did not get yet, the answer to a ``BatchRequest`` (a batch, an
``Error`` for a step this controller cannot serve, or ``Shutdown`` once ``learner.time_budget_s`` is spent or a
``learner.stop_on`` alarm set ``stop_reason``), the time budget's clock, serving a retained batch again to a
learner that resumed before training on it, the ``BatchRecord`` written (and flushed) before a batch leaves,
and the ``TrainBatch`` with its batch metrics (reward mean/std, response metrics, filtered groups, staleness,
gate capacity, live workers).
Never: touches a socket or knows which peer is the learner (``ControllerCore`` addresses the answers);
decides admission or scoring (``gate``, ``assembler``, ``core.score_group``).

Invariant: a batch step is logged once, before the learner can train on it; a batch served again (a
learner that resumed from a checkpoint taken while it was on its way) is not logged again.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence, Sized
from typing import Any

import numpy as np

import protocols as P
from asyncrl.controller.assembler import Batch, BatchAssembler
from asyncrl.log import BatchRecord, TrajectoryLogWriter
from asyncrl.log.replay import train_sample

log = logging.getLogger("asyncrl.controller")


class BatchDesk:
    """``assembler`` forms the batches, ``log`` records them, ``counters`` are the controller's, ``workers``
    the live workers (counted in the batch metrics); ``time_budget_s``: ``learner.time_budget_s`` (0: none);
    ``stop_ids``: the tokens that end a response (the response metrics)."""

    def __init__(self, assembler: BatchAssembler, log: TrajectoryLogWriter, counters: Counter, workers: Sized, *,
                 time_budget_s: float, stop_ids: Sequence[int]) -> None:
        self.assembler, self.log, self.counters, self.workers = assembler, log, counters, workers
        self.time_budget_s = time_budget_s
        self.stop_ids = stop_ids
        self.pending: int | None = None  # the step the learner asked for and did not get yet
        self.stop_reason: str | None = None  # set (learner.stop_on): the next request gets Shutdown
        self.max_consumed_staleness = 0
        # learner.time_budget_s: training seconds spent before this process (a resumed run), the clock at this
        # process's first batch request, and the step last asked for inside the budget (served however late)
        self.budget_used_s = 0.0
        self._budget_t0: float | None = None
        self._budget_admitted_step: int | None = None

    def budget_elapsed(self, now: float) -> float:
        """Training seconds of ``learner.time_budget_s`` spent so far (0 before the first batch request)."""
        return self.budget_used_s + (0.0 if self._budget_t0 is None else now - self._budget_t0)

    def request(self, step: int, now: float) -> Any:
        """The answer to the learner's ``BatchRequest`` for ``step`` (None: it stays pending until ``serve``)."""
        if self.stop_reason is not None:  # learner.stop_on: finish as at the time budget
            self.pending = None
            return P.Shutdown(reason=self.stop_reason)
        # A step asked for inside the budget is served however long its batch takes: the same request again (the
        # learner re-sends it after each Welcome its 5 s probe gets) is not checked again. Checking it again would
        # make a slow first batch end a run with no step, on a slow machine only.
        if step != self._budget_admitted_step:
            if self._budget_t0 is None:
                self._budget_t0 = now  # the budget's clock starts at the first batch request
            if self.time_budget_s > 0 and self.budget_elapsed(now) >= self.time_budget_s:
                self.pending = None
                budget = self.time_budget_s
                log.info("learner.time_budget_s=%g spent (%.1f s): no batch %d", budget, self.budget_elapsed(now), step)
                return P.Shutdown(reason=f"learner.time_budget_s={budget:g} spent before step {step}")
            self._budget_admitted_step = step
        self.pending = step
        return self.serve()

    def serve(self) -> P.TrainBatch | P.Error | None:
        """The pending batch if it can be served now (else None; it stays pending)."""
        if self.pending is None:
            return None
        step, next_step = self.pending, self.assembler.next_step
        if step < next_step:
            # The learner resumed from a checkpoint taken while this batch was on its way to it
            # (stopped between receiving and training): serve the same batch again; it is logged once.
            self.pending = None
            try:
                retained = self.assembler.retained_batch(step)
            except ValueError as e:
                return P.Error(code="wrong_step", message=str(e))
            self.counters["batches/resent"] += 1
            return self.train_batch(retained)
        if step > next_step:
            self.pending = None
            return P.Error(code="wrong_step", message=(
                f"learner asked for batch {step}, the controller is at batch {next_step}; "
                "resume both from the same checkpoint"))
        batch = self.assembler.try_assemble()
        if batch is None:
            return None
        self.counters["data/filtered_groups"] += len(batch.filtered)
        self.max_consumed_staleness = max(self.max_consumed_staleness, batch.max_staleness)
        self.log.append(BatchRecord(step=batch.step, sample_ids=list(batch.sample_ids), logged_at=time.time()))
        self.log.flush()  # the batch record is durable before the learner trains on it
        self.pending = None
        return self.train_batch(batch)

    def train_batch(self, batch: Batch) -> P.TrainBatch:
        """The ``TrainBatch`` of an assembled (or retained) batch: every sample with its reward and advantage, and
        the controller's metrics of the batch (docs/metrics.md)."""
        samples, rewards = [], []
        for g in batch.groups:
            scores = g.scored()
            for s, r, a in zip(g.samples, scores.rewards, scores.advantages, strict=True):
                samples.append(train_sample(s.payload, advantage=a, reward=r))
                rewards.append(r)
        metrics = {"train/reward_mean": float(np.mean(rewards)), "train/reward_std": float(np.std(rewards)),
                   **response_metrics([g.scored().zero_variance for g in batch.groups],
                                      [s.response_ids for s in samples], self.stop_ids),
                   "data/filtered_groups": float(len(batch.filtered)),
                   "staleness/max": float(batch.max_staleness),
                   "gate/capacity": float(self.assembler.gate.capacity()),
                   "workers/alive": float(len(self.workers))}
        return P.TrainBatch(step=batch.step, samples=samples, metrics=metrics)


def response_metrics(zero_variance: Sequence[bool], responses: Sequence[P.Array],
                     stop_ids: Sequence[int]) -> dict[str, float]:
    """What a batch's responses look like: mean/max length in tokens, the share of its groups with zero variance
    (``Scores.zero_variance``: no gradient), the share of samples that stopped at their first token (a chat model
    answering with its end-of-turn token at once), and the share of the batch's responses that are its most
    common one, stop tokens left out (one answer taking over every prompt)."""
    lengths = [r.to_numpy().size for r in responses]
    stops = set(stop_ids)
    first = [n == 1 and int(r.to_numpy()[0]) in stops for n, r in zip(lengths, responses, strict=True)]
    answers = Counter(tuple(int(t) for t in r.to_numpy() if int(t) not in stops) for r in responses)
    return {"train/response_len_mean": float(np.mean(lengths)), "train/response_len_max": float(max(lengths)),
            "train/zero_variance_groups": float(np.mean(zero_variance)),
            "train/first_token_stop_frac": float(np.mean(first)),
            "train/majority_answer_share": answers.most_common(1)[0][1] / len(responses)}
