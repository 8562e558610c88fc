"""What the scale simulator takes and gives: ``Params`` (one job's shape and stage costs), ``Result``, and
the steady-window figures a real run is measured by.

Owns: the parameter checks (a bad ``Params`` raises ``ValueError`` naming the fix), the warm-up rule
shared with the calibration (``warmup_steps``: the first tenth of the steps, at least 2), and
``ShowTable``, the callback through which the table-building functions hand a table to their caller,
and ``fmt_hist``, a staleness histogram as every table prints it.
Never: simulates anything (``asyncrl/sim/model.py`` does), reads run folders, or imports outside the
standard library.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Params", "Result", "ShowTable", "fmt_hist", "warmup_steps", "window_rate", "window_staleness"]

ShowTable = Callable[[str, list[dict[str, Any]], list[str]], None]
"""``show(title, rows, columns)``: print (or otherwise present) one table; ``asyncrl.bench.report.print_table``."""


def warmup_steps(n_versions: int) -> int:
    """Versions a run's steady window leaves out as warm-up: a tenth of them, at least 2."""
    return max(2, n_versions // 10)


@dataclass
class Params:
    """Everything the model needs; times in seconds. ``asyncrl.sim.calibrate`` fills it from a run folder,
    ``asyncrl.sim.cluster`` from a cluster shape."""

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
    staleness: Counter[int] = field(default_factory=Counter)
    """Consumed samples per staleness (learner version at consumption - behaviour version)."""
    batch_staleness: list[Counter[int]] = field(default_factory=list)
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


def window_rate(version_times: list[float], batch_samples: int, warmup: int | None = None) -> dict[str, float]:
    """Samples/s and step time over the steady window, the way ``scripts/bench_async.py`` measures a real
    run: the first ``warmup_steps`` versions are warm-up; the window runs from version ``warmup`` to the
    last."""
    steps = len(version_times)
    skip = warmup_steps(steps) if warmup is None else warmup
    win = version_times[skip - 1:]
    n = len(win) - 1
    if n < 1:
        raise ValueError(f"only {steps} versions: simulate or run more steps than the {skip} of warm-up")
    wall = win[-1] - win[0]
    return {"samples_per_s": n * batch_samples / wall, "step_s": wall / n, "steps_timed": float(n),
            "first_step": float(skip)}


def window_staleness(r: Result) -> Counter[int]:
    """Staleness of the batches a run's window counts (learner steps >= the warm-up, as
    ``asyncrl.sim.calibrate.measure`` counts a real run's)."""
    skip = warmup_steps(len(r.version_times))
    out: Counter[int] = Counter()
    for c in r.batch_staleness[skip:]:
        out.update(c)
    return out


def fmt_hist(h: dict[int, int]) -> str:
    """A staleness histogram as fractions: ``"0:0.75 1:0.25"``."""
    n = sum(h.values()) or 1
    return " ".join(f"{k}:{v / n:.2f}" for k, v in sorted(h.items()))
