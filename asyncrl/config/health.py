"""The ``health`` section of the run configuration: ``HealthConfig`` (every alarm threshold), the alarm
names ``learner.stop_on`` may list, and ``check_health``, their cross-field check.

Owns: the section's keys, defaults and docstrings (``asyncrl.config.schema`` puts it at
``TrainConfig.health``), and ``ALARM_NAMES``, the names of the alarms ``asyncrl.metrics.health`` raises.
Never: imports anything beyond the standard library (the monitor in ``asyncrl.metrics.health`` imports
this module, so an import back would be a cycle); watches metrics or raises alarms (the monitor does).

Invariants: ``ALARM_NAMES`` lists exactly the keys of ``asyncrl.metrics.health.ALARMS``, in their
order (tests/unit/metrics/test_health.py checks it); the thresholds' ranges are checked with every
other numeric key in ``asyncrl.config.ranges``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ALARM_NAMES", "HealthConfig", "check_health"]

ALARM_NAMES = ("length_collapse", "entropy_collapse", "zero_variance", "reward_flat", "answer_takeover",
               "nonfinite", "rollout_bound", "learner_bound", "worker_quarantined")
"""Every training-health alarm, by name (docs/operations.md, "Training health")."""


@dataclass(kw_only=True)
class HealthConfig:
    """The ``health`` section: training-health alarms (docs/operations.md, "Training health")."""

    enabled: bool = True
    """Watch the run's metrics and raise alarms (console line + ``health.jsonl``)."""
    window: int = 10
    """Training steps each windowed alarm averages over."""
    early_steps: int = 5
    """The first training steps whose mean is the "early value" of length and entropy."""
    repeat_every: int = 50
    """An alarm that keeps holding is raised again at most every this many steps."""
    solved_reward: float = 0.9
    """Collapse alarms stay quiet while the windowed train reward is at least this (a solved task)."""
    learning_gain: float = 0.05
    """length_collapse, entropy_collapse and zero_variance stay quiet while the windowed train reward is at
    least this above its early mean (the run learns: shorter answers or a hard start are not a collapse)."""
    length_ratio: float = 0.5
    """length_collapse: windowed mean response length below this fraction of the early mean."""
    entropy_ratio: float = 0.3
    """entropy_collapse: windowed mean token entropy below this fraction of the early mean."""
    zero_variance_share: float = 0.75
    """zero_variance: windowed share of groups whose rewards are all equal above this."""
    flat_after_steps: int = 50
    """reward_flat: judged from this step on."""
    flat_min_gain: float = 0.02
    """reward_flat: an evaluation less than this above the step-0 evaluation (without evaluations: the
    windowed train reward against its early mean) is flat."""
    majority_share: float = 0.6
    """answer_takeover: windowed share of the batch that is its most common response above this."""
    nonfinite: bool = True
    """nonfinite: raise on any step that skipped non-finite updates or logged a null metric."""
    learner_busy_min: float = 0.2
    """rollout_bound: windowed share of the learner's step time spent training below this."""
    learner_busy_max: float = 0.95
    """learner_bound: windowed share of the learner's step time spent training at least this ..."""
    workers_idle_max: float = 0.9
    """... and the windowed share of the workers' time they were told to wait for work (NoWork back-offs
    per worker and second, an upper bound: a worker also asks again when new weights arrive) above this."""


def check_health(h: HealthConfig, stop_on: Sequence[str]) -> None:
    """ValueError naming the fix for an unknown ``stop_on`` name or ``stop_on`` with the alarms off.

    The thresholds' ranges are checked with every other numeric key (``asyncrl.config.ranges``)."""
    unknown = [n for n in stop_on if n not in ALARM_NAMES]
    if unknown:
        raise ValueError(f"learner.stop_on names unknown alarm(s) {unknown}; choose from {', '.join(ALARM_NAMES)}")
    if stop_on and not h.enabled:
        raise ValueError(f"learner.stop_on={list(stop_on)} needs the alarms on; drop health.enabled=false")
