"""The controller's logic without sockets: messages in, replies out.

Owns: the dataset cursor, admission under the staleness gate, group assembly and exactly-once
accounting (through ``asyncrl.controller``), scoring with the task's verifier, advantages (through
``asyncrl.algo``), the trajectory log (every scored sample), worker liveness, the back-off and quarantine of
workers whose samples fail validation (``asyncrl.controller.quarantine``), the training time budget
(``learner.time_budget_s``; ``stop_reason``, set by a ``learner.stop_on`` health alarm, ends the run the
same way), and the fields of its checkpointable state. Learner batches are answered by
``asyncrl.controller.batches``, the state is saved and loaded by ``asyncrl.controller.state``.
Never: touches a socket, a thread or a signal (``workers/controller.py`` does), or trains anything.
Not thread-safe: one event loop drives it.

Message handling: ``handle(peer, msg) -> [(peer, reply), ...]`` for control messages, ``on_sample``
for streamed samples, ``poll(now)`` for timers (dead workers, a batch that became ready).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

import protocols as P
from asyncrl.config import TrainConfig
from asyncrl.controller import BatchAssembler, GroupBuffer, ManualVersion, ResultStatus, StalenessGate
from asyncrl.controller.admission import admit_and_assign
from asyncrl.controller.batches import request_batch, try_batch
from asyncrl.controller.membership import learner_join, worker_conflict
from asyncrl.controller.quarantine import Quarantine
from asyncrl.controller.scored import ScoredGroup
from asyncrl.controller.scoring import GroupScorer
from asyncrl.controller.state import load_state, save_state
from asyncrl.controller.validation import Rejection, check_sample
from asyncrl.controller.workers import WorkerRegistry
from asyncrl.log import EventRecord, SampleRecord, TrajectoryLogWriter
from asyncrl.rundir import RunDir
from asyncrl.rundir.checkpoints import prune_controller_states
from protocols.values import QUARANTINED

log = logging.getLogger("asyncrl.controller")
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
    def __init__(self, cfg: TrainConfig, *, run_dir: Path, scorer: GroupScorer, model: ModelInfo,
                 samples_address: str, publish_formats: list[str], clock=time.monotonic) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.scorer = scorer
        self.model = model
        self.samples_address = samples_address
        self.weights_addresses: tuple[str, str] | None = None  # the learner's weight server (announce, fetch)
        self.publish_formats = publish_formats
        self.clock = clock
        self.version = ManualVersion(0)
        self.gate = StalenessGate(self.version, eta=cfg.rollout.eta, groups_per_step=cfg.rollout.groups_per_step)
        self.buffer = GroupBuffer(self.gate, group_size=cfg.algo.group_size, clock=clock,
                                  assignment_timeout_s=cfg.rollout.assignment_timeout_s)
        keep = (lambda g: ScoredGroup.of(g).informative()) if cfg.algo.dynamic_sampling else None
        self.assembler = BatchAssembler(self.gate, self.buffer, keep=keep,
                                        max_filtered_per_step=4 * cfg.rollout.groups_per_step)
        self.cursor = 0  # index of the next problem of the task's prompt stream
        self.vocab_size = _vocab_size(model, scorer)
        self.workers = WorkerRegistry()
        self.quarantine = Quarantine(cfg.rollout.quarantine_after)  # back-offs after rejections, quarantined workers
        self.learner_peer: bytes | None = None
        self.pending_batch: int | None = None  # step the learner asked for and did not get yet
        self.done = False
        self.done_at = 0.0
        # learner.time_budget_s: training seconds spent before this process (a resumed run), and the
        # clock at this process's first batch request
        self.budget_used_s = 0.0
        self.budget_t0: float | None = None
        self.budget_admitted_step: int | None = None  # the step last asked for inside the budget (served however late)
        self.stop_reason: str | None = None  # set (learner.stop_on): the next batch request gets Shutdown
        self.counters: Counter = Counter()
        self.max_consumed_staleness = 0
        self.samples_logged = 0
        self.log = TrajectoryLogWriter(RunDir(self.run_dir).trajectories, config=dataclasses.asdict(cfg),
                                       run_name=cfg.run_name, model=model.model_id,
                                       fsync=cfg.log.fsync, fsync_every=cfg.log.fsync_every,
                                       rotate_bytes=cfg.log.rotate_mb * 2**20, salvage=cfg.log.salvage)
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
    def handle(self, peer: bytes, msg: Any) -> list[tuple[bytes, Any]]:
        now = self.clock()
        if isinstance(msg, P.Hello):
            if msg.role == "learner" and P.check_hello(msg) is None:
                return learner_join(self, peer, msg)  # asyncrl.controller.membership
            return [(peer, self._hello(peer, msg, now))]
        if isinstance(msg, P.WorkRequest):
            return self._work(peer, msg, now)
        if isinstance(msg, (P.Heartbeat, P.Goodbye)):
            if (reason := self.quarantine.shutdown_reason(msg.peer_id, peer)) is not None:
                return [] if isinstance(msg, P.Goodbye) else [(peer, P.Shutdown(reason=reason))]
            w = self.workers.get(msg.peer_id)
            if w is None or w.peer != peer:  # a peer may only speak for itself
                self.counters["control/unknown_worker"] += 1
                return [(peer, P.Error(code="not_registered", message="send Hello before heartbeats or goodbyes"))]
            if isinstance(msg, P.Heartbeat):
                self._heartbeat(msg, now)
                if self.done:  # also reaches a worker still starting, which asks for nothing yet
                    return [(peer, P.Shutdown(reason="training finished"))]
            else:
                self._forget(msg.peer_id, reason=f"left ({msg.reason})")
            return []
        if isinstance(msg, P.BatchRequest):
            return request_batch(self, peer, msg, now)  # asyncrl.controller.batches
        if isinstance(msg, P.VersionUpdate):
            if peer != self.learner_peer:
                self.counters["control/not_learner"] += 1
                return [(peer, P.Error(code="not_learner", message="only the registered learner reports versions"))]
            return self._version_update(msg)
        self.counters["control/unexpected"] += 1
        return [(peer, P.Error(code="unexpected", message=f"{type(msg).__name__} is not a controller request"))]

    def _hello(self, peer: bytes, msg: P.Hello, now: float) -> Any:
        reject = P.check_hello(msg)
        if reject is not None:
            self.counters["control/rejected_hello"] += 1
            return reject
        if msg.role != "generator":
            return P.Reject(reason=f"role {msg.role!r} cannot join; expected generator or learner")
        if self.learner_peer is None:
            return P.Error(code="not_ready", message="the learner has not published weights yet; retry")
        fmt = msg.capabilities.get("quant_format") or self.publish_formats[0]
        if fmt not in self.publish_formats:
            self.counters["control/rejected_format"] += 1
            return P.Reject(reason=f"this run publishes weights as {self.publish_formats}; start the worker with "
                                   f"quant.fmt={self.publish_formats[0]} (or start the run with "
                                   f"quant.extra_formats=[{fmt}])")
        if msg.peer_id in self.quarantine:
            self.counters["control/rejected_quarantined"] += 1
            return P.Reject(reason=self.quarantine.refusal(msg.peer_id))
        r = self.cfg.rollout
        conflict = worker_conflict(msg.peer_id, self.workers.get(msg.peer_id), peer=peer, now=now,
                                   heartbeat_s=r.heartbeat_s, dead_after_s=r.dead_after_s)
        if conflict is not None:
            self.counters["control/duplicate_worker_id"] += 1
            log.warning("refused a second worker %s: %s", msg.peer_id, conflict)
            return P.Reject(reason=conflict)
        if msg.peer_id in self.workers:  # joined again (restart, lost Welcome): its old work is reissued
            self._forget(msg.peer_id, reason="joined again")
        caps = msg.capabilities
        self.workers.join(msg.peer_id, peer=peer, quant_format=fmt, now=now, host=caps.get("host", ""),
                          pid=caps.get("pid", ""))
        self.log.append(EventRecord(event="worker_joined", data={"worker": msg.peer_id, "fmt": fmt},
                                    logged_at=time.time()))
        log.info("worker %s joined (%s)", msg.peer_id, fmt)
        return P.Welcome(protocol_version=P.PROTOCOL_VERSION, server_id="controller",
                         latest_version=self.version.version, setup=self.worker_setup(fmt))

    def worker_setup(self, fmt: str) -> P.WorkerSetup:
        """What a worker that fetches ``fmt`` is told when it joins (the one place a ``WorkerSetup`` is filled)."""
        assert self.weights_addresses is not None, "workers are welcomed only once the learner has registered"
        r, m = self.cfg.rollout, self.model
        return P.WorkerSetup(samples_address=self.samples_address, weights_announce=self.weights_addresses[0],
                             weights_fetch=self.weights_addresses[1], model_config=m.config_json,
                             worker_slots=r.worker_slots, heartbeat_s=r.heartbeat_s, quant_format=fmt,
                             eos_token_ids=list(m.eos_token_ids), model_id=m.model_id, model_dir=m.model_dir,
                             quantize_head=self.cfg.quant.lm_head, group_size=self.cfg.algo.group_size)

    def _work(self, peer: bytes, msg: P.WorkRequest, now: float) -> list[tuple[bytes, Any]]:
        w = self.workers.get(msg.worker_id)
        if w is None and (reason := self.quarantine.shutdown_reason(msg.worker_id, peer)) is not None:
            return [(peer, P.Shutdown(reason=reason))]
        if w is None or w.peer != peer:
            self.counters["control/unknown_worker"] += 1
            return [(peer, P.Error(code="not_registered", message="send Hello before asking for work"))]
        w.last_seen = now
        w.version = max(w.version, msg.version)  # fresh weights are usable at once, not at the next heartbeat
        if self.done:
            return [(peer, P.Shutdown(reason="training finished"))]
        if (wait_s := self.quarantine.backoff_s(msg.worker_id, now)) > 0:  # its last sample was rejected
            return [(peer, P.NoWork(retry_after_s=wait_s))]
        assigned = admit_and_assign(self.buffer, msg.worker_id, credits=msg.credits, worker_version=w.version,
                                    make_meta=self._next_problem)
        out: list[tuple[bytes, Any]] = [(peer, self._assignment(a)) for a in assigned]
        if not out:
            retry_s = no_work_retry_s(len(self.workers))
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

    def _heartbeat(self, msg: P.Heartbeat, now: float) -> None:
        w = self.workers.get(msg.peer_id)
        if w is None:
            self.counters["control/unknown_heartbeat"] += 1
            return
        w.last_seen = now
        w.version = max(w.version, msg.version)
        tps = msg.stats.get("tokens_per_s", 0.0)
        w.tokens_per_s = tps if math.isfinite(tps) else 0.0  # alive, but its assignments' deadlines stand
        sync_s, syncs = msg.stats.get("weight_sync_s", 0.0), msg.stats.get("weight_syncs", 0.0)
        if math.isfinite(sync_s) and math.isfinite(syncs) and sync_s >= 0 and syncs >= 0:
            w.weight_sync_s, w.weight_syncs = sync_s, syncs

    def drop_peer(self, peer: bytes) -> None:
        """A peer was dropped for not reading its replies: a worker behind it is forgotten (work reissued)."""
        for wid in self.workers.behind(peer):
            self._forget(wid, reason="dropped: it does not read the controller's replies")

    def _forget(self, worker_id: str, *, reason: str) -> None:
        if self.workers.pop(worker_id, None) is None:
            return
        self.quarantine.forget(worker_id)
        reissued = self.buffer.reassign_from(worker_id)
        self.counters["workers/left"] += 1
        self.counters["samples/reissued"] += len(reissued)
        self.log.append(EventRecord(event="worker_left", logged_at=time.time(),
                                    data={"worker": worker_id, "reason": reason, "reissued": str(len(reissued))}))
        log.info("worker %s %s; reissuing %d samples", worker_id, reason, len(reissued))

    # ------------------------------------------------------------------------------- data plane
    def on_sample(self, msg: P.FinishedSample) -> list[tuple[bytes, Any]]:
        """Record one streamed sample; returns the learner's batch if this sample completed it.

        A result for a group the worker does not hold is dropped and counted (late, duplicate, ...);
        an accepted one must pass ``check_sample`` or it is rejected (counted, never logged) and its
        group reissued."""
        w = self.workers.get(msg.worker_id)
        if w is not None:
            w.last_seen = self.clock()
            w.samples += 1
        versions = msg.versions.to_numpy()
        if versions.size == 0:
            min_version = self.version.version  # an empty response carries no token to be stale
        else:
            min_version = int(versions.min())
        if not np.isfinite(msg.behav_logp.to_numpy()).all():
            self.counters["samples/nonfinite_behav_logp"] += 1  # -inf is kept: the learner masks it (§2.5)
        status = self.buffer.classify(msg.sample_id, msg.worker_id)
        if status is ResultStatus.ACCEPTED:
            admission = self.buffer.admission_of(msg.sample_id)
            if admission is None:  # classify() accepted it, so its group is live: a bug, not bad input
                raise RuntimeError(f"accepted sample {msg.sample_id} has no live group")
            group_id, meta, admit_version = admission
            bad = check_sample(msg, meta=meta, admit_version=admit_version,
                               served_version=self.version.version, vocab_size=self.vocab_size,
                               max_new_tokens=self.cfg.rollout.max_new_tokens)
            if bad is not None:
                return self._rejected(msg, group_id, bad)
        try:
            status = self.buffer.on_result(msg.sample_id, worker_id=msg.worker_id, payload=msg,
                                           min_version=min_version)
        except ValueError as e:  # a token older than its group's admission: a broken worker
            self.counters["samples/rejected_version"] += 1
            log.error("rejected %s from %s: %s", msg.sample_id, msg.worker_id, e)
            return []
        self.counters[f"samples/{status.value}"] += 1
        if status.accepted:
            self.quarantine.accepted(msg.worker_id)
        if status is ResultStatus.COMPLETED:
            self._complete(msg.group_id)
            return try_batch(self)  # a waiting learner gets its batch now, not at the next timer tick
        return []

    def _rejected(self, msg: P.FinishedSample, group_id: str, bad: Rejection) -> list[tuple[bytes, Any]]:
        """A sample of a group its worker holds failed ``check_sample``: counted, never logged; the group is
        reissued to another worker first. An invalid one also backs the worker off and, after
        ``rollout.quarantine_after`` in a row, quarantines it (told why in the returned ``Shutdown``); a late
        one (tokens older than the group's admission) does neither."""
        self.counters[bad.counter] += 1
        self.counters["samples/reissued"] += len(self.buffer.reassign_group(group_id, avoid_s=REISSUE_ELSEWHERE_S))
        wid = msg.worker_id
        if bad.late:  # honest: never a step towards quarantine
            log.warning("%s from %s is too old for its group: %s; group reissued to another worker first",
                        msg.sample_id, wid, bad.reason)
            return []
        self.counters["samples/rejected_invalid"] += 1
        shutdown = self.quarantine.rejected(wid, bad.reason, self.clock())
        log.error("rejected %s from %s: %s; group reissued to another worker first (%d rejected in a row)",
                  msg.sample_id, wid, bad.reason, self.quarantine.in_a_row(wid))
        w = self.workers.get(wid)
        if shutdown is None or w is None:
            return []
        self.workers.pop(wid)
        self.quarantine.quarantine(wid, w.peer, shutdown)
        reissued = self.buffer.reassign_from(wid)
        self.counters["workers/quarantined"] += 1
        self.counters["samples/reissued"] += len(reissued)
        self.log.append(EventRecord(event="worker_quarantined", logged_at=time.time(),
                                    data={"worker": wid, "reason": shutdown, "reissued": str(len(reissued))}))
        log.error("worker %s quarantined: %s; its other %d samples in flight go to other workers",
                  wid, shutdown.removeprefix(QUARANTINED), len(reissued))
        return [(w.peer, P.Shutdown(reason=shutdown))]

    def _complete(self, group_id: str) -> None:
        group = self.buffer.get(group_id)
        samples = [s.payload for s in group.samples]
        rewards, advantages = self.scorer.score_group(group.meta, samples)
        self.buffer.annotate(group_id, **ScoredGroup.annotation(rewards, advantages))
        for s, r, a in zip(samples, rewards, advantages, strict=True):
            self.log.append(SampleRecord(sample=s, reward=float(r), advantage=float(a),
                                         admitted_version=group.admit_version, logged_at=time.time()))
            self.samples_logged += 1

    # -------------------------------------------------------------------------------- learner
    def budget_elapsed(self, now: float) -> float:
        """Training seconds of ``learner.time_budget_s`` spent so far (0 before the first batch request)."""
        return self.budget_used_s + (0.0 if self.budget_t0 is None else now - self.budget_t0)

    def budget_spent(self, now: float) -> bool:
        """Starts the budget clock at the first batch request; True once ``learner.time_budget_s`` is spent."""
        if self.budget_t0 is None:
            self.budget_t0 = now
        budget = self.cfg.learner.time_budget_s
        return budget > 0 and self.budget_elapsed(now) >= budget

    def _version_update(self, msg: P.VersionUpdate) -> list[tuple[bytes, Any]]:
        if msg.version > self.version.version:
            self.version.set(msg.version)
            self.assembler.release_through(msg.version)
        if msg.done and not self.done:
            self.done = True
            self.done_at = self.clock()
        out = []
        if msg.checkpoint and self.learner_peer is not None:
            # Saved before the learner writes its own checkpoint of this version (it waits for the ack).
            self.save(self.checkpoint_path(msg.version))
            prune_controller_states(RunDir(self.run_dir).checkpoints)  # as the learner prunes its own
            out.append((self.learner_peer, P.VersionUpdate(version=msg.version, checkpointed=True)))
        return out + try_batch(self)

    def checkpoint_path(self, version: int) -> Path:
        return RunDir(self.run_dir).controller_checkpoint(version)

    # --------------------------------------------------------------------------------- timers
    def poll(self) -> list[tuple[bytes, Any]]:
        now = self.clock()
        for wid, silent_s in self.workers.silent(now, self.cfg.rollout.dead_after_s):
            self.counters["workers/dead"] += 1
            self._forget(wid, reason=f"missed heartbeats for {silent_s:.1f}s")
        for a in self.buffer.overdue(now):  # measured from the assignment; a late result is dropped (samples/late)
            self.counters["samples/overdue_groups"] += 1
            self.counters["samples/reissued"] += len(self.buffer.reassign_group(a.group_id))
            log.warning("group %s not finished by %s within %.0fs of its assignment; reissued", a.group_id,
                        a.worker_id, self.cfg.rollout.assignment_timeout_s)
        return try_batch(self)

    def metrics(self) -> dict[str, float]:
        out = {f"controller/{k}": float(v) for k, v in self.counters.items()}
        out["controller/samples_logged"] = float(self.samples_logged)
        out["controller/cursor"] = float(self.cursor)
        out["throughput/tokens_per_s"] = self.workers.tokens_per_s()
        if (sync_s := self.workers.weight_sync_s()) is not None:
            out["workers/weight_sync_s"] = sync_s
        return out

    # ----------------------------------------------------------------------------- checkpoint
    def save(self, path: Path) -> None:
        """Checksummed and atomic: a reader sees the previous state or this one (``asyncrl.controller.state``)."""
        save_state(self, path)

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (``state_dict`` of a previous controller, after ``truncate_log``)."""
        load_state(self, state)

    def close(self) -> None:
        self.log.close()


def _vocab_size(model: ModelInfo, scorer: GroupScorer) -> int:
    """Rows of the model's embedding (from the config the workers get), else the tokenizer's size."""
    vocab = json.loads(model.config_json).get("vocab_size") if model.config_json else None
    if isinstance(vocab, int) and not isinstance(vocab, bool):
        return vocab
    return len(scorer.tokenizer)
