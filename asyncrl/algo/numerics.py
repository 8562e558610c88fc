"""Numerical guards shared by every objective (docs/algorithms.md §2).

Owns: the constants of §2/§11 (log-ratio bound 20, GSPO bound 10, advantage epsilon), guarded
exponentiation, log-space clipping with PyTorch ``clamp`` semantics, and masked per-sequence
reductions. Never: reads configs, computes losses or metrics.

Invariants: every function is elementwise or a masked reduction; masking is done with
``torch.where`` *before* any arithmetic that could meet an inf (never ``x * mask``).
"""

from __future__ import annotations

import torch

from asyncrl.config.algo import ADV_EPS

__all__ = [
    "LOG_RATIO_BOUND",
    "GSPO_LOG_RATIO_MAX",
    "ADV_EPS",
    "clamp_log",
    "guarded_exp",
    "clip_log",
    "seq_sum",
    "seq_len",
    "seq_mean",
    "seq_any",
]

LOG_RATIO_BOUND = 20.0
"""Every log-ratio is clamped to [-20, 20] before ``exp`` (verl ``SAFETY_BOUND``)."""
GSPO_LOG_RATIO_MAX = 10.0
"""The GSPO sequence log-ratio is additionally clamped at +10 (verl ``compute_policy_loss_gspo``)."""


def clamp_log(x: torch.Tensor, hi: float = LOG_RATIO_BOUND) -> torch.Tensor:
    """Clamp a log-ratio to [-20, hi]."""
    return x.clamp(-LOG_RATIO_BOUND, hi)


def guarded_exp(x: torch.Tensor, hi: float = LOG_RATIO_BOUND) -> torch.Tensor:
    """``exp(clamp(x, -20, hi))``: finite for any finite ``x``."""
    return torch.exp(clamp_log(x, hi))


def clip_log(x: torch.Tensor, log_lo: float | torch.Tensor, log_hi: float | torch.Tensor) -> torch.Tensor:
    """``min(max(x, log_lo), log_hi)``: PyTorch ``clamp`` semantics, so ``hi`` wins when lo > hi.

    Applied to log-ratios, ``exp(clip_log(log R, log lo, log hi)) == clip(R, lo, hi)`` of §4.
    """
    x = torch.maximum(x, torch.as_tensor(log_lo, dtype=x.dtype, device=x.device))
    return torch.minimum(x, torch.as_tensor(log_hi, dtype=x.dtype, device=x.device))


def seq_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T], [B, T] bool -> [B]: sum over the masked tokens of each response."""
    return torch.where(mask, x, 0).sum(-1)


def seq_len(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool -> [B] int64: number of masked tokens of each response (L_i)."""
    return mask.sum(-1)


def seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B]: masked mean with denominator max(L_i, 1), so empty responses give 0 (§2.6)."""
    return seq_sum(x, mask) / seq_len(mask).clamp(min=1).to(x.dtype)


def seq_any(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool -> [B] bool: the response has at least one masked token."""
    return mask.any(-1)
