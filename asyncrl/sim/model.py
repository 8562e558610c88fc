"""Discrete-event simulation of an asyncrl job: generation workers, controller, learner, weight sync.

Owns: the model of one job, built on the event kernel of ``asyncrl/sim/kernel.py`` (``simulate(Params) ->
Result``): the controller and the learner here, the generation workers in ``asyncrl/sim/worker.py``.
``asyncrl/sim/calibrate.py`` fills ``Params`` from a run folder and ``asyncrl/sim/cluster.py`` from a
cluster shape; ``scripts/simulate_scale.py`` drives them.
Never: reads run folders, starts processes or sockets, reads the wall clock, or copies a rule of the
controller (it calls the controller's own code); all randomness comes from ``Params.seed``.

The model, stage by stage (each a plain reading of the code it stands for):

* **Learner** (``workers/learner/process.py``), one process: batch k arrives -> ``other_s`` (batch transfer,
  decode, broadcast, gather, report) -> ``train_s`` (+ ``train_s_per_token`` x response tokens of the
  batch) -> ``publish_s`` (quantize + send) -> the new version is announced to every worker and reported
  to the controller together with the request for batch k+1 (``msg_s`` one-way each).
* **Controller** (``asyncrl/controller/core.py``), one process, messages served first come first served
  at ``ctl_msg_s`` CPU seconds each. Admission, assignment and batch assembly are the REAL
  ``StalenessGate``, ``GroupBuffer`` and ``BatchAssembler`` of ``asyncrl.controller`` (so eta, the
  admission-version rule and earliest-deadline batching are the system's own), and a work request is
  answered by the same function ``ControllerCore`` calls, ``asyncrl.controller.admission.admit_and_assign``
  (whole groups for the request's credits, admitted as the gate allows beyond those already pending,
  assigned as the worker's weights allow); no assignment is a NoWork (the worker retries after
  ``nowork_retry_s``).
* **Workers** (``workers/generator/process.py``, modelled in ``asyncrl/sim/worker.py``): a credit window of
  ``slots`` samples; a request whenever slots are free and none is in flight; an engine that decodes all
  its samples in lock step, one token per sample per step of ``step_a + step_c * active`` seconds
  (continuous batching); each sample's length is drawn from ``lengths``; a finished sample reaches the
  controller ``result_s`` later. A new version: the comms thread fetches it (``fetch_s`` of CPU, plus ``fetch_bytes`` through the publisher's egress when
  ``egress_bw`` is set: one link shared by every concurrent fetch); while it fetches it neither sends
  results nor asks for work; with ``pause_engine_on_load`` the engine also stops (an SGLang-style update).
  A sample's behaviour version is the engine's version when it starts.
* **CPUs**: with ``cores`` set, every process runs on at most one core and the busy processes share the
  cores equally (processor sharing); the threads of one process share its core. ``cores=None``: every
  process has its own device (a cluster), nothing is shared but the publisher's egress.

Invariants: ``Result.staleness`` counts every consumed sample once (``learner version at consumption -
behaviour version``), and no count lies beyond ``eta`` (the real assembler raises otherwise).
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from asyncrl.controller import (
    BatchAssembler,
    GroupBuffer,
    ManualVersion,
    ResultStatus,
    StalenessGate,
    admit_and_assign,
)
from asyncrl.sim.kernel import Server, Sim
from asyncrl.sim.params import Params, Result
from asyncrl.sim.worker import WorkerModel

__all__ = ["JobModel", "simulate"]


class JobModel:
    """One job: the controller, the learner, the publisher's link and ``p.workers`` workers."""

    def __init__(self, p: Params) -> None:
        self.p = p
        self.sim = Sim(p.cores)
        self.rng = random.Random(p.seed)
        self.result = Result(version_times=[], batch_samples=p.groups_per_step * p.group_size)
        self.done = False
        # the controller: the system's own admission, group and batch logic, under a simulated clock
        self.version = ManualVersion(0)
        self.gate = StalenessGate(self.version, eta=p.eta, groups_per_step=p.groups_per_step)
        self.buffer = GroupBuffer(self.gate, group_size=p.group_size, clock=lambda: self.sim.now,
                                  assignment_timeout_s=1e12)
        self.assembler = BatchAssembler(self.gate, self.buffer)
        self.pending_batch: int | None = None
        self.ctl = self.sim.proc("controller").server("loop")
        self.inbox: deque[tuple[Any, ...]] = deque()
        self.ctl_busy = False
        self.learner = self.sim.proc("learner").server("train")
        self.egress = self.sim.proc("publisher-egress", cpu=False).server("link", shares_core=False)
        self.published = 0
        self.workers = [WorkerModel(self, i) for i in range(p.workers)]

    # ------------------------------------------------------------------------------ controller
    def to_controller(self, msg: tuple[Any, ...]) -> None:
        self.sim.at(self.p.msg_s, self._enqueue, msg)

    def _enqueue(self, msg: tuple[Any, ...]) -> None:
        self.inbox.append(msg)
        self._serve_next()

    def _serve_next(self) -> None:
        if self.ctl_busy or not self.inbox:
            return
        self.ctl_busy = True
        msg = self.inbox.popleft()
        self.ctl.submit(self.p.ctl_msg_s, lambda: self._handled(msg))

    def _handled(self, msg: tuple[Any, ...]) -> None:
        self.ctl_busy = False
        self.result.controller_msgs += 1
        kind = msg[0]
        if kind == "work":
            _, w, credits, version = msg
            out = [] if self.done else admit_and_assign(self.buffer, w.id, credits=credits, worker_version=version,
                                                        make_meta=dict)
            self.sim.at(self.p.msg_s, w.on_reply, out)
            if self.gate.counts().issued:  # groups left for someone else: the next idle worker's poll takes them
                self._wake_one()
        elif kind == "sample":
            _, w, sid, version, tokens = msg
            status = self.buffer.on_result(sid, worker_id=w.id, payload=tokens, min_version=version)
            if status is ResultStatus.COMPLETED:
                self._try_batch()
        elif kind == "version":
            self.version.set(msg[1])
            self.assembler.release_through(msg[1])
            self.result.version_times.append(self.sim.now)
            if msg[1] >= self.p.steps:
                self.done = True
            else:
                self.pending_batch = msg[1]
                self._try_batch()
                self._wake_all()
        self._serve_next()

    def _wake_all(self) -> None:
        for w in self.workers:
            w.wake()

    def _wake_one(self) -> None:
        for w in self.workers:
            if w.parked_since is not None and not w.wake_due:
                w.wake()
                return

    def _try_batch(self) -> None:
        if self.pending_batch is None:
            return
        batch = self.assembler.try_assemble()
        if batch is None:
            return
        self.pending_batch = None
        this: Counter[int] = Counter(batch.step - s.min_version for g in batch.groups for s in g.samples)
        self.result.staleness.update(this)
        self.result.batch_staleness.append(this)
        tokens = sum(s.payload + self.p.prompt_tokens for g in batch.groups for s in g.samples)
        self.sim.at(self.p.msg_s, self._learn, tokens)

    # --------------------------------------------------------------------------------- learner
    def _learn(self, tokens: int) -> None:
        p = self.p
        train = p.train_s + p.train_s_per_token * tokens
        self.timed(self.learner, p.other_s, "other_s", lambda: self.timed(
            self.learner, train, "train_s", lambda: self.timed(self.learner, p.publish_s, "publish_s", self._published)))

    def timed(self, server: Server, work: float, stage: str, done: Callable[[], None], per: int = 1) -> None:
        """Submit ``work`` to ``server`` and record its wall time (divided by ``per``) under ``stage``."""
        start = self.sim.now

        def finished() -> None:
            self.result.stage_wall.setdefault(stage, []).append((self.sim.now - start) / per)
            done()
        server.submit(work, finished)

    def _published(self) -> None:
        self.published += 1
        v = self.published
        for w in self.workers:
            self.sim.at(self.p.msg_s, w.on_announce, v)
        self.to_controller(("version", v))

    def run(self) -> Result:
        self.pending_batch = 0
        for w in self.workers:
            w.try_request()
        self.sim.run(lambda: self.done)
        r = self.result
        r.learner_busy_s = self.learner.busy_s
        r.worker_busy_s = [w.engine.busy_s for w in self.workers]
        r.controller_busy_s = self.ctl.busy_s
        return r


def simulate(p: Params) -> Result:
    """Run the job of ``p`` until the learner has published ``p.steps`` versions."""
    return JobModel(p).run()
