"""Per-token losses lambda of every objective kind (docs/algorithms.md §4, §6.1-§6.5, §6.7).

Owns the mapping kind -> (weight omega, clip bounds, surrogate) and the objective-specific
metrics (decoupled/*, acr/*, tbpo/*, gspo/*). Token kinds: ppo, decoupled, tis, acr. Sequence
kinds: gspo, tbpo, whose ratio is the response's geometric mean rho_i = exp(mean_t delta_t),
broadcast to the response's tokens as a differentiable function of all of them.

Never: decides which tokens count (``inputs.py``), aggregates (``aggregation.py``), or lets
behaviour-side quantities carry gradient.

Invariants: ``num`` ([B, T] bool) is the set of tokens whose lambda is non-zero; ``logp`` is
where-masked against it before any arithmetic, so a NaN/inf current log-prob outside ``num``
never reaches ``exp`` or the gradient. Departures from the spec are marked DEPARTURE.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from asyncrl.algo.correction import acr_log_hi, is_weights
from asyncrl.algo.inputs import Prepared
from asyncrl.algo.numerics import GSPO_LOG_RATIO_MAX, guarded_exp, seq_any, seq_mean
from asyncrl.algo.stats import StatsBuilder
from asyncrl.algo.surrogate import SurrogateOut, clipped_surrogate, tbpo_surrogate
from asyncrl.config.algo import ObjectiveConfig

__all__ = ["ObjectiveOut", "token_objective", "sequence_objective"]


class ObjectiveOut(NamedTuple):
    token_loss: torch.Tensor
    """lambda [B, T], zero outside ``num``; carries gradient."""
    surrogate: SurrogateOut
    log_ratio: torch.Tensor
    """Detached trust-region log-ratio per token used by the surrogate: delta (token kinds) or
    the response's mean delta broadcast to its tokens (sequence kinds). [B, T]."""


def token_objective(
    logp: torch.Tensor, prep: Prepared, num: torch.Tensor, cfg: ObjectiveConfig, b: StatsBuilder
) -> ObjectiveOut:
    """lambda = kappa * omega * psi(R, A; lo, hi, c) for ppo / decoupled / tis / acr (§4 table)."""
    delta = torch.where(num, logp - prep.prox, 0)
    adv = prep.adv
    log_lo = math.log1p(-cfg.clip_low)
    log_hi: float | torch.Tensor = math.log1p(cfg.clip_high)
    omega: torch.Tensor | None = None
    if cfg.objective in ("decoupled", "tis", "acr"):
        mu = prep.behaviour_mu()
    if cfg.objective == "decoupled":
        omega = torch.where(prep.clean, guarded_exp(mu), 0)  # r, untruncated (§6.2)
    elif cfg.objective == "tis":
        omega = is_weights(mu, prep.clean, cfg.is_cap, cfg.is_level)
    elif cfg.objective == "acr":
        omega = is_weights(mu, prep.clean, cfg.is_cap, "token")
        log_hi = acr_log_hi(mu, cfg.clip_high)
    sur = clipped_surrogate(delta, adv, log_lo, log_hi, cfg.dual_clip)
    lam = sur.loss if omega is None else sur.loss * omega
    lam = torch.where(num, lam, 0)

    with torch.no_grad():
        if cfg.objective == "decoupled" and omega is not None:
            b.frac("decoupled/masked_frac", ~prep.keep, prep.clean)
            b.mean("decoupled/behav_imp_weight_mean", omega, prep.keep)
            b.maximum("decoupled/behav_imp_weight_max", omega, prep.keep)
            b.mean("decoupled/behav_approx_kl", mu, prep.keep)
        if cfg.objective == "acr":
            hi = torch.exp(torch.as_tensor(log_hi).to(torch.float64))
            b.mean("acr/hi_mean", hi, num)
            b.frac("acr/clipfrac_hi", sur.clip_hi, num)
            b.frac("acr/empty_band_frac", torch.as_tensor(log_hi) < log_lo, num)
            # DEPARTURE (naming detail): restricted to A > 0 so it compares with acr/clipfrac_hi.
            b.frac("acr/tis_would_clip_frac", (adv > 0) & (delta.detach() > math.log1p(cfg.clip_high)), num)
        if cfg.rs_modes:
            _rs_stats(b, prep)
    return ObjectiveOut(lam, sur, delta.detach())


