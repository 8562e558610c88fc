"""The allowed range of every numeric configuration key, as one table, and the check that applies it.

Owns: ``RANGES`` (dotted key -> interval and what the value means) and ``check_ranges``, which refuses a
non-finite value (nan, inf) or one outside its interval with a ``ValueError`` naming the key, the bad
value and the allowed range, before any process starts (``asyncrl.config.schema.validate`` calls it).
Also the run name's rule (``check_run_name``): it becomes a folder name under ``runs_dir``.
Never: imports torch or any heavy module; holds a cross-field rule (those stay in ``validate``).

Also ``WORKER_RANGES``, the same for the numeric settings of ``asyncrl worker``.

Invariant: every int/float key of ``TrainConfig`` outside ``algo.*`` has exactly one entry in ``RANGES``
(tests/unit/config/test_ranges.py checks it); ``algo.*`` keys validate themselves in
``asyncrl.config.algo`` when the section is built. Intervals are written ``[lo, hi]`` / ``(lo, hi)``
with ``inf`` for no upper bound; a value must also be finite whatever its interval.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class Interval:
    """``lo``..``hi`` with open or closed ends (``(0, inf)``, ``[0, 1]``, ...); ``hi`` may be inf."""

    lo: float
    hi: float
    lo_open: bool
    hi_open: bool

    @classmethod
    def parse(cls, text: str) -> Interval:
        head, tail = text[0], text[-1]
        if head not in "[(" or tail not in "])":
            raise ValueError(f"interval {text!r} must look like [lo, hi] or (lo, hi)")
        lo, hi = (float(part) for part in text[1:-1].split(","))
        return cls(lo, hi, head == "(", tail == ")")

    def __contains__(self, value: float) -> bool:
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below

    def describe(self) -> str:
        """``>= 0``, ``> 0``, ``in [0, 1]``, ``in [1, 4096]`` (what an error message says)."""
        lo = _number(self.lo)
        if math.isinf(self.hi):
            return f"{'>' if self.lo_open else '>='} {lo}" if math.isfinite(self.lo) else "any finite number"
        return f"in {'(' if self.lo_open else '['}{lo}, {_number(self.hi)}{')' if self.hi_open else ']'}"


def _number(x: float) -> str:
    return str(int(x)) if math.isfinite(x) and x == int(x) else repr(x)


# key: (interval, what it means / the usual value). Seeds: [0, 2**32 - 1], what every consumer takes
# (numpy's legacy generator is the narrowest). One row per numeric key; keep the schema's order.
RANGES: dict[str, tuple[str, str]] = {
    "seed": ("[0, 4294967295]", "a seed"),
    "model.warmstart_steps": ("[0, inf)", "0 disables the warm start"),
    "model.warmstart_lr": ("(0, 1]", "e.g. 3e-4"),
    "task.eval_size": ("[1, inf)", "problems in the held-out evaluation set"),
    "task.seed": ("[0, 4294967295]", "a seed"),
    "task.size": ("[1, inf)", "training problems generated"),
    "task.max_prompt_tokens": ("[0, inf)", "0: the model's context - 1"),
    "quant.uaq_scale": ("(0, inf)", "the factor folded into the RMSNorm gains, e.g. 1.5"),
    "quant.aqn_sigma_start": ("[0, inf)", "a noise standard deviation, e.g. 1e-2"),
    "quant.aqn_sigma_end": ("[0, inf)", "a noise standard deviation, e.g. 5e-4"),
    "quant.aqn_stages": ("[1, inf)", "steps of the noise schedule, e.g. 10"),
    "rollout.eta": ("[0, inf)", "0 = synchronous training"),
    "rollout.num_workers": ("[0, inf)", "workers the launcher starts"),
    "rollout.groups_per_step": ("[1, 4096]", "prompt groups per learner step; the batch is this x group_size"),
    "rollout.temperature": ("(0, inf)", "training rollouts sample; 1.0 is the policy itself"),
    "rollout.max_new_tokens": ("[1, inf)", "response length limit in tokens"),
    "rollout.worker_slots": ("[1, inf)", "concurrent samples per worker"),
    "rollout.heartbeat_s": ("(0, inf)", "seconds between worker heartbeats"),
    "rollout.dead_after_s": ("(0, inf)", "seconds of silence before a worker is declared dead"),
    "rollout.assignment_timeout_s": ("(0, inf)", "seconds before an unfinished group is reissued"),
    "rollout.quarantine_after": ("[0, inf)", "invalid samples in a row before a worker is quarantined; 0 = never"),
    "rollout.seed": ("[0, 4294967295]", "a seed"),
    "learner.n_minibatches": ("[1, inf)", "optimiser updates per step"),
    "learner.micro_batch_size": ("[1, inf)", "sequences per forward/backward"),
    "learner.max_tokens_per_micro_batch": ("[0, inf)", "0 = by micro_batch_size"),
    "learner.grad_clip": ("(-inf, inf)", "<= 0 disables clipping"),
    "learner.chunk_tokens": ("[1, inf)", "positions per log-softmax chunk"),
    "learner.world_size": ("[1, inf)", "FSDP2 ranks"),
    "learner.total_steps": ("[1, inf)", "learner steps to train"),
    "learner.lr": ("(0, 1]", "a learning rate, e.g. 1e-4"),
    "learner.warmup_steps": ("[0, inf)", "0 disables warm-up"),
    "learner.min_lr_ratio": ("[0, 1]", "the schedule's floor as a fraction of learner.lr"),
    "learner.weight_decay": ("[0, inf)", "0 disables it"),
    "learner.ckpt_every": ("[0, inf)", "0: only at the end"),
    "learner.eval_every": ("[0, inf)", "0: only at the end"),
    "learner.time_budget_s": ("[0, inf)", "0 = no time limit"),
    "learner.seed": ("[0, 4294967295]", "a seed"),
    "learner.num_threads": ("[0, inf)", "0 = automatic"),
    "learner.mismatch_every": ("[0, inf)", "0 = never"),
    "learner.mismatch_rows": ("[1, inf)", "sequences of the step batch it is measured on"),
    "learner.lora.rank": ("[0, inf)", "0 = full fine-tuning"),
    "learner.lora.alpha": ("(0, inf)", "the adapter scaling is alpha / rank, e.g. 32"),
    "learner.lora.dropout": ("[0, 1)", "a dropout probability"),
    "sglang.max_total_tokens": ("[0, inf)", "0: SGLang's default"),
    "sglang.startup_timeout_s": ("(0, inf)", "seconds to wait for a started server"),
    "transport.port": ("[0, 65535]", "a TCP port; 0 = any free port"),
    "transport.full_every": ("[1, 1000000]", "every N-th version is sent whole (1: every version)"),
    "transport.bucket_mb": ("[0, 65536]", "MiB per bucket of weights sent to a worker (0: one piece)"),
    "log.fsync_every": ("[1, inf)", "records between fsyncs"),
    "log.rotate_mb": ("[1, inf)", "segment size in MiB"),
    "health.window": ("[1, inf)", "training steps each windowed alarm averages over"),
    "health.early_steps": ("[1, inf)", "first steps whose mean is the early value"),
    "health.repeat_every": ("[1, inf)", "steps between repeats of a standing alarm"),
    "health.solved_reward": ("[0, 1]", "a train reward fraction"),
    "health.learning_gain": ("(-inf, inf)", "a reward difference, e.g. 0.05"),
    "health.length_ratio": ("[0, 1]", "a fraction of the early mean response length"),
    "health.entropy_ratio": ("[0, 1]", "a fraction of the early mean entropy"),
    "health.zero_variance_share": ("[0, 1]", "a share of groups"),
    "health.flat_after_steps": ("[0, inf)", "the step from which reward_flat is judged"),
    "health.flat_min_gain": ("(-inf, inf)", "a reward difference, e.g. 0.02"),
    "health.majority_share": ("[0, 1]", "a share of the batch"),
    "health.learner_busy_min": ("[0, 1]", "a share of the learner's step time"),
    "health.learner_busy_max": ("[0, 1]", "a share of the learner's step time"),
    "health.workers_idle_max": ("[0, 1]", "a share of the workers' time"),
}

WORKER_RANGES: dict[str, tuple[str, str]] = {
    "rollout.worker_slots": ("[0, inf)", "concurrent samples; 0 = the run's rollout.worker_slots"),
    "drain_s": ("[0, inf)", "seconds in-flight samples may finish when the worker stops"),
    "no_learner_s": ("(0, inf)", "seconds to wait for a learner (default 120)"),
    "sglang.max_total_tokens": RANGES["sglang.max_total_tokens"],
    "sglang.startup_timeout_s": RANGES["sglang.startup_timeout_s"],
}
"""The numeric keys of ``asyncrl worker`` (``asyncrl.config.roles.WorkerRoleConfig``); a key it shares with
the run (``sglang.*``) has the run's interval."""

