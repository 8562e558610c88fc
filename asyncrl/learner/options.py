"""The learner's options as plain dataclasses: ``StepConfig`` (how one training step is cut up,
computed and clipped) and ``LRSchedule`` (the learning-rate multiplier), with their value lists.

Owns: every training-step option, its default and its validation (messages name the fix). The run
schema (``asyncrl.config.schema.LearnerConfig``) extends ``StepConfig`` as is, so every field here is
a ``learner.<field>=...`` key of ``asyncrl train`` and the learner process hands ``cfg.learner`` to
``train_step`` unchanged.
Never: imports torch (``asyncrl.config`` imports this module at launch), or holds state. What ``auto``
becomes is read from the device (``resolve_autocast``; asyncrl/machine.py for the CPU's flags).
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.machine import BF16_FLAGS, bf16_native

__all__ = ["AUTOCAST", "BASE_FORMATS", "LR_SCHEDULES", "LRSchedule", "StepConfig", "resolve_autocast"]

LR_SCHEDULES = ("constant", "linear", "cosine")
"""``LRSchedule.kind`` (``learner.lr_schedule``)."""
BASE_FORMATS = ("", "int8", "nvfp4", "mxfp4")
"""``learner.base_format``: the format a LoRA policy's frozen base is held in (packed.py); "" = fp32."""
AUTOCAST = ("", "bf16", "auto")
"""``StepConfig.autocast``: "" = fp32, ``bf16`` = bfloat16 autocast forwards, ``auto`` = bf16 where the device
computes it natively (`resolve_autocast`), else fp32."""


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
class StepConfig:
    """How one training step is cut up, computed and clipped (``asyncrl.learner.step.train_step``)."""

    n_minibatches: int = 1
    """Optimiser updates per step (the step batch is split into this many). Every ``configs/algo/``
    file sets 2: with one update the ratio to the proximal policy is 1 and the trust region never acts."""
    micro_batch_size: int = 64
    """At most this many sequences per forward/backward on one rank."""
    max_tokens_per_micro_batch: int = 0
    """> 0 also caps a micro-batch at this many padded positions (rows x longest row, ``plan.py``);
    0 cuts by ``micro_batch_size`` alone. Memory knobs only: the result does not depend on them beyond
    float summation order."""
    grad_clip: float = 1.0
    """Clip the global L2 gradient norm to this; <= 0 disables clipping (the norm is still logged)."""
    chunk_tokens: int = 256
    """Positions per fp32 log-softmax chunk of the LM head (a memory knob, ``logprobs.py``)."""
    log_entropy: bool = True
    """Log ``actor/entropy`` every step even without an entropy bonus (from the same LM-head chunks
    as the log-probs)."""
    reuse_prox: bool = True
    """First minibatch: proximal log-probs from its own training forward (before any update they are
    the same function of the same weights) instead of a separate no-grad pass; see ``train_step``."""
    skip_zero_advantage: bool = True
    """Responses with zero advantage at every loss token get no forward/backward (their gradient is
    exactly 0; they stay in the denominators); only when the objective has no KL or entropy term."""
    autocast: str = ""
    """``bf16``: forwards under bfloat16 autocast (weights, gradients and optimiser stay fp32; log-probs
    and the loss in fp32); empty = plain fp32; ``auto``: bf16 on CUDA and on a CPU with bf16 matmul
    instructions, else fp32 (`resolve_autocast`; the learner's start line says which and why)."""
    train_dropout: bool = False
    """The training forward runs in train mode (dropout on, e.g. LoRA dropout); the proximal and
    reference passes stay in eval mode, so ``reuse_prox`` must be off. A run sets it from
    ``learner.lora.dropout``."""

    def __post_init__(self) -> None:
        for name in ("n_minibatches", "micro_batch_size", "chunk_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if self.max_tokens_per_micro_batch < 0:
            raise ValueError(f"max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} must be >= 0 "
                             "(0 = by micro_batch_size)")
        if self.train_dropout and self.reuse_prox:
            raise ValueError("train_dropout needs reuse_prox=False: a dropout forward is not the proximal policy")
        if self.autocast not in AUTOCAST:
            raise ValueError(f"autocast={self.autocast!r}: use '' (fp32), bf16 or auto (bf16 where the device has it)")


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
