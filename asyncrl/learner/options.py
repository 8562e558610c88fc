"""The learner's options that the run schema does not hold: ``LRSchedule`` (the learning-rate multiplier)
and what ``learner.autocast=auto`` becomes on a device (``resolve_autocast``). The training-step options
(``StepConfig``) are the run schema's (``asyncrl.config.schema``), handed to ``train_step`` as they are.

Never: imports torch, or holds state. What ``auto`` becomes is read from the device (asyncrl/machine.py for the
CPU's flags).
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.constants import LR_SCHEDULES
from asyncrl.machine import BF16_FLAGS, bf16_native

__all__ = ["LRSchedule", "resolve_autocast"]


def resolve_autocast(autocast: str, device_type: str, cpu_flags: frozenset[str] | None = None) -> tuple[str, str]:
    """(the autocast a learner on ``device_type`` runs for the setting ``autocast``, why): ``auto`` is bf16 on
    CUDA and on a CPU with bf16 matmul instructions (``cpu_flags``, default this CPU's: asyncrl/machine.py),
    fp32 ("") on any other CPU, where a bf16 GEMM at the learner's shapes takes 35-38x the fp32 one
    (docs/benchmarks.md §15)."""
    if autocast != "auto":
        return autocast, "as set"
    if device_type == "cuda":
        return "bf16", "a CUDA device"
    if bf16_native(cpu_flags):
        return "bf16", f"this CPU has bf16 matmul instructions ({' or '.join(BF16_FLAGS)})"
    return "", f"this CPU has none of {', '.join(BF16_FLAGS)}, where bf16 autocast is many times slower than fp32"


@dataclass(frozen=True, kw_only=True, slots=True)
class LRSchedule:
    """Learning-rate multiplier schedule, in training steps.

    kind: "constant" (after warm-up), "cosine" or "linear" decay from 1 to ``min_lr_ratio``
      between the end of warm-up and ``total_steps``, then flat at the floor.
    warmup_steps: linear ramp (step + 1) / warmup_steps over the first steps; 0 disables it.
    total_steps: where decay ends; required for "cosine" and "linear".
    min_lr_ratio: the floor, as a fraction of the peak learning rate, in [0, 1].
    """

    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in LR_SCHEDULES:
            raise ValueError(f"unknown LR schedule kind {self.kind!r}; use one of {', '.join(LR_SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.kind != "constant":
            if self.total_steps is None or self.total_steps <= self.warmup_steps:
                raise ValueError(
                    f"LR schedule {self.kind!r} needs total_steps > warmup_steps (got total_steps="
                    f"{self.total_steps}, warmup_steps={self.warmup_steps}); set total_steps to the run length"
                )
