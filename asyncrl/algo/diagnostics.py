"""Mismatch diagnostics between the proximal and the behaviour policy (docs/algorithms.md §7).

Owns the "computed once per step" block of §7, which ``policy_loss`` adds to its metrics: KL estimators
k1/k2/k3, chi-square (token and sequence), log-perplexity difference, ratio extremes and 99th percentile,
the same KL bucketed by staleness, TIS truncation fractions and ESS.

Never: needs gradients, the current policy, or a config object; logs or aggregates across calls
(the returned ``MetricDict`` is reducible, see ``stats.py``).

Invariants: statistics are over valid tokens whose prox and behaviour log-probs are both finite
(the others are counted in ``mismatch/nonfinite_tokens``); ratios are exponentiated only after
clamping to [-20, 20], while extremes and thresholds use the unclamped log value (§2.3).
"""

from __future__ import annotations

import math

import torch

from asyncrl.algo.numerics import clamp_log, seq_any, seq_mean, seq_sum
from asyncrl.algo.stats import StatsBuilder

__all__ = ["add_mismatch_stats"]


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
