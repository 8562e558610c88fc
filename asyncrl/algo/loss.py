"""``policy_loss``: the one public entry point of the objective (docs/algorithms.md §2-§7).

Owns the order of work for one call: prepare the token set (``inputs.prepare``), guard the
current log-probs, compute lambda for the configured kind, aggregate with global denominators,
add the optional KL-to-reference and entropy terms, and report reducible metrics.
``loss_denominators`` is its twin for the learner: the global denominators of a batch, computed
by the very same ``prepare``.

Never: touches torch.distributed, optimisers or I/O; lets anything but ``logp`` (and
``entropy``) carry gradient; returns a non-finite loss.

Invariants:
* Splitting a batch into micro-batches (whole responses each) and passing the summed
  ``loss_denominators`` of all of them gives the same total loss and gradient as one call.
* DEPARTURE (§2.5): a non-finite *current* log-prob is removed from the numerator but stays in
  the denominators, because the learner sums denominators before the forward pass that
  produces logp; the step is flagged for skipping anyway (``abort_on_nonfinite_theta``).
"""

from __future__ import annotations

import torch

from asyncrl.algo.aggregation import Denominators, aggregate, count_denominators, resolve_denominators
from asyncrl.algo.diagnostics import add_mismatch_stats
from asyncrl.algo.inputs import Prepared, check_shapes, prepare
from asyncrl.algo.numerics import LOG_RATIO_BOUND, clamp_log, guarded_exp
from asyncrl.algo.objectives import ObjectiveOut, sequence_objective, token_objective
from asyncrl.algo.stats import MetricDict, StatsBuilder
from asyncrl.config.algo import SEQUENCE_OBJECTIVES, ObjectiveConfig

__all__ = ["policy_loss", "loss_denominators"]

KL_REF_CLAMP = 10.0
"""k3 of the KL-to-reference term is clamped to [-10, 10] (verl ``low_var_kl``, §6.8)."""