INTERVALS: dict[str, Interval] = {key: Interval.parse(text) for key, (text, _) in (RANGES | WORKER_RANGES).items()}


def lookup(cfg: Any, key: str) -> Any:
    """The value of the dotted ``key`` in a config dataclass tree."""
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def check_value(key: str, value: Any, table: dict[str, tuple[str, str]] = RANGES) -> None:
    """``ValueError`` naming ``key``, ``value`` and the allowed range when ``value`` is not a finite number in
    it (``table``: ``RANGES``, or ``WORKER_RANGES`` for a worker's settings)."""
    interval = INTERVALS[key]
    meaning = table[key][1]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key}={value!r} is not a number; allowed: {interval.describe()} ({meaning})")
    if not math.isfinite(value):
        raise ValueError(f"{key}={value!r} is not a finite number; allowed: {interval.describe()} ({meaning})")
    if value not in interval:
        raise ValueError(f"{key}={value!r} must be {interval.describe()} ({meaning})")


def check_ranges(cfg: Any, table: dict[str, tuple[str, str]] = RANGES) -> None:
    """Every key of ``table`` in ``cfg`` (a ``TrainConfig`` for ``RANGES``, a ``WorkerRoleConfig`` for
    ``WORKER_RANGES``) is finite and in its interval."""
    for key in table:
        check_value(key, lookup(cfg, key), table)


def check_run_name(name: str) -> None:
    """A run name is one folder name: not empty, no path separator, not ``.`` or ``..``."""
    if not name or not name.strip():
        raise ValueError("run_name is empty; give the run a folder name, e.g. run_name=demo")
    if "/" in name or "\\" in name or "\0" in name or name == "." or ".." in name:
        raise ValueError(f"run_name={name!r} must be one folder name (no '/', '\\' or '..'); the folder is "
                         "runs_dir/run_name (choose the parent with runs_dir=DIR)")