def sequence_objective(
    logp: torch.Tensor, prep: Prepared, num: torch.Tensor, cfg: ObjectiveConfig, b: StatsBuilder
) -> ObjectiveOut:
    """GSPO (§6.5) and TBPO (§6.7) with the token trick; A_i = masked mean of the token advantages."""
    lp = torch.where(num, logp, 0)
    delta = torch.where(num, lp - prep.prox, 0)
    log_rho = seq_mean(delta, num)  # [B], with gradient d/d l_t = m_t / L_i
    dbar = log_rho.detach()
    adv_i = seq_mean(prep.adv, num)
    adv = torch.where(num, adv_i.unsqueeze(-1).expand_as(lp), 0)
    # DEPARTURE (§6.5 implementation detail): the sequence ratio is broadcast as a differentiable
    # function of the whole response instead of verl's token trick sg[mean] + l_t - sg[l_t]. Both
    # have the same value, and the same gradient whenever the weight is constant over the response
    # (coupled, sequence-level IS, TBPO); with per-token behaviour weights only this form is the
    # gradient of the returned loss (and it is AReaL's ``importance_sampling_level=sequence``).
    log_s = torch.where(num, log_rho.unsqueeze(-1).expand_as(lp), 0)
    has = seq_any(prep.clean)
    used = seq_any(num)
    if cfg.objective == "gspo":
        sur = clipped_surrogate(
            log_s, adv, math.log1p(-cfg.clip_low), math.log1p(cfg.clip_high), None, max_log=GSPO_LOG_RATIO_MAX
        )
        omega = is_weights(prep.behaviour_mu(), prep.clean, cfg.is_cap, cfg.is_level)
        lam = torch.where(num, sur.loss * omega, 0)
        with torch.no_grad():
            b.mean("gspo/rho_mean", guarded_exp(dbar, GSPO_LOG_RATIO_MAX), used)
            if cfg.rs_modes:
                _rs_stats(b, prep)
    else:  # tbpo
        sur = tbpo_surrogate(log_s, adv, cfg.tbpo_eps_pos_high, cfg.tbpo_eps_neg_low, cfg.tbpo_eps_neg_high)
        mbar = seq_mean(prep.behaviour_mu(), prep.clean)
        w = guarded_exp(mbar)  # geometric-mean mismatch weight, detached
        if cfg.tbpo_w_mode == "clamp":  # §6.7 revision: truncate w, keep the response
            w_used = w.clamp(cfg.tbpo_w_low, cfg.tbpo_w_high)
        else:  # drop: responses outside the band are not in ``num`` (kappa_i = 0, inputs.py)
            w_used = w
        lam = torch.where(num, sur.loss * w_used.unsqueeze(-1), 0)
        with torch.no_grad():
            kept = seq_any(prep.keep)
            log_rho = dbar
            b.frac("tbpo/seq_masked_frac", ~kept, has)
            b.frac("tbpo/kept_seq_frac", kept, has)
            b.mean("tbpo/rho_mean", guarded_exp(log_rho), used)
            b.mean("tbpo/w_mean", w, has)
            # Responses whose w is outside [w_low, w_high]: clamped (clamp) or dropped (drop), split
            # by the sign of the response's advantage (a zero advantage counts in neither part).
            outside = (mbar < math.log(cfg.tbpo_w_low)) | (mbar > math.log(cfg.tbpo_w_high))
            name = "tbpo/w_clamped_frac" if cfg.tbpo_w_mode == "clamp" else "tbpo/seq_masked_frac"
            adv_c = seq_mean(prep.adv, prep.clean)
            if cfg.tbpo_w_mode == "clamp":
                b.frac(name, outside, has)
            b.frac(f"{name}/pos", outside, has & (adv_c > 0))
            b.frac(f"{name}/neg", outside, has & (adv_c < 0))
            b.frac("tbpo/pos_clip_frac", log_rho > math.log1p(cfg.tbpo_eps_pos_high), used & (adv_i > 0))
            out = (log_rho < math.log1p(-cfg.tbpo_eps_neg_low)) | (
                log_rho > math.log1p(cfg.tbpo_eps_neg_high)
            )
            b.frac("tbpo/neg_band_frac", out, used & (adv_i < 0))
    return ObjectiveOut(lam, sur, torch.where(num, dbar.unsqueeze(-1).expand_as(lp), 0))


def _rs_stats(b: StatsBuilder, prep: Prepared) -> None:
    rejected = prep.clean & ~prep.keep
    b.frac("rs/token_masked_frac", rejected, prep.clean)
    b.frac("rs/seq_masked_frac", rejected.any(-1), seq_any(prep.clean))
