"""Training-health alarms: a run that stopped learning says so, with the likely cause and the knob to turn.

Owns: the alarm catalogue ``ALARMS`` (name -> what it means, its likely cause, what to try), and
``HealthMonitor``, which reads the run's ``metrics.jsonl`` records one at a time (as the controller writes
them, or replayed from the file afterwards) and returns the alarms that fire at each step. The ``health``
section itself (``HealthConfig``, every threshold) and the ``learner.stop_on`` check live with every other
config section, in ``asyncrl.config.health``.
Never: reads or writes files, logs, or talks to a process (``health_log`` owns ``health.jsonl``, the
controller decides what a ``learner.stop_on`` alarm stops); imports anything beyond the standard library
and ``asyncrl.config.health``.

Invariants:
- ``ALARMS`` has exactly the names of ``asyncrl.config.health.ALARM_NAMES``, in that order.
- Deterministic: the same records in the same order give the same alarms at the same steps, so a replay
  of a run's metrics (``asyncrl log show``, a resumed controller) reproduces what the live run raised.
- Only metrics the run already logs are read (docs/metrics.md); a metric a record lacks is skipped, never
  taken as 0 (a step with no loss token logs no ``actor/entropy``).
- Rate limit: an alarm whose condition holds fires once, then again at most every ``health.repeat_every``
  steps while it keeps holding. An event alarm (``EVENT_ALARMS``: a worker quarantined) fires once per event.
- Collapse alarms (length, entropy, zero variance, one answer) stay quiet while the windowed train reward
  is at least ``health.solved_reward``: a solved task has every group right and the policy sure of itself.
- Length, entropy and zero variance are judged only once the train reward's early mean and a full window
  after it are known, and stay quiet while that window is at least ``health.learning_gain`` above the
  early mean: a policy that learns to answer briefly, or that learns from the few informative groups of a
  hard start, is not collapsing. One answer taking over is raised either way (a reward loophole raises
  the reward too).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.config.health import HealthConfig


@dataclass(frozen=True)
class AlarmSpec:
    """What an alarm means (``meaning``), why it usually happens (``cause``) and what to try (``fix``)."""

    meaning: str
    threshold_key: str
    cause: str
    fix: str


ALARMS: dict[str, AlarmSpec] = {
    "length_collapse": AlarmSpec(
        "the mean response length fell below a fraction of its early value while the reward has not risen",
        "health.length_ratio",
        "the policy learned to stop early (answering with a bare number or an end-of-turn token), which "
        "usually follows groups with no reward signal",
        "a lower learner.lr, algo.kl_coef>0 to hold it near the start, a larger algo.group_size, or an "
        "easier task"),
    "entropy_collapse": AlarmSpec(
        "the token entropy fell below a fraction of its early value while the reward has not risen",
        "health.entropy_ratio",
        "the policy became near-deterministic before it learned the task: it stops exploring",
        "a lower learner.lr, algo.kl_coef>0, algo.entropy_coef>0, a higher rollout.temperature"),
    "zero_variance": AlarmSpec(
        "most groups have the same reward for every sample, so they carry no gradient, and the reward has not "
        "risen",
        "health.zero_variance_share",
        "the task is too hard (every sample wrong) or the group too small to contain a right answer",
        "algo.dynamic_sampling=true (train only on informative groups), a larger algo.group_size, or an "
        "easier task"),
    "reward_flat": AlarmSpec(
        "the reward is no better than at the start after health.flat_after_steps steps",
        "health.flat_min_gain",
        "no learning: the signal is too sparse or the step too small (or too large)",
        "a larger algo.group_size or algo.dynamic_sampling=true for sparse rewards, another learner.lr, "
        "or an easier task"),
    "answer_takeover": AlarmSpec(
        "one response makes up most of the batch, whatever the prompt",
        "health.majority_share",
        "mode collapse: the policy answers every prompt the same way",
        "a lower learner.lr, algo.kl_coef>0, a higher rollout.temperature; check the reward for a loophole"),
    "nonfinite": AlarmSpec(
        "a training step met non-finite values (skipped updates, a NaN loss or log-probability, a null "
        "metric)",
        "health.nonfinite",
        "the optimisation diverged or the model overflowed",
        "a lower learner.lr, learner.grad_clip, a wider-range learner.param_dtype; resume from the last "
        "checkpoint"),
    "rollout_bound": AlarmSpec(
        "the learner waits for batches most of the time",
        "health.learner_busy_min",
        "generation is the bottleneck",
        "more workers (rollout.num_workers, or asyncrl worker controller=ADDR), a larger rollout.eta, a "
        "quantized quant.fmt, a smaller rollout.max_new_tokens"),
    "learner_bound": AlarmSpec(
        "the learner trains nearly all the time and the workers are told to wait for work most of theirs",
        "health.workers_idle_max",
        "the learner is the bottleneck and the staleness gate holds the workers back",
        "a larger rollout.eta, fewer workers (rollout.num_workers), more learner ranks (learner.world_size), "
        "LoRA (learner.lora.rank>0)"),
    "worker_quarantined": AlarmSpec(
        "the controller quarantined a generation worker: its samples failed validation rollout.quarantine_after "
        "times in a row, so it gets no more work and its groups go to the other workers",
        "rollout.quarantine_after",
        "the worker's engine or weights produce invalid output (NaN log-probabilities, token ids outside the "
        "vocabulary), or it runs another model or a broken build",
        "check that worker's log and host (its device, asyncrl version and quant.fmt); restart it under "
        "another worker_id once fixed (the launcher restarts its own workers under a new name)"),
}

EVENT_ALARMS = ("worker_quarantined",)
"""Alarms raised for an event (once per event) rather than for a condition that holds: no rate limit."""

# Metrics that count non-finite values in a training step (docs/metrics.md).
NONFINITE_COUNTS = ("learner/skipped_nonfinite_minibatches", "actor/nonfinite_loss", "actor/nonfinite_logp_theta")


@dataclass(frozen=True)
class Alarm:
    """One raised alarm: ``value`` measured against ``threshold`` at learner step ``step``."""

    step: int
    name: str
    value: float
    threshold: float
    detail: str

    @property
    def spec(self) -> AlarmSpec:
        return ALARMS[self.name]

    def message(self) -> str:
        """One line: what happened, the likely cause, the knob to turn."""
        s = self.spec
        return f"{self.detail}; likely cause: {s.cause}; try {s.fix}"

    def as_record(self) -> dict[str, Any]:
        """The ``health.jsonl`` record (without its wall time and stop mark, which the log adds)."""
        return {"step": self.step, "alarm": self.name, "value": _finite_or_none(self.value),
                "threshold": self.threshold, "threshold_key": self.spec.threshold_key,
                "message": self.detail, "cause": self.spec.cause, "fix": self.spec.fix}


class _Series:
    """The early mean (first ``early`` values) and the last ``window`` values of one metric."""

    def __init__(self, early: int, window: int) -> None:
        self.early_n = early
        self.early: list[float] = []
        self.recent: deque[float] = deque(maxlen=window)

    def add(self, value: float) -> None:
        if len(self.early) < self.early_n:
            self.early.append(value)
        else:
            self.recent.append(value)

    def ready(self) -> bool:
        """Both the early mean and a full window after it are known."""
        return len(self.early) == self.early_n and len(self.recent) == self.recent.maxlen

    def early_mean(self) -> float:
        return sum(self.early) / len(self.early)

    def mean(self) -> float:
        return sum(self.recent) / len(self.recent)


class HealthMonitor:
    """Feed it ``metrics.jsonl`` records in order (``observe``); it returns the alarms raised at each."""

    def __init__(self, cfg: HealthConfig) -> None:
        self.cfg = cfg
        e, w = cfg.early_steps, cfg.window
        self.series = {k: _Series(e, w) for k in ("len", "entropy", "reward")}
        self.windows: dict[str, deque[float]] = {k: deque(maxlen=w) for k in ("zero_var", "majority", "busy")}
        self.idle: deque[tuple[float, float, float]] = deque(maxlen=w + 1)  # (told-to-wait s, wall s, workers)
        self.baseline: float | None = None  # the step-0 greedy evaluation
        self.train_steps = 0
        self.last_fired: dict[str, int] = {}
        self.quarantined = 0.0  # controller/workers/quarantined at the last record that had it
        self.named: set[str] = set()  # quarantined workers an alarm has named

    def observe(self, step: int, record: Mapping[str, Any], *,
                quarantined: Mapping[str, str] | None = None) -> list[Alarm]:
        """The alarms raised at ``step`` by ``record`` (one metrics.jsonl record), rate-limited.

        ``quarantined``: the workers the controller quarantined so far and why (a live run: the alarm names
        them; a replay of metrics.jsonl has only their count)."""
        if not self.cfg.enabled:
            return []
        found = self._quarantine(step, record, quarantined or {})
        if _num(record, "eval/baseline") is not None:
            self.baseline = _num(record, "eval/accuracy")
        elif (acc := _num(record, "eval/accuracy")) is not None:
            found += self._eval(step, acc)
        if _num(record, "train/reward_mean") is not None:  # a training step's record
            found += self._train(step, record)
        return [a for a in found if a.name in EVENT_ALARMS or self._due(a)]

    def _quarantine(self, step: int, r: Mapping[str, Any], names: Mapping[str, str]) -> list[Alarm]:
        """worker_quarantined when ``controller/workers/quarantined`` grew since the last record."""
        n = _num(r, "controller/workers/quarantined")
        if n is None or n <= self.quarantined:
            return []
        before, self.quarantined = self.quarantined, n
        new = [w for w in names if w not in self.named]
        self.named.update(new)
        who = "; ".join(f"worker {w} quarantined: {names[w]}" for w in new) or (
            f"{n - before:g} worker(s) quarantined; the controller's log names them")
        return [Alarm(step, "worker_quarantined", n, before,
                      f"{who} (controller/workers/quarantined {before:g} -> {n:g})")]

    def _due(self, alarm: Alarm) -> bool:
        last = self.last_fired.get(alarm.name)
        if last is not None and alarm.step - last < self.cfg.repeat_every:
            return False
        self.last_fired[alarm.name] = alarm.step
        return True

    def _eval(self, step: int, acc: float) -> list[Alarm]:
        c = self.cfg
        if self.baseline is None or step < c.flat_after_steps or self.baseline >= c.solved_reward:
            return []
        gain = acc - self.baseline
        if gain >= c.flat_min_gain:
            return []
        return [Alarm(step, "reward_flat", gain, c.flat_min_gain,
                      f"greedy accuracy {acc:.3f} at step {step} vs {self.baseline:.3f} at step 0 "
                      f"(gain {gain:+.3f} < health.flat_min_gain={c.flat_min_gain:g})")]

    def _train(self, step: int, r: Mapping[str, Any]) -> list[Alarm]:
        c, out = self.cfg, []
        self.train_steps += 1
        if c.nonfinite and (alarm := self._nonfinite(step, r)) is not None:
            out.append(alarm)
        for key, name in (("train/response_len_mean", "len"), ("actor/entropy", "entropy"),
                          ("train/reward_mean", "reward")):
            if (v := _num(r, key)) is not None:
                self.series[name].add(v)
        for key, name in (("train/zero_variance_groups", "zero_var"), ("train/majority_answer_share", "majority")):
            if (v := _num(r, key)) is not None:
                self.windows[name].append(v)
        # The first step also waited for the workers to start; a step without an update (every group
        # had zero advantage) says nothing about who waits for whom.
        if self.train_steps > 1 and _num(r, "learner/updates") != 0.0 and (
                v := _num(r, "time/learner_busy_frac")) is not None:
            self.windows["busy"].append(v)
        idle_ms, wall, alive = (_num(r, "controller/workers/told_to_wait_ms"), _num(r, "time/wall_s"),
                                _num(r, "workers/alive"))
        if idle_ms is not None and wall is not None and alive:
            self.idle.append((idle_ms / 1000.0, wall, alive))
        reward = self.series["reward"]
        solved = bool(reward.recent) and reward.mean() >= c.solved_reward
        if not solved:
            out += self._collapse(step, stalled=reward.ready() and reward.mean() < reward.early_mean() + c.learning_gain)
        out += self._reward_trend(step)
        out += self._throughput(step)
        return out

    def _nonfinite(self, step: int, r: Mapping[str, Any]) -> Alarm | None:
        nulls = sorted(k for k, v in r.items() if v is None or (isinstance(v, float) and not math.isfinite(v)))
        counts = {k: v for k in NONFINITE_COUNTS if (v := _num(r, k))}
        if not nulls and not counts:
            return None
        parts = [f"{k}={v:g}" for k, v in counts.items()] + ([f"null {', '.join(nulls[:3])}"] if nulls else [])
        return Alarm(step, "nonfinite", float(len(nulls) + sum(counts.values())), 0.0,
                     f"non-finite values at step {step}: {'; '.join(parts)}")

    def _collapse(self, step: int, *, stalled: bool) -> list[Alarm]:
        """Length, entropy and zero variance when the reward has ``stalled`` (not ``health.learning_gain``
        above its early mean); one answer taking over either way."""
        c, out = self.cfg, []
        for name, alarm, ratio, what in (("len", "length_collapse", c.length_ratio, "mean response length"),
                                          ("entropy", "entropy_collapse", c.entropy_ratio, "token entropy")):
            s = self.series[name]
            if stalled and s.ready() and s.early_mean() > 0 and s.mean() < ratio * s.early_mean():
                key = ALARMS[alarm].threshold_key
                out.append(Alarm(step, alarm, s.mean() / s.early_mean(), ratio,
                                 f"{what} {s.mean():.3g} over the last {len(s.recent)} steps is "
                                 f"{s.mean() / s.early_mean():.2f}x its early {s.early_mean():.3g} "
                                 f"(< {key}={ratio:g})"))
        for name, alarm, judged, limit, what, key in (
                ("zero_var", "zero_variance", stalled, c.zero_variance_share, "of groups had zero reward variance",
                 "zero_variance_share"),
                ("majority", "answer_takeover", True, c.majority_share, "of each batch was its most common response",
                 "majority_share")):
            w = self.windows[name]
            if judged and len(w) == w.maxlen and (m := sum(w) / len(w)) > limit:
                reward = self.series["reward"]
                r = f", train reward {reward.mean():.3f}" if reward.recent else ""
                out.append(Alarm(step, alarm, m, limit, f"{m:.0%} {what} over the last {len(w)} steps "
                                                        f"(> health.{key}={limit:g}{r})"))
        return out

    def _reward_trend(self, step: int) -> list[Alarm]:
        """reward_flat from the train reward, for runs without a step-0 evaluation."""
        c, s = self.cfg, self.series["reward"]
        if self.baseline is not None or step < c.flat_after_steps or not s.ready():
            return []
        gain = s.mean() - s.early_mean()
        if gain >= c.flat_min_gain or s.early_mean() >= c.solved_reward:
            return []
        return [Alarm(step, "reward_flat", gain, c.flat_min_gain,
                      f"train reward {s.mean():.3f} over the last {len(s.recent)} steps vs {s.early_mean():.3f} "
                      f"early (gain {gain:+.3f} < health.flat_min_gain={c.flat_min_gain:g})")]

    def _throughput(self, step: int) -> list[Alarm]:
        c, out = self.cfg, list[Alarm]()
        busy = self.windows["busy"]
        if len(busy) < self.cfg.window:
            return out
        m = sum(busy) / len(busy)
        if m < c.learner_busy_min:
            out.append(Alarm(step, "rollout_bound", m, c.learner_busy_min,
                             f"the learner trained {m:.0%} of its time over the last {len(busy)} steps and "
                             f"waited for batches the rest (< health.learner_busy_min={c.learner_busy_min:g})"))
        if m >= c.learner_busy_max and len(self.idle) == self.idle.maxlen:
            (i0, t0, _), (i1, t1, _) = self.idle[0], self.idle[-1]
            workers = sum(a for _, _, a in self.idle) / len(self.idle)
            if t1 > t0:
                share = min(1.0, (i1 - i0) / ((t1 - t0) * workers))
                if share > c.workers_idle_max:
                    out.append(Alarm(step, "learner_bound", share, c.workers_idle_max,
                                     f"the learner trained {m:.0%} of its time and the workers were told to "
                                     f"wait for work {share:.0%} of theirs over the last {len(busy)} steps "
                                     f"(> health.workers_idle_max={c.workers_idle_max:g})"))
        return out


def replay(records: Sequence[Mapping[str, Any]], cfg: HealthConfig) -> list[Alarm]:
    """Every alarm a run with these ``metrics.jsonl`` records raises, in order (records in file order)."""
    monitor = HealthMonitor(cfg)
    return [a for r in records for a in monitor.observe(int(r["step"]), r)]


def health_config(section: Mapping[str, Any] | HealthConfig | None) -> HealthConfig:
    """A ``HealthConfig`` from a run config's ``health`` section (a dict from ``config.json``); defaults
    for keys it lacks (a run from before the section existed)."""
    if isinstance(section, HealthConfig):
        return section
    known = {f.name for f in dataclasses.fields(HealthConfig)}
    return HealthConfig(**{k: v for k, v in (section or {}).items() if k in known})


def _num(record: Mapping[str, Any], key: str) -> float | None:
    v = record.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _finite_or_none(v: float) -> float | None:
    return v if math.isfinite(v) else None
