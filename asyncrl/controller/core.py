"""The controller's logic without sockets: messages in, replies out.

Owns: the dataset cursor, admission under the staleness gate, group assembly and exactly-once
accounting (through ``asyncrl.controller``), scoring with the task's verifier, advantages (through
``asyncrl.algo``), the trajectory log (every scored sample), the run-setup answer to ``asyncrl learner``,
the training time budget and the ``learner.stop_on`` stop (both end the run at the learner's next batch
request), the metrics row of every learner version and the end-of-run summary, and the fields of its
checkpointable state. It is composed of objects that own their state: ``Membership`` (the learner and the
workers: joining, liveness, quarantine), ``BatchDesk`` (the learner's batch requests and the time budget),
``RunReport`` (injected by the process: metrics.jsonl and the health watch); ``asyncrl.controller.state``
saves and loads the state.
Never: touches a socket, a thread or a signal (``workers/controller.py`` does), or trains anything.
Not thread-safe: one event loop drives it.

Message handling: ``handle(peer, msg) -> [(peer, reply), ...]`` for control messages, ``on_sample``
for streamed samples, ``poll()`` for timers (dead workers, overdue groups, a batch that became ready).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

import protocols as P
from asyncrl.algo import outcome_advantages
from asyncrl.config.schema import TrainConfig
from asyncrl.controller import BatchAssembler, GroupBuffer, ManualVersion, ResultStatus, StalenessGate
from asyncrl.controller.admission import admit_and_assign
from asyncrl.controller.batches import BatchDesk
from asyncrl.controller.membership import Membership
from asyncrl.controller.scores import Scores
from asyncrl.controller.state import load_state, save_state
from asyncrl.controller.validation import check_sample
from asyncrl.controller.workers import WorkerInfo
from asyncrl.log import EventRecord, SampleRecord, TrajectoryLogWriter
from asyncrl.rundir import RunDir
from asyncrl.rundir.checkpoints import prune_controller_states
from asyncrl.rundir.files import atomic_write_text
from asyncrl.tasks.scoring import GroupScorer
from protocols.setup import SETUP_REQUEST

if TYPE_CHECKING:
    from asyncrl.controller.report import RunReport

log = logging.getLogger("asyncrl.controller")
Reply = tuple[bytes, Any]
MAX_CONSECUTIVE_SKIPS = 10_000  # too-long prompts skipped in a row before the dataset is declared unusable
NO_WORK_RETRY_MIN_S = 0.05
"""The shortest NoWork back-off: what a small fleet waits before asking again."""
NO_WORK_RETRY_MAX_S = 1.0
"""The longest: a worker also asks at once when new weights arrive (they are what opens the gate)."""
NO_WORK_POLLS_PER_S = 200.0
"""The empty requests per second the whole fleet may send: the back-off grows with the number of
workers to keep them under this, a small share of what the controller handles (docs/benchmarks.md §11).
192 workers polling every 50 ms would send 3,840 a second, more than all of it."""
REISSUE_ELSEWHERE_S = 1.0
"""A group reissued because its worker returned a sample that was rejected is not handed back to that worker
for this long: another worker takes it first (a bad worker cannot spin on one group)."""
DONE_GRACE_S = 15.0
"""After the learner's last version, how long the controller keeps serving so that workers can hand
back their groups and say Goodbye; it ends earlier once every worker has left."""


def no_work_retry_s(n_workers: int) -> float:
    """The back-off a NoWork tells a worker to wait: n_workers / NO_WORK_POLLS_PER_S, within
    [NO_WORK_RETRY_MIN_S, NO_WORK_RETRY_MAX_S]."""
    return min(NO_WORK_RETRY_MAX_S, max(NO_WORK_RETRY_MIN_S, n_workers / NO_WORK_POLLS_PER_S))


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What a joining worker learns about the model (``workers/controller.py`` reads it from the model folder).

    ``config_json``: the model's complete Hugging Face config as JSON text (the architecture a native
    engine builds; its ``vocab_size`` bounds valid token ids)."""

    config_json: str
    eos_token_ids: tuple[int, ...] = ()
    model_id: str = ""
    model_dir: str = ""


