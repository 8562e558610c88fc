"""Behaviour correction: importance weights, rejection masks and adaptive bounds (§6.2-§6.4, §6.7).

Owns everything built only from the prox/behaviour log-ratio mu = l_prox - l_behav: the TIS
weights (token and sequence, §6.3), the AReaL behaviour-cap mask (§6.2), the verl rejection masks
(``token_k*``, ``seq_sum_k*``, ``seq_mean_k*``, ``seq_max_k*``, §6.3), the ACR upper bound (§6.4)
and the TBPO mismatch band (§6.7).

Never: touches the current log-probs or anything with gradient; aggregates losses.

Invariants: inputs ``mu`` are already where-masked (0 outside ``mask``); every output is detached
and finite; comparisons with thresholds happen in log space on the *unclamped* mu (§2.3), while
weights use mu clamped to [-20, 20] before ``exp``.
"""

from __future__ import annotations

import math

import torch

from asyncrl.algo.numerics import LOG_RATIO_BOUND, clamp_log, seq_any, seq_mean, seq_sum
from asyncrl.config.algo import parse_rs_threshold

__all__ = [
    "mismatch_log_ratio",
    "is_weights",
    "behav_cap_keep",
    "rejection_keep",
    "acr_log_hi",
    "tbpo_keep",
]


def mismatch_log_ratio(prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """mu = l_prox - l_behav on masked tokens, 0 elsewhere. [B, T] -> [B, T], detached."""
    with torch.no_grad():
        return torch.where(mask, prox_logp.detach() - behav_logp.detach(), 0)


def is_weights(mu: torch.Tensor, mask: torch.Tensor, cap: float | None, level: str) -> torch.Tensor:
    """Truncated importance weights omega of TIS (§6.3), 0 outside ``mask``. [B, T] -> [B, T].

    token: omega_t = exp(min(mu_t, log C)); sequence: omega_i = exp(min(clamp(sum_t mu, +-20), log C))
    broadcast to the response's tokens (verl ``rollout_is=sequence``). ``cap=None``: no truncation.
    """
    with torch.no_grad():
        log_cap = math.log(cap) if cap is not None else LOG_RATIO_BOUND
        if level == "token":
            logw = clamp_log(mu).clamp(max=log_cap)
        elif level == "sequence":
            logw = clamp_log(seq_sum(mu, mask)).clamp(max=log_cap).unsqueeze(-1).expand_as(mu)
        else:
            raise ValueError(f"is level must be 'token' or 'sequence', got {level!r}")
        return torch.where(mask, torch.exp(logw), 0)


def behav_cap_keep(mu: torch.Tensor, mask: torch.Tensor, behav_cap: float | None) -> torch.Tensor:
    """AReaL decoupled mask (§6.2): keep tokens with r <= u_cap, i.e. mu <= log u_cap. [B, T] bool."""
    if behav_cap is None:
        return mask.clone()
    return mask & (mu <= math.log(behav_cap))


def _k_stat(mu: torch.Tensor, k: str) -> torch.Tensor:
    x = clamp_log(mu)
    if k == "k1":
        return -x
    if k == "k2":
        return 0.5 * x * x
    return torch.exp(x) - 1 - x  # k3


def rejection_keep(
    mu: torch.Tensor, mask: torch.Tensor, modes: tuple[str, ...], thresholds: tuple[str, ...]
) -> torch.Tensor:
    """verl rejection masks (§6.3); a token is kept iff every mask passes. [B, T] -> [B, T] bool.

    Statistic per token with x = clamp(mu, +-20): k1 = -x, k2 = x^2/2, k3 = e^x - 1 - x; per
    response: masked sum (``seq_sum``), masked mean (``seq_mean``) or max (``seq_max``). ``*_k1``
    keeps iff log lo <= stat <= log hi; the others keep iff stat <= hi. A rejected response loses
    all its tokens. A response with no masked token is never rejected (it has no token to lose).
    """
    keep = mask.clone()
    for mode, threshold in zip(modes, thresholds, strict=True):
        lo, hi = parse_rs_threshold(mode, threshold)
        level, k = mode.rsplit("_", 1)
        stat = _k_stat(mu, k)
        if level == "token":
            pass
        elif level == "seq_sum":
            stat = seq_sum(stat, mask).unsqueeze(-1)
        elif level == "seq_mean":
            stat = seq_mean(stat, mask).unsqueeze(-1)
        elif level == "seq_max":
            masked = torch.where(mask, stat, -math.inf)
            smax = (
                masked.amax(-1)
                if masked.shape[-1]
                else torch.zeros(masked.shape[:-1], dtype=mu.dtype, device=mu.device)
            )
            stat = torch.where(seq_any(mask), smax, 0).unsqueeze(-1)
        else:  # pragma: no cover - the config validates modes
            raise AssertionError(mode)
        ok = stat <= hi if lo is None else (stat >= lo) & (stat <= hi)
        keep = keep & ok
    return keep


def acr_log_hi(mu: torch.Tensor, eps_high: float) -> torch.Tensor:
    """log of the ACR upper clip bound (1 + eps_high) / r with the untruncated r (§6.4). [B, T]."""
    return math.log1p(eps_high) - clamp_log(mu)


def tbpo_keep(mu: torch.Tensor, mask: torch.Tensor, w_low: float, w_high: float) -> torch.Tensor:
    """TBPO kappa_i (§6.7): log w_lo <= mean_t mu <= log w_hi and L_i > 0. [B, T] -> [B] bool."""
    mbar = seq_mean(mu, mask)
    return seq_any(mask) & (mbar >= math.log(w_low)) & (mbar <= math.log(w_high))