def loss_denominators(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: ObjectiveConfig,
    *,
    versions: torch.Tensor | None = None,
    learner_version: int | None = None,
    ref_logp: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> Denominators:
    """(num_tokens, num_seqs) that ``policy_loss`` would use for this batch on its own.

    Same arguments as ``policy_loss`` minus ``logp`` (all known before the forward pass). Call it
    on every micro-batch of an optimiser step (on every rank), add the results (``+`` or an
    all-reduce SUM of both fields), and pass the totals to each ``policy_loss`` call.
    """
    prep = prepare(
        prox_logp,
        behav_logp,
        advantages,
        mask,
        cfg,
        versions=versions,
        learner_version=learner_version,
        ref_logp=ref_logp,
        compute_dtype=compute_dtype,
    )
    return count_denominators(prep.den)


def policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: ObjectiveConfig,
    *,
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    versions: torch.Tensor | None = None,
    learner_version: int | None = None,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, MetricDict]:
    """Policy loss of ``cfg.objective`` for one (micro-)batch, and its metrics.

    logp: [B, T] current policy log-probs of the sampled tokens (the only input with gradient).
    prox_logp: [B, T] proximal (step-start) log-probs, no grad. For ``objective='ppo'`` this is the
      old policy and ``behav_logp`` is ignored (may be None).
    behav_logp: [B, T] log-probs reported by the sampler (behaviour policy).
    advantages: [B, T] per-token advantages (or [B], broadcast).
    mask: [B, T] bool/0-1, tokens that take part in the loss.
    num_tokens, num_seqs: global denominators of the optimiser-step minibatch when this call is
      one micro-batch / rank of it (``loss_denominators``); default: this call's own counts.
    versions, learner_version: per-token behaviour versions [B, T] int and the learner version k,
      for staleness metrics (and the ``eta_max`` filter).
    ref_logp: [B, T] reference log-probs for the k3 KL term (needed when ``cfg.kl_coef > 0``).
    entropy: [B, T] current-policy token entropy (with grad) for the bonus (``cfg.entropy_coef``).
    compute_dtype: float32 (§2.2); float64 for gradcheck.

    Returns ``(loss, metrics)``: a finite 0-d tensor (0 when nothing counts) and a ``MetricDict``
    (plain floats; ``metrics.stats`` merges across calls, see docs/metrics.md).
    ``metrics['actor/skip_step'] == 1.0`` means the optimiser step must be skipped.
    """
    if not isinstance(cfg, ObjectiveConfig):
        raise ValueError(f"cfg must be an asyncrl.algo.ObjectiveConfig, got {type(cfg).__name__}")
    check_shapes({"logp": logp, "entropy": entropy}, mask.shape)
    if cfg.kl_coef > 0 and ref_logp is None:
        raise ValueError(
            f"kl_coef={cfg.kl_coef} needs ref_logp (reference log-probs); pass it or set kl_coef=0"
        )
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError(
            f"entropy_coef={cfg.entropy_coef} needs entropy ([B, T] with grad); pass it or set entropy_coef=0"
        )
    prep = prepare(
        prox_logp,
        behav_logp,
        advantages,
        mask,
        cfg,
        versions=versions,
        learner_version=learner_version,
        ref_logp=ref_logp,
        compute_dtype=compute_dtype,
    )
    den = resolve_denominators(prep.den, num_tokens, num_seqs)
    b = StatsBuilder()

    lp = logp.to(compute_dtype)
    theta_bad = prep.clean & ~torch.isfinite(lp.detach())
    if cfg.sequence_level:
        num = prep.keep & ~theta_bad.any(-1, keepdim=True)
    else:
        num = prep.keep & ~theta_bad
    term_mask = prep.den & ~theta_bad  # tokens of the KL / entropy terms
    lp = torch.where(prep.clean & ~theta_bad, lp, 0)  # masked before any arithmetic (§2.4)

    objective = sequence_objective if cfg.objective in SEQUENCE_OBJECTIVES else token_objective
    out = objective(lp, prep, num, cfg, b)
    pg_loss = aggregate(out.token_loss, prep.den, cfg.aggregation, num_tokens=den.num_tokens, num_seqs=den.num_seqs)
    loss = pg_loss

    kl_loss = ent_loss = None
    if prep.ref is not None:  # ref_logp was given and kl_coef > 0 (prepare() keeps it only then)
        x = clamp_log(torch.where(term_mask, prep.ref - lp, 0))
        k3 = torch.where(term_mask, (torch.exp(x) - x - 1).clamp(-KL_REF_CLAMP, KL_REF_CLAMP), 0)
        kl_loss = aggregate(k3, prep.den, cfg.aggregation, num_tokens=den.num_tokens, num_seqs=den.num_seqs)
        loss = loss + cfg.kl_coef * kl_loss
    ent_ok = None
    if entropy is not None:
        ent = entropy.to(compute_dtype)
        ent_ok = term_mask & torch.isfinite(ent.detach())
        ent = torch.where(ent_ok, ent, 0)
        if cfg.entropy_coef > 0:
            ent_loss = aggregate(ent, prep.den, cfg.aggregation, num_tokens=den.num_tokens, num_seqs=den.num_seqs)
            loss = loss - cfg.entropy_coef * ent_loss

    finite_loss = torch.isfinite(loss.detach())
    loss = torch.where(finite_loss, loss, torch.zeros_like(loss))  # never hand back NaN/inf
    with torch.no_grad():
        skip = ~finite_loss | torch.tensor(den.num_tokens <= 0, device=finite_loss.device)
        if cfg.abort_on_nonfinite_theta:
            skip = skip | theta_bad.any()
        b.raw("actor/skip_step", "max", skip.to(torch.float64))
        b.total("actor/nonfinite_loss", (~finite_loss).to(torch.float64))
        b.total("actor/loss", loss.detach())
        b.total("actor/pg_loss", pg_loss.detach())
        b.total("actor/tokens", prep.clean.sum())
        b.total("actor/seqs", prep.clean.any(-1).sum())
        b.total("actor/nonfinite_logp_theta", theta_bad.sum())
        b.total("mismatch/nonfinite_tokens", prep.nonfinite_tokens)
        b.total("mismatch/nonfinite_seqs", prep.nonfinite_seqs)
        if prep.stale_tokens is not None:
            b.total("stale/dropped_tokens", prep.stale_tokens)
            b.frac("stale/dropped_frac", prep.finite & ~prep.clean, prep.finite)
        _actor_stats(b, lp.detach(), prep, num, out)
        if kl_loss is not None:
            b.total("actor/kl_loss", kl_loss.detach())
        if ref_logp is not None and kl_loss is not None:
            b.mean("actor/kl_ref", k3.detach(), term_mask)
        if ent_ok is not None:  # entropy was given
            b.mean("actor/entropy", ent.detach(), ent_ok)
            b.total("actor/nonfinite_entropy", (term_mask & ~ent_ok).sum())
        if ent_loss is not None:
            b.total("actor/entropy_loss", ent_loss.detach())
        if prep.mu is not None:
            is_cap = cfg.is_cap if cfg.objective in ("tis", "acr", "gspo") else None
            is_level = cfg.is_level if cfg.objective in ("tis", "gspo") else "token"
            add_mismatch_stats(
                b, prep.mu, prep.clean, is_cap=is_cap, is_level=is_level, staleness=prep.staleness
            )
        metrics = b.build()
    return loss, metrics


def _actor_stats(
    b: StatsBuilder, lp: torch.Tensor, prep: Prepared, num: torch.Tensor, out: ObjectiveOut
) -> None:
    """Per-minibatch current-vs-prox metrics of §7 over the loss tokens ``num``."""
    delta = torch.where(num, lp - prep.prox, 0)
    b.mean("actor/ppo_kl", -delta, num)
    b.frac("actor/clipfrac_hi", out.surrogate.clip_hi, num)
    b.frac("actor/clipfrac_lo", out.surrogate.clip_lo, num)
    b.frac("actor/clipfrac_dual", out.surrogate.clip_dual, num)
    ratio_log = out.log_ratio
    b.mean("actor/ratio_mean", guarded_exp(ratio_log), num)
    b.maximum("actor/ratio_max", torch.exp(ratio_log.to(torch.float64)), num)
    if prep.behav is not None:
        x = torch.where(num, lp - prep.behav, 0).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        b.mean("actor/cur_vs_behav/kl_k3", torch.exp(x) - 1 - x, num)