class ControllerCore:
    """``setup``: what a learner that asks where the run is gets (None: such a Hello is refused like any client's).
    ``report``: where each learner version's metrics go, set by the process before its loop starts (None:
    nowhere, no health watch)."""

    def __init__(self, cfg: TrainConfig, *, run_dir: Path, scorer: GroupScorer, model: ModelInfo,
                 samples_address: str, publish_formats: list[str], setup: P.RunSetup | None = None,
                 clock=time.monotonic) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.scorer = scorer
        self.model = model
        self.samples_address = samples_address
        self.setup = setup
        self.report: RunReport | None = None
        self.clock = clock
        self.version = ManualVersion(0)
        self.gate = StalenessGate(self.version, eta=cfg.rollout.eta, groups_per_step=cfg.rollout.groups_per_step)
        self.buffer = GroupBuffer(self.gate, group_size=cfg.algo.group_size, clock=clock,
                                  assignment_timeout_s=cfg.rollout.assignment_timeout_s)
        keep = (lambda g: not g.scored().zero_variance) if cfg.algo.dynamic_sampling else None
        self.assembler = BatchAssembler(self.gate, self.buffer, keep=keep,
                                        max_filtered_per_step=4 * cfg.rollout.groups_per_step)
        self.cursor = 0  # index of the next problem of the task's prompt stream
        self.vocab_size = _vocab_size(model, scorer)
        self.done = False
        self.done_at = 0.0
        self.counters: Counter = Counter()
        self.samples_logged = 0
        self.log = TrajectoryLogWriter(RunDir(self.run_dir).trajectories, config=dataclasses.asdict(cfg),
                                       run_name=cfg.run_name, model=model.model_id,
                                       fsync=cfg.log.fsync, fsync_every=cfg.log.fsync_every,
                                       rotate_bytes=cfg.log.rotate_mb * 2**20, salvage=cfg.log.salvage)
        self.members = Membership(cfg.rollout, self.buffer, self.log, self.counters, publish_formats)
        self.batches = BatchDesk(self.assembler, self.log, self.counters, self.members.workers,
                                 time_budget_s=cfg.learner.time_budget_s, stop_ids=getattr(scorer, "stop_ids", ()))
        for c in self.log.repaired:
            self.counters["log/torn_tail_repaired"] += 1
            log.warning("trajectory log repaired at start: %s", c)
        for c in self.log.salvaged:
            self.counters["log/salvaged_damage"] += 1
            log.warning("log.salvage=true: damaged records skipped: %s", c)
        if self.log.salvaged:
            self.log.append(EventRecord(event="salvaged", logged_at=time.time(),
                                        data={"skipped": "; ".join(str(c) for c in self.log.salvaged)}))

    # ----------------------------------------------------------------------------- control plane
    def handle(self, peer: bytes, msg: Any) -> list[Reply]:
        now = self.clock()
        if isinstance(msg, P.Hello):
            return self._hello(peer, msg, now)
        if isinstance(msg, P.WorkRequest):
            return self._work(peer, msg, now)
        if isinstance(msg, (P.Heartbeat, P.Goodbye)):
            w = self.members.heard(peer, msg.peer_id, now, before="heartbeats or goodbyes")
            if isinstance(msg, P.Goodbye):
                if isinstance(w, WorkerInfo):
                    self.members.forget(msg.peer_id, reason=f"left ({msg.reason})")
                return [(peer, w)] if isinstance(w, P.Error) else []
            if not isinstance(w, WorkerInfo):
                return [(peer, w)]
            w.heartbeat(msg.version, msg.stats)
            # also reaches a worker still starting, which asks for nothing yet
            return [(peer, P.Shutdown(reason="training finished"))] if self.done else []
        if isinstance(msg, (P.BatchRequest, P.VersionUpdate)) and peer != self.members.learner_peer:
            self.counters["control/not_learner"] += 1  # a refused learner's versions are not logged either
            what = "may ask for batches" if isinstance(msg, P.BatchRequest) else "reports versions"
            return [(peer, P.Error(code="not_learner", message=f"only the registered learner {what}"))]
        if isinstance(msg, P.BatchRequest):
            reply = self.batches.request(msg.step, now)
            return [] if reply is None else [(peer, reply)]
        if isinstance(msg, P.VersionUpdate):
            return self._version_update(msg)
        self.counters["control/unexpected"] += 1
        return [(peer, P.Error(code="unexpected", message=f"{type(msg).__name__} is not a controller request"))]

    def _hello(self, peer: bytes, msg: P.Hello, now: float) -> list[Reply]:
        if msg.role == "client" and self.setup is not None and msg.capabilities.get("request") == SETUP_REQUEST:
            # `asyncrl learner`: where the run folder and the model are (before it loads anything)
            refused = P.check_hello(msg)  # a peer older than the protocol floor
            return [(peer, refused if refused is not None else P.Welcome(
                protocol_version=P.PROTOCOL_VERSION, server_id="controller", run=self.setup))]
        if (refused := P.check_hello(msg)) is not None:
            self.counters["control/rejected_hello"] += 1
            return [(peer, refused)]
        if msg.role != "learner":
            w = self.members.worker_hello(peer, msg, now)
            return [(peer, self._welcome(setup=self.worker_setup(w)) if isinstance(w, WorkerInfo) else w)]
        m, asm = self.members, self.assembler
        if (reason := m.learner_refusal(peer, msg, version=self.version.version, next_step=asm.next_step,
                                        retained=asm.retained_steps())) is not None:
            return [(peer, P.Reject(reason=reason))]
        moved = m.register_learner(peer, msg)
        self.batches.pending = None  # a request of an earlier learner process; the learner asks again after its Welcome
        if msg.version > self.version.version:
            log.info("learner starts at version %d", msg.version)
            self.version.set(msg.version)
        out = [(peer, self._welcome())]
        if moved:  # a learner that restarted serves its weights elsewhere: every worker fetches from there now
            self.counters["control/learner_rejoined"] += 1
            log.info("learner rejoined at version %d with a new weight server; telling %d workers", msg.version,
                     len(m.workers))
            out += [(w.peer, self._welcome(setup=self.worker_setup(w))) for w in m.workers.values()]
        return out

    def _welcome(self, **fields: Any) -> P.Welcome:
        return P.Welcome(protocol_version=P.PROTOCOL_VERSION, server_id="controller",
                         latest_version=self.version.version, **fields)

    def worker_setup(self, w: WorkerInfo) -> P.WorkerSetup:
        """What worker ``w`` is told when it joins (the one place a ``WorkerSetup`` is filled): its formats too."""
        weights = self.members.weights_addresses
        assert weights is not None, "workers are welcomed only once the learner has registered"
        r, m = self.cfg.rollout, self.model
        return P.WorkerSetup(samples_address=self.samples_address, weights_announce=weights[0],
                             weights_fetch=weights[1], model_config=m.config_json,
                             worker_slots=r.worker_slots, heartbeat_s=r.heartbeat_s, quant_format=w.quant_format,
                             eos_token_ids=list(m.eos_token_ids), model_id=m.model_id, model_dir=m.model_dir,
                             quantize_head=self.cfg.quant.lm_head, group_size=self.cfg.algo.group_size,
                             actor_format=w.actor_format, quantize_embedding=self.cfg.quant.embedding)

    def _work(self, peer: bytes, msg: P.WorkRequest, now: float) -> list[Reply]:
        w = self.members.heard(peer, msg.worker_id, now, before="asking for work")
        if not isinstance(w, WorkerInfo):
            return [(peer, w)]
        w.version = max(w.version, msg.version)  # fresh weights are usable at once, not at the next heartbeat
        if self.done:
            return [(peer, P.Shutdown(reason="training finished"))]
        if (wait_s := self.members.quarantine.backoff_s(msg.worker_id, now)) > 0:  # its last sample was rejected
            return [(peer, P.NoWork(retry_after_s=wait_s))]
        assigned = admit_and_assign(self.buffer, msg.worker_id, credits=msg.credits, worker_version=w.version,
                                    make_meta=self._next_problem)
        out: list[Reply] = [(peer, self._assignment(a)) for a in assigned]
        if not out:
            retry_s = no_work_retry_s(len(self.members.workers))
            self.counters["workers/told_to_wait_ms"] += round(retry_s * 1000)  # read by the learner_bound alarm
            out.append((peer, P.NoWork(retry_after_s=retry_s)))
        return out

    def _next_problem(self) -> dict[str, Any]:
        """The next problem whose prompt fits the model; longer ones are skipped and counted."""
        for _ in range(MAX_CONSECUTIVE_SKIPS):
            problem = self.scorer.problem(self.cursor)
            self.cursor += 1
            if self.scorer.fits(problem["prompt_ids"]):
                return problem
            self.counters["data/prompts_too_long"] += 1
            log.warning("skipped %s: %d prompt tokens, the limit is %d (task.max_prompt_tokens)", problem["id"],
                        len(problem["prompt_ids"]), self.scorer.max_prompt_tokens)
        raise ValueError(f"{MAX_CONSECUTIVE_SKIPS} prompts in a row are longer than {self.scorer.max_prompt_tokens} "
                         "tokens; shorten the dataset's prompts or use a model with a longer context")

    def _assignment(self, a) -> P.RolloutAssignment:
        prompt = np.asarray(a.meta["prompt_ids"], np.int32)
        r = self.cfg.rollout
        params = P.SamplingParams(temperature=r.temperature, max_new_tokens=r.max_new_tokens,
                                  seed=self.cfg.seed * 1_000_003 + r.seed,
                                  stop_token_ids=list(getattr(self.scorer, "stop_ids", ())))
        return P.RolloutAssignment(group_id=a.group_id, sample_ids=list(a.sample_ids),
                                   prompt_ids=P.Array.from_numpy(prompt), params=params,
                                   n_samples=len(a.sample_ids))

    # ------------------------------------------------------------------------------- data plane
    def on_sample(self, msg: Any) -> list[Reply]:
        """Record one streamed sample; returns the learner's batch if this sample completed it.

        A result for a group the worker does not hold is dropped and counted (late, duplicate, ...);
        an accepted one must pass ``check_sample`` or it is rejected (counted, never logged) and its
        group reissued to another worker first; an invalid one (not merely late) also backs its worker off
        and may quarantine it (``Membership.rejected``)."""
        if not isinstance(msg, P.FinishedSample):
            self.counters["samples/unexpected_message"] += 1
            return []
        if (w := self.members.workers.get(msg.worker_id)) is not None:
            w.last_seen = self.clock()
            w.samples += 1
        versions = msg.versions.to_numpy()
        # an empty response carries no token to be stale
        min_version = self.version.version if versions.size == 0 else int(versions.min())
        if not np.isfinite(msg.behav_logp.to_numpy()).all():
            self.counters["samples/nonfinite_behav_logp"] += 1  # -inf is kept: the learner masks it (§2.5)
        if self.buffer.classify(msg.sample_id, msg.worker_id) is ResultStatus.ACCEPTED:
            admission = self.buffer.admission_of(msg.sample_id)
            if admission is None:  # classify() accepted it, so its group is live: a bug, not bad input
                raise RuntimeError(f"accepted sample {msg.sample_id} has no live group")
            group_id, meta, admit_version = admission
            bad = check_sample(msg, meta=meta, admit_version=admit_version,
                               served_version=self.version.version, vocab_size=self.vocab_size,
                               max_new_tokens=self.cfg.rollout.max_new_tokens)
            if bad is not None:
                self.counters[bad.counter] += 1
                self.counters["samples/reissued"] += len(self.buffer.reassign_group(group_id,
                                                                                    avoid_s=REISSUE_ELSEWHERE_S))
                if bad.late:  # honest: never a step towards quarantine
                    log.warning("%s from %s is too old for its group: %s; group reissued to another worker first",
                                msg.sample_id, msg.worker_id, bad.reason)
                    return []
                self.counters["samples/rejected_invalid"] += 1
                return self.members.rejected(msg.worker_id, msg.sample_id, bad.reason, self.clock())
        try:
            status = self.buffer.on_result(msg.sample_id, worker_id=msg.worker_id, payload=msg,
                                           min_version=min_version)
        except ValueError as e:  # a token older than its group's admission: a broken worker
            self.counters["samples/rejected_version"] += 1
            log.error("rejected %s from %s: %s", msg.sample_id, msg.worker_id, e)
            return []
        self.counters[f"samples/{status.value}"] += 1
        if status.accepted:
            self.members.quarantine.accepted(msg.worker_id)
        if status is ResultStatus.COMPLETED:
            self._complete(msg.group_id)
            return self._serve()  # a waiting learner gets its batch now, not at the next timer tick
        return []

    def _complete(self, group_id: str) -> None:
        group = self.buffer.get(group_id)
        samples = [s.payload for s in group.samples]
        scores = score_group(self.scorer, self.cfg.algo.advantage, group.meta, samples)
        self.buffer.score(group_id, scores)
        for s, r, a in zip(samples, scores.rewards, scores.advantages, strict=True):
            self.log.append(SampleRecord(sample=s, reward=r, advantage=a, admitted_version=group.admit_version,
                                         logged_at=time.time()))
            self.samples_logged += 1

    # -------------------------------------------------------------------------------- learner
    def _serve(self) -> list[Reply]:
        """The learner's pending batch (or the error that ends its request), when it can be answered now."""
        if self.members.learner_peer is None or (reply := self.batches.serve()) is None:
            return []
        return [(self.members.learner_peer, reply)]

    def _version_update(self, msg: P.VersionUpdate) -> list[Reply]:
        if self.report is not None:
            stop = self.report.version(msg, self.metrics(), samples_logged=self.samples_logged,
                                       quarantined=self.members.quarantine.reasons())
            self.batches.stop_reason = self.batches.stop_reason or stop  # learner.stop_on: ends like time_budget_s
        if msg.version > self.version.version:
            self.version.set(msg.version)
            self.assembler.release_through(msg.version)
        if msg.done and not self.done:
            self.done = True
            self.done_at = self.clock()
        out = []
        if msg.checkpoint and self.members.learner_peer is not None:
            # Saved before the learner writes its own checkpoint of this version (it waits for the ack).
            self.save(self.checkpoint_path(msg.version))
            prune_controller_states(RunDir(self.run_dir).checkpoints)  # as the learner prunes its own
            out.append((self.members.learner_peer, P.VersionUpdate(version=msg.version, checkpointed=True)))
        return out + self._serve()

    def checkpoint_path(self, version: int) -> Path:
        return RunDir(self.run_dir).controller_checkpoint(version)

    # --------------------------------------------------------------------------------- timers
    def poll(self) -> list[Reply]:
        now = self.clock()
        self.members.reap(now)
        for a in self.buffer.overdue(now):  # measured from the assignment; a late result is dropped (samples/late)
            self.counters["samples/overdue_groups"] += 1
            self.counters["samples/reissued"] += len(self.buffer.reassign_group(a.group_id))
            log.warning("group %s not finished by %s within %.0fs of its assignment; reissued", a.group_id,
                        a.worker_id, self.cfg.rollout.assignment_timeout_s)
        return self._serve()

    def finished(self) -> bool:
        """Training is done and every worker has left, or ``DONE_GRACE_S`` passed since: the process may end."""
        return self.done and (not self.members.workers or self.clock() - self.done_at > DONE_GRACE_S)

    def metrics(self) -> dict[str, float]:
        out = {f"controller/{k}": float(v) for k, v in self.counters.items()}
        out["controller/samples_logged"] = float(self.samples_logged)
        out["controller/cursor"] = float(self.cursor)
        out["throughput/tokens_per_s"] = self.members.workers.tokens_per_s()
        if (sync_s := self.members.workers.weight_sync_s()) is not None:
            out["workers/weight_sync_s"] = sync_s
        return out

    # ----------------------------------------------------------------------------- checkpoint
    def save(self, path: Path) -> None:
        """Checksummed and atomic: a reader sees the previous state or this one (``asyncrl.controller.state``)."""
        save_state(self, path)

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (``state_dict`` of a previous controller, after ``truncate_log``)."""
        load_state(self, state)

    def finish(self) -> None:
        """The end of the run: ``controller_final.json`` (its facts) and the final state, both atomic (a full disk
        leaves the old file or none), unless the log was lost: no end-of-run facts that count samples it does
        not hold. ``DiskFullError`` / ``LogLostError`` (lost since the last flush) as for a checkpoint."""
        if self.log.lost is not None:
            return
        self.log.flush()
        summary = {"max_consumed_staleness": self.batches.max_consumed_staleness,
                   "samples_logged": self.samples_logged, **self.metrics(),
                   **(self.report.final() if self.report is not None else {})}
        paths = RunDir(self.run_dir)
        atomic_write_text(paths.controller_final, json.dumps(summary, indent=2))
        self.save(paths.controller_final_checkpoint)

    def close(self) -> None:
        self.log.close()
        if self.report is not None:
            self.report.close()


def score_group(scorer: GroupScorer, estimator: str, meta: dict[str, Any], samples: list[Any]) -> Scores:
    """The scores of one complete group of ``FinishedSample``s: the task's rewards, the estimator's advantages."""
    rewards = scorer.rewards(meta, [s.response_ids.to_numpy().tolist() for s in samples])
    adv, counts = outcome_advantages(rewards, estimator=estimator)
    return Scores(tuple(rewards), tuple(adv.astype(np.float32).tolist()),  # the float32 values the learner trains on
                  zero_variance=counts.zero_var + counts.singleton > 0)


def _vocab_size(model: ModelInfo, scorer: GroupScorer) -> int:
    """Rows of the model's embedding (from the config the workers get), else the tokenizer's size."""
    vocab = json.loads(model.config_json).get("vocab_size") if model.config_json else None
    if isinstance(vocab, int) and not isinstance(vocab, bool):
        return vocab
    return len(scorer.tokenizer)
