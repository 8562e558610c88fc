"""The generic clipped surrogate psi of docs/algorithms.md §4 and its clip indicators.

Owns psi(R, A; lo, hi, c) written in log space, and the TBPO band function phi (§6.7).
Never: applies importance weights or masks, aggregates, or computes metrics beyond the per-token
indicators it returns.

Invariants:
* Inputs are log-ratios that are already where-masked (finite everywhere); the ratio is formed
  as exp(clamp(log R, -20, max_log)) and the clipped ratio as exp(clip_log(...)), so lo > hi
  resolves to hi exactly as PyTorch ``clamp`` does (§4).
* Dual clip applies to A < 0 only and before any weight (verl / AReaL order).
* Indicators are evaluated on the unclamped log-ratio (§2.3) and carry no gradient.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from asyncrl.algo.numerics import LOG_RATIO_BOUND, clamp_log, clip_log

__all__ = ["SurrogateOut", "clipped_surrogate", "tbpo_surrogate"]


class SurrogateOut(NamedTuple):
    """Per-token results, all [B, T]. ``loss`` carries gradient; the indicators are bool."""

    loss: torch.Tensor
    clip_hi: torch.Tensor
    clip_lo: torch.Tensor
    clip_dual: torch.Tensor


def clipped_surrogate(
    log_ratio: torch.Tensor,
    adv: torch.Tensor,
    log_lo: float | torch.Tensor,
    log_hi: float | torch.Tensor,
    dual_clip: float | None,
    *,
    max_log: float = LOG_RATIO_BOUND,
) -> SurrogateOut:
    """psi(R, A; lo, hi, c) of §4 per token, with R = exp(log_ratio).

    log_ratio: [B, T] (grad), adv: [B, T] (no grad), log_lo / log_hi: scalars or [B, T] (ACR).
    A >= 0: max(-A R, -A clip(R, lo, hi));  A < 0: min(max(-A R, -A clip(R, lo, hi)), -A c).
    """
    lr = clamp_log(log_ratio, max_log)
    ratio = torch.exp(lr)
    clipped = torch.exp(clip_log(lr, log_lo, log_hi))
    pre = torch.maximum(-adv * ratio, -adv * clipped)
    neg = adv < 0
    if dual_clip is not None:
        cap = -adv * dual_clip
        loss = torch.where(neg, torch.minimum(pre, cap), pre)
    else:
        loss = pre
    with torch.no_grad():
        x = log_ratio.detach()
        c = clip_log(x, log_lo, log_hi)
        clip_hi = (adv > 0) & (c < x)
        clip_lo = neg & (c > x)
        clip_dual = (
            neg & (pre.detach() > -adv * dual_clip) if dual_clip is not None else torch.zeros_like(neg)
        )
    return SurrogateOut(loss, clip_hi, clip_lo, clip_dual)


def tbpo_surrogate(
    log_rho: torch.Tensor,
    adv: torch.Tensor,
    eps_pos_high: float,
    eps_neg_low: float,
    eps_neg_high: float,
) -> SurrogateOut:
    """-A phi(rho, A) of §6.7 per token (before kappa and w).

    A >= 0: -A min(rho, 1 + eps_pos_high); A < 0: -A clip(rho, 1 - eps_neg_low, 1 + eps_neg_high).
    ``clip_hi`` marks A > 0 with rho above the cap; ``clip_lo`` marks A < 0 with rho outside the band.
    ``clip_dual`` is always False (TBPO has no dual clip).
    """
    lr = clamp_log(log_rho)
    log_pos_hi = math.log1p(eps_pos_high)
    log_neg_lo, log_neg_hi = math.log1p(-eps_neg_low), math.log1p(eps_neg_high)
    neg = adv < 0
    phi_pos = torch.exp(lr.clamp(max=log_pos_hi))
    phi_neg = torch.exp(clip_log(lr, log_neg_lo, log_neg_hi))
    loss = -adv * torch.where(neg, phi_neg, phi_pos)
    with torch.no_grad():
        x = log_rho.detach()
        clip_hi = (adv > 0) & (x > log_pos_hi)
        clip_lo = neg & ((x < log_neg_lo) | (x > log_neg_hi))
    return SurrogateOut(loss, clip_hi, clip_lo, torch.zeros_like(neg))
