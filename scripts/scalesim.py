"""Discrete-event simulation of an asyncrl job: generation workers, controller, learner, weight sync.

Owns: the model of one job, built on the event kernel of ``scripts/scalekernel.py`` (``simulate(Params) ->
Result``). ``scripts/simulate_scale.py`` calibrates ``Params`` from a run
folder and drives this module; the calibration and the cluster figures live there, not here.
Never: reads run folders, starts processes or sockets, or reads the wall clock; all randomness comes from
``Params.seed``.

The model, stage by stage (each a plain reading of the code it stands for):

* **Learner** (``workers/learner.py``), one process: batch k arrives -> ``other_s`` (batch transfer,
  decode, broadcast, gather, report) -> ``train_s`` (+ ``train_s_per_token`` x response tokens of the
  batch) -> ``publish_s`` (quantize + send) -> the new version is announced to every worker and reported
  to the controller together with the request for batch k+1 (``msg_s`` one-way each).
* **Controller** (``asyncrl/controller/core.py``), one process, messages served first come first served
  at ``ctl_msg_s`` CPU seconds each. Admission, assignment and batch assembly are the REAL
  ``StalenessGate``, ``GroupBuffer`` and ``BatchAssembler`` of ``asyncrl.controller`` (so eta, the
  admission-version rule and earliest-deadline batching are the system's own), driven by the same
  calls ``ControllerCore`` makes: a work request for ``credits`` samples asks for ``credits //
  group_size`` groups, admits what the gate allows beyond those already pending, assigns groups the
  worker's weights may serve, else answers NoWork (the worker retries after ``nowork_retry_s``).
* **Workers** (``workers/generator.py``): a credit window of ``slots`` samples; a request whenever slots
  are free and none is in flight; an engine that decodes all its samples in lock step, one token per
  sample per step of ``step_a + step_c * active`` seconds (continuous batching); each sample's length is
  drawn from ``lengths``; a finished sample reaches the controller ``result_s`` later. A new version: the
  comms thread fetches it (``fetch_s`` of CPU, plus ``fetch_bytes`` through the publisher's egress when
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

import math
import random
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from asyncrl.controller import BatchAssembler, GroupBuffer, ManualVersion, ResultStatus, StalenessGate
from scripts.scalekernel import Server, Sim

__all__ = ["Params", "Result", "Sim", "simulate", "window_rate", "window_staleness"]


# ------------------------------------------------------------------------------------------ model
@dataclass
class Params:
    """Everything the model needs; times in seconds. ``scripts/simulate_scale.py`` fills it from a run."""

    workers: int
    eta: int
    groups_per_step: int
    group_size: int
    slots: int
    steps: int
    train_s: float
    publish_s: float
    other_s: float
    fetch_s: float
    step_a: float
    step_c: float
    lengths: list[int]
    step_d: float = 0.0
    """Extra seconds per sample admitted (prefilled) in a step."""
    engine: str = "steps"
    """``steps``: the native engine's loop, one forward per step for every active sample plus the samples
    admitted at its start (a sample submitted mid-step waits for the boundary); ``fluid``: the same cost as
    a continuous rate (events only when a sample starts or ends; for long responses on many workers)."""
    msg_s: float = 0.0005
    result_s: float = 0.005
    ctl_msg_s: float = 0.0
    nowork_retry_s: float = 0.05
    train_s_per_token: float = 0.0
    prompt_tokens: int = 0
    """Prompt tokens per sample, counted with the response in the learner's ``train_s_per_token``."""
    fetch_bytes: float = 0.0
    egress_bw: float | None = None
    pause_engine_on_load: bool = False
    cores: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("workers", "groups_per_step", "group_size", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.slots < self.group_size:
            raise ValueError(f"slots ({self.slots}) must hold at least one group ({self.group_size} samples): "
                             "raise slots")
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError("lengths must be a non-empty list of response lengths >= 1 token")
        if self.eta < 0:
            raise ValueError(f"eta must be >= 0, got {self.eta}")
        if self.step_a <= 0 and self.step_c <= 0:
            raise ValueError("the engine's step cost step_a + step_c * n must be > 0")
        if self.engine not in ("steps", "fluid"):
            raise ValueError(f"engine must be 'steps' or 'fluid', got {self.engine!r}")


@dataclass
class Result:
    version_times: list[float]
    """Time the controller learned of version k (index k-1), as ``metrics.jsonl``'s ``time`` column."""
    staleness: Counter = field(default_factory=Counter)
    """Consumed samples per staleness (learner version at consumption - behaviour version)."""
    batch_staleness: list[Counter] = field(default_factory=list)
    """The same per batch (index = learner step), to leave out warm-up batches as a run's window does."""
    learner_busy_s: float = 0.0
    worker_busy_s: list[float] = field(default_factory=list)
    controller_busy_s: float = 0.0
    nowork: int = 0
    controller_msgs: int = 0
    batch_samples: int = 0
    stage_wall: dict[str, list[float]] = field(default_factory=dict)
    """Wall seconds of every stage instance: ``train_s``, ``publish_s``, ``other_s``, ``fetch_s`` (one per
    version and worker) and ``token_s`` (a sample's engine seconds per token), as a run's files give them."""


class _Worker:
    def __init__(self, job: _Job, i: int) -> None:
        self.job, self.id = job, f"w{i}"
        p = job.sim.proc(self.id)
        pr = job.p
        if pr.engine == "fluid":
            self.engine = p.server("engine", lambda n: pr.step_a + pr.step_c * n)
        else:
            self.engine = p.server("engine")
        self.comms = p.server("comms")
        self.inbox: list[tuple[str, int, float]] = []  # (sample id, tokens, submitted at): the engine's queue
        self.rows: list[list] = []  # [sample id, tokens left, behaviour version, admitted at, tokens]
        self.stepping = False
        self.version = 0
        self.outstanding = 0
        self.requesting = False
        self.sent = (0, 0)  # (credits, version) of the last request
        self.parked_since: float | None = None  # last NoWork: the next request waits for a retry tick
        self.wake_due = False
        self.loading = False
        self.announced = 0
        self.held: list[tuple[str, int, int]] = []  # results finished while the comms thread was fetching

    def try_request(self) -> None:
        # The real worker also holds back while it has fewer free slots than one group
        # (WorkerSetup.group_size). Not modelled: that never bites when the slots are a multiple of the
        # group size (groups are assigned whole), as in the cluster shapes and the defaults (32 and 8).
        free = self.job.p.slots - self.outstanding
        if self.requesting or self.loading or free <= 0 or self.job.done:
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

    def on_reply(self, assignments: list) -> None:
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
                    self.job.timed(self.engine, n, "token_s",
                                   lambda sid=sid, v=self.version, n=n: self.on_finished((sid, v, n)), per=n)
                else:
                    self.inbox.append((sid, n, self.job.sim.now))
        if self.inbox and not self.stepping:
            self._step()
        self.try_request()

    def _step(self) -> None:
        """One engine step: admit the queue (up to the slots), one forward over every row, one token each."""
        p, now = self.job.p, self.job.sim.now
        admitted = self.inbox[:max(0, p.slots - len(self.rows))]
        del self.inbox[:len(admitted)]
        for sid, n, submitted in admitted:
            self.job.result.stage_wall.setdefault("queue_s", []).append(now - submitted)
            self.rows.append([sid, n, self.version, now, n])
        if not self.rows:
            self.stepping = False
            return
        self.stepping = True
        self.engine.submit(p.step_a + p.step_c * len(self.rows) + p.step_d * len(admitted), self._stepped)

    def _stepped(self) -> None:
        now, keep = self.job.sim.now, []
        for row in self.rows:
            row[1] -= 1
            if row[1] > 0:
                keep.append(row)
                continue
            self.job.result.stage_wall.setdefault("token_s", []).append((now - row[3]) / row[4])
            self.on_finished((row[0], row[2], row[4]), request=False)
        self.rows = keep
        self.try_request()  # the comms thread flushes a step's results together, then asks for its free credits
        self._step()

    def on_finished(self, sample: tuple[str, int, int], request: bool = True) -> None:
        """``sample``: (sample id, behaviour version, response tokens)."""
        if self.loading:
            self.held.append(sample)
            return
        self._send(sample)
        if request:
            self.try_request()

    def _send(self, sample: tuple[str, int, int]) -> None:
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


class _Job:
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
        self.inbox: deque = deque()
        self.ctl_busy = False
        self.learner = self.sim.proc("learner").server("train")
        self.egress = self.sim.proc("publisher-egress", cpu=False).server("link", shares_core=False)
        self.published = 0
        self.workers = [_Worker(self, i) for i in range(p.workers)]

    # ------------------------------------------------------------------------------ controller
    def to_controller(self, msg: tuple) -> None:
        self.sim.at(self.p.msg_s, self._enqueue, msg)

    def _enqueue(self, msg: tuple) -> None:
        self.inbox.append(msg)
        self._serve_next()

    def _serve_next(self) -> None:
        if self.ctl_busy or not self.inbox:
            return
        self.ctl_busy = True
        msg = self.inbox.popleft()
        self.ctl.submit(self.p.ctl_msg_s, lambda: self._handled(msg))

    def _handled(self, msg: tuple) -> None:
        self.ctl_busy = False
        self.result.controller_msgs += 1
        kind = msg[0]
        if kind == "work":
            _, w, credits, version = msg
            n_groups = credits // self.p.group_size
            out = []
            if n_groups > 0 and not self.done:
                want = min(max(0, n_groups - self.gate.counts().issued), self.gate.capacity())
                if want:
                    self.buffer.admit(dict, want)
                if self.gate.counts().issued:
                    out = self.buffer.assign(w.id, worker_version=version, max_groups=n_groups)
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
        this: Counter = Counter(batch.step - s.min_version for g in batch.groups for s in g.samples)
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
    return _Job(p).run()


def window_rate(version_times: list[float], batch_samples: int, warmup: int | None = None) -> dict[str, float]:
    """Samples/s and step time over the steady window, the way ``scripts/bench_async.py`` measures a real
    run: the first tenth of the steps (at least 2) is warm-up; the window runs from version ``warmup`` to
    the last."""
    steps = len(version_times)
    skip = max(2, steps // 10) if warmup is None else warmup
    win = version_times[skip - 1:]
    n = len(win) - 1
    if n < 1:
        raise ValueError(f"only {steps} versions: simulate or run more steps than the {skip} of warm-up")
    wall = win[-1] - win[0]
    return {"samples_per_s": n * batch_samples / wall, "step_s": wall / n, "steps_timed": float(n),
            "first_step": float(skip)}


def window_staleness(r: Result) -> Counter:
    """Staleness of the batches a run's window counts (learner steps >= the warm-up, as ``scalecal.measure``)."""
    skip = max(2, len(r.version_times) // 10)
    out: Counter = Counter()
    for c in r.batch_staleness[skip:]:
        out.update(c)
    return out
