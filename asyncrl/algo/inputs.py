"""Which tokens take part in the loss, decided before the forward pass (§2.5, §2.6, §3.4, §5).

Owns ``prepare``: shape/dtype checks, removal of non-finite inputs (counted; whole responses for
sequence-level objectives), the staleness filter, the rejection masks kappa, and the denominator
mask. ``policy_loss`` and ``loss_denominators`` both go through it, which is what makes a batch
split into micro-batches give the whole-batch loss.

Never: looks at the current log-probs (they do not exist yet when the learner sums denominators),
computes losses, or imports torch.distributed.

Invariants (all masks [B, T] bool):
* ``clean`` (m~ of §5) = valid & finite inputs & not stale; removed tokens are not in any
  denominator. ``keep`` = clean & kappa (rejections); ``den`` = clean (pre_mask) or keep
  (post_mask). ``keep`` is a subset of ``den``, which is a subset of ``clean``.
* The returned prox/behav/advantage/ref tensors are where-masked to 0 outside ``clean``, in
  the compute dtype, detached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.algo.correction import behav_cap_keep, mismatch_log_ratio, rejection_keep, tbpo_keep
from asyncrl.config.algo import ObjectiveConfig

__all__ = ["Prepared", "prepare", "check_shapes"]


@dataclass
class Prepared:
    prox: torch.Tensor
    behav: torch.Tensor | None
    adv: torch.Tensor
    ref: torch.Tensor | None
    """Reference log-probs; None unless ``ref_logp`` was given and ``kl_coef > 0``."""
    mu: torch.Tensor | None
    """l_prox - l_behav on clean tokens (None for coupled PPO)."""
    valid: torch.Tensor
    clean: torch.Tensor
    keep: torch.Tensor
    den: torch.Tensor
    nonfinite_tokens: torch.Tensor
    """valid tokens with a non-finite prox/behav/advantage/ref value (0-d)."""
    nonfinite_seqs: torch.Tensor
    """responses that contain such a token (0-d)."""
    stale_tokens: torch.Tensor | None
    """tokens dropped by eta_max (0-d), None when no filter ran."""
    finite: torch.Tensor
    """valid tokens left after the non-finite removal (before the staleness filter)."""
    staleness: torch.Tensor | None
    """learner_version - versions, int64 [B, T] (None without versions)."""

    def behaviour_mu(self) -> torch.Tensor:
        """``mu`` for an objective that corrects with the behaviour policy (ValueError without one)."""
        return _behaviour_mu(self.mu)


def _behaviour_mu(mu: torch.Tensor | None) -> torch.Tensor:
    if mu is None:
        raise ValueError("this objective needs the behaviour log-probs (behav_logp); pass them, or use "
                         "algo.objective=ppo (the behaviour policy as the old policy)")
    return mu


def check_shapes(name_to_tensor: dict[str, torch.Tensor | None], shape: torch.Size) -> None:
    for name, t in name_to_tensor.items():
        if t is not None and t.shape != shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but mask has shape {tuple(shape)}; all per-token "
                "inputs must be [B, T] (advantages may also be [B])"
            )


def _as_mask(mask: torch.Tensor) -> torch.Tensor:
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point() or mask.dtype in (
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
    ):
        return mask != 0
    raise ValueError(f"mask must be bool or numeric 0/1, got dtype {mask.dtype}")


def prepare(
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
) -> Prepared:
    """Everything about the token set that does not depend on the current policy.

    prox_logp, behav_logp, ref_logp: [B, T]; advantages: [B, T] or [B]; mask: [B, T] bool or
    0/1; versions: [B, T] int (may hold anything outside ``mask``). ``behav_logp`` may be None
    only for ``objective='ppo'``.
    """
    if not isinstance(cfg, ObjectiveConfig):
        raise ValueError(f"cfg must be an asyncrl.algo.ObjectiveConfig, got {type(cfg).__name__}")
    ref_logp = ref_logp if cfg.kl_coef > 0 else None  # only the KL-to-reference term reads it (§6.8)
    valid = _as_mask(mask)
    shape = valid.shape
    if advantages.dim() == 1 and advantages.shape[0] == shape[0]:
        advantages = advantages.unsqueeze(-1).expand(shape)
    uses_behav = cfg.uses_behaviour
    if uses_behav and behav_logp is None:
        raise ValueError(
            f"kind={cfg.objective!r} needs behav_logp (the sampler's log-probs); only kind='ppo' ignores it"
        )
    check_shapes(
        {
            "prox_logp": prox_logp,
            "behav_logp": behav_logp,
            "advantages": advantages,
            "ref_logp": ref_logp,
            "versions": versions,
        },
        shape,
    )

    with torch.no_grad():
        prox = prox_logp.detach().to(compute_dtype)
        adv = advantages.detach().to(compute_dtype)
        behav = behav_logp.detach().to(compute_dtype) if uses_behav and behav_logp is not None else None
        ref = ref_logp.detach().to(compute_dtype) if ref_logp is not None else None

        ok = torch.isfinite(prox) & torch.isfinite(adv)
        if behav is not None:
            ok &= torch.isfinite(behav)
        if ref is not None:
            ok &= torch.isfinite(ref)
        bad = valid & ~ok
        nonfinite_tokens = bad.sum()
        bad_seq = bad.any(-1)
        nonfinite_seqs = bad_seq.sum()
        if cfg.sequence_level:
            finite = valid & ~bad_seq.unsqueeze(-1)
        else:
            finite = valid & ~bad

        staleness = None
        stale_tokens = None
        clean = finite
        if versions is not None:
            if learner_version is None:
                raise ValueError("versions were given without learner_version; pass the learner's version k")
            staleness = int(learner_version) - versions.to(torch.int64)
            live = staleness[valid]
            if live.numel() and bool((live < 0).any()):
                raise ValueError(
                    f"a valid token has a behaviour version newer than learner_version={learner_version} "
                    "(negative staleness); versions must be the policy version that sampled each token"
                )
            if live.numel() and bool((live > int(learner_version)).any()):
                raise ValueError(
                    "a valid token has a negative behaviour version; every loss token needs the "
                    "version that sampled it (-1 is only allowed outside the mask)"
                )
        if cfg.eta_max is not None:
            if staleness is None:
                raise ValueError(
                    f"eta_max={cfg.eta_max} filters by staleness: pass versions and learner_version, "
                    "or set eta_max=None (the controller's gate then enforces the bound)"
                )
            stale = finite & (staleness > cfg.eta_max)
            if cfg.stale_level == "sequence":
                stale = finite & stale.any(-1, keepdim=True)
            stale_tokens = stale.sum()
            clean = finite & ~stale

        prox = torch.where(clean, prox, 0)
        adv = torch.where(clean, adv, 0)
        behav = torch.where(clean, behav, 0) if behav is not None else None
        ref = torch.where(clean, ref, 0) if ref is not None else None
        mu = mismatch_log_ratio(prox, behav, clean) if behav is not None else None

        if cfg.objective == "ppo":
            keep = clean
        elif cfg.objective == "tbpo":
            keep = clean  # w_mode=clamp truncates w in the objective and drops nothing (§6.7 revision)
            if cfg.tbpo_w_mode == "drop":
                keep = clean & tbpo_keep(_behaviour_mu(mu), clean, cfg.tbpo_w_low, cfg.tbpo_w_high).unsqueeze(-1)
        else:
            keep = clean
            if cfg.objective == "decoupled":
                keep = keep & behav_cap_keep(_behaviour_mu(mu), clean, cfg.behav_cap)
            if cfg.rs_modes:
                keep = keep & rejection_keep(_behaviour_mu(mu), clean, cfg.rs_modes, cfg.rs_thresholds)
        den = clean if cfg.rejection_denominator == "pre_mask" else keep

    return Prepared(
        prox=prox,
        behav=behav,
        adv=adv,
        ref=ref,
        mu=mu,
        valid=valid,
        clean=clean,
        keep=keep,
        den=den,
        nonfinite_tokens=nonfinite_tokens,
        nonfinite_seqs=nonfinite_seqs,
        stale_tokens=stale_tokens,
        finite=finite,
        staleness=staleness,
    )
