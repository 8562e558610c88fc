"""A generation worker in the scale simulator: its credit window, its engine's step loop, its weight fetches.

Owns: ``WorkerModel``, a plain reading of ``workers/generator/process.py`` (and of the native engine's loop) on
the event kernel: a credit window of ``slots`` samples; a work request whenever slots are free and none
is in flight; an engine that decodes all its samples in lock step; results sent by the comms thread,
which also fetches new weights (and, while it fetches, neither sends results nor asks for work).
Never: decides admission or assignment (the controller's own code does, in ``asyncrl/sim/model.py``),
reads the wall clock, or draws randomness from anywhere but the job's seeded ``rng``.
Invariant: ``outstanding`` is the number of samples assigned to this worker and not yet sent back, so
``slots - outstanding`` is what its next request asks for.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from asyncrl.controller import Assignment
from asyncrl.sim.kernel import Server, Sim
from asyncrl.sim.params import Params, Result

Sample = tuple[str, int, int]
"""(sample id, behaviour version, response tokens): a finished sample on its way to the controller."""


class Job(Protocol):
    """What a worker sees of the job around it (``asyncrl.sim.model.JobModel``)."""

    p: Params
    sim: Sim
    rng: random.Random
    result: Result
    done: bool
    egress: Server

    def to_controller(self, msg: tuple[Any, ...]) -> None: ...

    def timed(self, server: Server, work: float, stage: str, done: Callable[[], None], per: int = 1) -> None: ...


@dataclass(slots=True)
class _Row:
    """A sample the engine is decoding."""

    sample_id: str
    left: int
    version: int
    admitted_at: float
    tokens: int


class WorkerModel:
    """One generation worker (``workers/generator/process.py`` with its engine); ``i`` numbers it ``w{i}``."""

    def __init__(self, job: Job, i: int) -> None:
        self.job, self.id = job, f"w{i}"
        p = job.sim.proc(self.id)
        pr = job.p
        if pr.engine == "fluid":
            self.engine = p.server("engine", lambda n: pr.step_a + pr.step_c * n)
        else:
            self.engine = p.server("engine")
        self.comms = p.server("comms")
        self.inbox: list[tuple[str, int, float]] = []  # (sample id, tokens, submitted at): the engine's queue
        self.rows: list[_Row] = []
        self.stepping = False
        self.version = 0
        self.outstanding = 0
        self.requesting = False
        self.sent = (0, 0)  # (credits, version) of the last request
        self.parked_since: float | None = None  # last NoWork: the next request waits for a retry tick
        self.wake_due = False
        self.loading = False
        self.announced = 0
        self.held: list[Sample] = []  # results finished while the comms thread was fetching

    def try_request(self) -> None:
        """Ask for work as the real worker does: no request in flight, not fetching weights, and at least
        one group's worth of free slots (``WorkerSetup.group_size``: groups are assigned whole)."""
        free = self.job.p.slots - self.outstanding
        if self.requesting or self.loading or free < self.job.p.group_size or self.job.done:
            return
        if self.parked_since is not None:
            self.wake()
            return
        self.requesting = True
        self.sent = (free, self.version)
        self.job.to_controller(("work", self, free, self.version))

    def wake(self) -> None:
        """After a NoWork the real worker asks again every ``nowork_retry_s``; an answer can only change
        when something changes (its credits, the learner's version, groups left pending), so instead of
        simulating every empty retry it asks at the first retry tick after such a change. Same timing."""
        if self.parked_since is None or self.wake_due:
            return
        r = self.job.p.nowork_retry_s
        ticks = max(1, math.ceil((self.job.sim.now - self.parked_since) / r - 1e-9))
        self.wake_due = True
        self.job.sim.at(self.parked_since + ticks * r - self.job.sim.now, self._retry)

    def _retry(self) -> None:
        self.wake_due = False
        self.parked_since = None
        self.try_request()

    def on_reply(self, assignments: Sequence[Assignment]) -> None:
        self.requesting = False
        if not assignments:
            self.job.result.nowork += 1
            self.parked_since = self.job.sim.now
            if (self.job.p.slots - self.outstanding, self.version) != self.sent:
                self.wake()  # its credits or weights changed while the request was out: the next tick differs
            return
        for a in assignments:
            for sid in a.sample_ids:
                self.outstanding += 1
                n = self.job.rng.choice(self.job.p.lengths)
                if self.job.p.engine == "fluid":
                    self.job.timed(self.engine, n, "token_s", self._finisher((sid, self.version, n)), per=n)
                else:
                    self.inbox.append((sid, n, self.job.sim.now))
        if self.inbox and not self.stepping:
            self._step()
        self.try_request()

    def _finisher(self, sample: Sample) -> Callable[[], None]:
        return lambda: self.on_finished(sample)

    def _step(self) -> None:
        """One engine step: admit the queue (up to the slots), one forward over every row, one token each."""
        p, now = self.job.p, self.job.sim.now
        admitted = self.inbox[:max(0, p.slots - len(self.rows))]
        del self.inbox[:len(admitted)]
        for sid, n, submitted in admitted:
            self.job.result.stage_wall.setdefault("queue_s", []).append(now - submitted)
            self.rows.append(_Row(sid, n, self.version, now, n))
        if not self.rows:
            self.stepping = False
            return
        self.stepping = True
        self.engine.submit(p.step_a + p.step_c * len(self.rows) + p.step_d * len(admitted), self._stepped)

    def _stepped(self) -> None:
        now = self.job.sim.now
        keep: list[_Row] = []
        for row in self.rows:
            row.left -= 1
            if row.left > 0:
                keep.append(row)
                continue
            self.job.result.stage_wall.setdefault("token_s", []).append((now - row.admitted_at) / row.tokens)
            self.on_finished((row.sample_id, row.version, row.tokens), request=False)
        self.rows = keep
        self.try_request()  # the comms thread flushes a step's results together, then asks for its free credits
        self._step()

    def on_finished(self, sample: Sample, request: bool = True) -> None:
        if self.loading:
            self.held.append(sample)
            return
        self._send(sample)
        if request:
            self.try_request()

    def _send(self, sample: Sample) -> None:
        self.outstanding -= 1
        self.job.sim.at(self.job.p.result_s, self.job.to_controller, ("sample", self, *sample))

    def on_announce(self, version: int) -> None:
        self.announced = max(self.announced, version)
        if not self.loading and self.announced > self.version:
            self._fetch(self.announced)

    def _fetch(self, version: int) -> None:
        p = self.job.p
        self.loading = True
        if p.pause_engine_on_load:
            self.engine.pause(True)
        start = self.job.sim.now

        def loaded() -> None:
            self.job.result.stage_wall.setdefault("fetch_s", []).append(self.job.sim.now - start)
            self._loaded(version)
        if p.egress_bw and p.fetch_bytes > 0:
            self.job.egress.submit(p.fetch_bytes / p.egress_bw, lambda: self.comms.submit(p.fetch_s, loaded))
        else:
            self.comms.submit(p.fetch_s, loaded)

    def _loaded(self, version: int) -> None:
        self.version = max(self.version, version)
        self.parked_since = None  # new weights: the worker asks at once (generator.py resets its back-off)
        self.loading = False
        if self.job.p.pause_engine_on_load:
            self.engine.pause(False)
        held, self.held = self.held, []
        for sample in held:
            self._send(sample)
        if self.announced > self.version:
            self._fetch(self.announced)
        else:
            self.try_request()
