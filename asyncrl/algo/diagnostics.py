"""Mismatch diagnostics between the proximal and the behaviour policy (docs/algorithms.md §7).

Owns the "computed once per step" block of §7: KL estimators k1/k2/k3, chi-square (token and
sequence), log-perplexity difference, ratio extremes and 99th percentile, the same KL bucketed
by staleness, TIS truncation fractions and ESS, plus response-length statistics.

Never: needs gradients, the current policy, or a config object; logs or aggregates across calls
(the returned ``MetricDict`` is reducible, see ``stats.py``).

Invariants: statistics are over valid tokens whose prox and behaviour log-probs are both finite
(the others are counted in ``mismatch/nonfinite_tokens``); ratios are exponentiated only after
clamping to [-20, 20], while extremes and thresholds use the unclamped log value (§2.3).
"""

from __future__ import annotations

import math

import torch

from asyncrl.algo.config import LEVELS
from asyncrl.algo.numerics import clamp_log, seq_any, seq_mean, seq_sum
from asyncrl.algo.stats import MetricDict, StatsBuilder

__all__ = ["mismatch_metrics", "add_mismatch_stats", "response_stats"]


def add_mismatch_stats(
    b: StatsBuilder,
    mu: torch.Tensor,
    mask: torch.Tensor,
    *,
    is_cap: float | None,
    is_level: str,
    staleness: torch.Tensor | None,
) -> None:
    """Add the §7 mismatch block for mu = l_prox - l_behav ([B, T], finite, 0 outside ``mask``)."""
    mu = mu.detach()
    mu64 = mu.to(torch.float64)  # k1/k2 of the unclamped value; mu^2 of an fp32 value fits float64
    x = clamp_log(mu)
    k3 = torch.exp(x) - 1 - x
    b.mean("mismatch/kl_k1", -mu64, mask)
    b.mean("mismatch/kl_k2", 0.5 * mu64 * mu64, mask)
    b.mean("mismatch/kl_k3", k3, mask)
    b.mean("mismatch/chi2_token", torch.exp(2 * x) - 1, mask)
    has = seq_any(mask)
    sum_mu = seq_sum(mu, mask)
    b.mean("mismatch/chi2_seq", torch.exp(2 * clamp_log(sum_mu)) - 1, has)
    ppl = -seq_mean(mu, mask)  # mean_i(mean_t l_b - mean_t l_p)
    b.mean("mismatch/log_ppl_diff", ppl, has)
    b.mean("mismatch/log_ppl_abs_diff", ppl.abs(), has)
    b.maximum("mismatch/log_ppl_diff_max", ppl, has)
    b.minimum("mismatch/log_ppl_diff_min", ppl, has)
    r64 = torch.exp(mu64)  # extremes from the unclamped log value, float64 range
    b.maximum("mismatch/r_max", r64, mask)
    b.minimum("mismatch/r_min", r64, mask)
    flat = mu[mask]
    if flat.numel():
        k = max(1, math.ceil(0.99 * flat.numel()))  # nearest-rank percentile
        b.raw("mismatch/log_r_p99", "max", torch.kthvalue(flat, k).values)

    if staleness is not None:
        live = staleness[mask]
        for j in torch.unique(live).tolist() if live.numel() else []:
            where = mask & (staleness == j)
            b.mean(f"mismatch/by_staleness/eta={j}/kl_k3", k3, where)
            b.mean(f"mismatch/by_staleness/eta={j}/kl_k1", -mu64, where)
            b.total(f"mismatch/by_staleness/eta={j}/tokens", where.sum())

    # per token or per sequence (is_level): log_w = the clamped log IS weight, log_r = the same unclamped
    log_w, log_r, where = (x, mu, mask) if is_level == "token" else (clamp_log(sum_mu), sum_mu, has)
    b.ess("is/ess_raw", torch.exp(log_w), where)
    if is_cap is not None:
        log_c = math.log(is_cap)
        b.frac("is/trunc_frac", log_r > log_c, where)
        b.frac("is/low_frac", log_r < -log_c, where)
        b.ess("is/ess_trunc", torch.exp(log_w.clamp(max=log_c)), where)


def mismatch_metrics(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    is_cap: float | None = 2.0,
    is_level: str = "token",
    versions: torch.Tensor | None = None,
    learner_version: int | None = None,
) -> MetricDict:
    """The §7 mismatch block for one step batch (call once, before the first minibatch).

    prox_logp, behav_logp: [B, T] float; mask: [B, T] bool/0-1; versions: [B, T] int policy
    version per token (any value outside ``mask``), with ``learner_version`` = k. ``is_cap`` (C)
    and ``is_level`` describe the TIS weights for ``is/*``; ``is_cap=None`` reports only
    ``is/ess_raw``. Returns a reducible ``MetricDict`` (glossary: docs/metrics.md).
    """
    if is_level not in LEVELS:
        raise ValueError(f"is_level must be one of {', '.join(LEVELS)}, got {is_level!r}")
    if prox_logp.shape != mask.shape or behav_logp.shape != mask.shape:
        raise ValueError(
            f"prox_logp {tuple(prox_logp.shape)}, behav_logp {tuple(behav_logp.shape)} and mask "
            f"{tuple(mask.shape)} must all be [B, T]"
        )
    with torch.no_grad():
        valid = mask.bool()
        prox = prox_logp.detach().float()
        behav = behav_logp.detach().float()
        ok = valid & torch.isfinite(prox) & torch.isfinite(behav)
        mu = torch.where(ok, prox - behav, 0)
        staleness = None
        if versions is not None:
            if learner_version is None:
                raise ValueError("versions were given without learner_version; pass the learner's version k")
            if versions.shape != mask.shape:
                raise ValueError(f"versions has shape {tuple(versions.shape)}, expected {tuple(mask.shape)}")
            staleness = int(learner_version) - versions.to(torch.int64)
        b = StatsBuilder()
        b.total("mismatch/nonfinite_tokens", (valid & ~ok).sum())
        add_mismatch_stats(b, mu, ok, is_cap=is_cap, is_level=is_level, staleness=staleness)
        return b.build()


def response_stats(lengths: torch.Tensor, truncated: torch.Tensor | None = None) -> MetricDict:
    """Response-length statistics and truncation rate (§7, GRPO/DAPO block).

    lengths: [N] generated tokens per response; truncated: [N] bool, hit the length limit
    without EOS.
    """
    with torch.no_grad():
        lengths = lengths.detach().to(torch.float64).reshape(-1)
        every = torch.ones_like(lengths, dtype=torch.bool)
        b = StatsBuilder()
        b.mean("data/response_length/mean", lengths, every)
        b.maximum("data/response_length/max", lengths, every)
        b.minimum("data/response_length/min", lengths, every)
        if truncated is not None:
            b.frac("data/truncated_frac", truncated.reshape(-1).bool(), every)
        return b.build()
