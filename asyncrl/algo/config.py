"""``ObjectiveConfig``: the frozen description of one policy objective (docs/algorithms.md §4-§6, §11).

Owns: the field set, the defaults of §11, and validation with messages that name the fix.
Never: imports torch, reads files or environment, or knows about Hydra (``asyncrl.config`` maps
its schema onto this class). Invariant: a constructed config is valid; every consumer may rely on
the enum fields holding one of the listed values and on ``eps_low``/``eps_high`` being floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "ObjectiveConfig",
    "KINDS",
    "AGGREGATIONS",
    "IS_LEVELS",
    "REJECTION_DENOMINATORS",
    "RS_MODES",
    "TBPO_W_MODES",
    "parse_rs_threshold",
]

KINDS = ("ppo", "decoupled", "tis", "acr", "tbpo", "gspo")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
IS_LEVELS = ("token", "sequence")
REJECTION_DENOMINATORS = ("pre_mask", "post_mask")
STALE_LEVELS = ("token", "sequence")
TBPO_W_MODES = ("clamp", "drop")
RS_MODES = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
SEQUENCE_KINDS = ("gspo", "tbpo")
"""Objectives whose trust ratio is the per-response geometric mean (whole-response removal, §2.5)."""

_EPS_DEFAULTS = {"gspo": (3e-4, 4e-4)}  # §11; every other kind: 0.2 / 0.2
_AGG_DEFAULTS = {
    "gspo": "seq-mean-token-mean",
    "tbpo": "seq-mean-token-mean",
}  # §5 "used by"; else token-mean


def parse_rs_threshold(mode: str, threshold: str | float) -> tuple[float | None, float]:
    """(lower, upper) bound of one verl-style rejection mask (§6.3).

    ``*_k1`` masks take ``"lo_hi"`` ratio bounds (kept iff log lo <= stat <= log hi, returned as
    log values); the others take one upper bound on the k2/k3 statistic (returned as is).
    """
    text = str(threshold).strip()
    if mode.endswith("_k1"):
        parts = text.split("_")
        if len(parts) != 2:
            raise ValueError(
                f"rs threshold for {mode!r} must be 'lo_hi' ratio bounds such as '0.5_2.0', got {text!r}"
            )
        try:
            lo, hi = float(parts[0]), float(parts[1])
        except ValueError as err:
            raise ValueError(
                f"rs threshold {text!r} for {mode!r}: lo and hi must be numbers, e.g. '0.999_1.001'"
            ) from err
        if not (0 < lo <= hi) or not math.isfinite(hi):
            raise ValueError(
                f"rs threshold {text!r} for {mode!r} needs 0 < lo <= hi (ratio bounds), e.g. '0.5_2.0'"
            )
        return math.log(lo), math.log(hi)
    try:
        hi = float(text)
    except ValueError as err:
        raise ValueError(
            f"rs threshold for {mode!r} is one upper bound on the statistic, e.g. '0.5'; got {text!r}"
        ) from err
    if not (hi > 0 and math.isfinite(hi)):
        raise ValueError(f"rs threshold for {mode!r} must be a finite positive upper bound, got {text!r}")
    return None, hi


@dataclass(frozen=True, kw_only=True, slots=True)
class ObjectiveConfig:
    """One policy objective. Defaults follow docs/algorithms.md §11.

    kind: ``ppo`` (coupled §6.1: prox is the old policy, behaviour ignored), ``decoupled`` (AReaL
      §6.2: weight r, tokens with r > behav_cap masked), ``tis`` (§6.3), ``acr`` (§6.4), ``tbpo``
      (§6.7), ``gspo`` (§6.5, with a detached behaviour weight at ``is_level``).
    eps_low, eps_high: trust-ratio clip range; None = the kind's default (0.2/0.2, GSPO 3e-4/4e-4).
    dual_clip: c of the dual clip for negative advantages (> 1); None disables it. Not used by
      gspo/tbpo (§6.5 has no dual clip; TBPO's negative band replaces it).
    is_cap: C, truncation of the behaviour weight (tis, acr, gspo). None = untruncated (gspo only).
    is_level: ``token`` (min(r, C)) or ``sequence`` (min(exp(sum mu), C), verl) for tis and gspo.
    behav_cap: decoupled only: tokens with r > behav_cap are masked (weight 0); None = no mask.
    rs_modes, rs_thresholds: verl rejection masks (§6.3), pairwise, e.g. ``("seq_mean_k1",)`` with
      ``("0.999_1.001",)``. Used by decoupled, tis, acr, gspo; all masks must pass.
    tbpo_*: TBPO bands (§6.7): positive cap 1+eps_pos_high; negative band
      [1-eps_neg_low, 1+eps_neg_high]; mismatch band w in [w_low, w_high].
    tbpo_w_mode: what the mismatch band does (§6.7 revision 2026-12-01): ``clamp`` (default)
      truncates the detached weight w to [w_low, w_high] and keeps every response; ``drop`` removes
      the responses with w outside the band (paper-literal, for eta=0 or same-weight mismatch; with
      stale rollouts w also carries the staleness and the drop can remove every positive response).
    agg: loss aggregation (§5); None = the kind's default (seq-mean-token-mean for gspo and tbpo,
      token-mean otherwise).
    rejection_denominator: ``pre_mask`` (AReaL; rejected tokens stay in the denominator) or
      ``post_mask`` (verl; re-normalise over survivors).
    kl_coef, entropy_coef: weights of the optional k3 KL-to-reference and entropy-bonus terms.
    eta_max: drop tokens (or responses, ``stale_level``) staler than this inside the loss; None =
      no filter here (the controller's admission gate enforces the bound, §3.4).
    abort_on_nonfinite_theta: a non-finite current log-prob (learner bug) flags ``actor/skip_step``.
    """

    kind: str = "tis"
    eps_low: float | None = None
    eps_high: float | None = None
    dual_clip: float | None = 3.0
    is_cap: float | None = 2.0
    is_level: str = "token"
    behav_cap: float | None = 5.0
    rs_modes: tuple[str, ...] = ()
    rs_thresholds: tuple[str, ...] = ()
    tbpo_eps_pos_high: float = 4e-4
    tbpo_eps_neg_low: float = 3e-4
    tbpo_eps_neg_high: float = 4e-4
    tbpo_w_low: float = 0.5
    tbpo_w_high: float = 2.0
    tbpo_w_mode: str = "clamp"
    agg: str | None = None
    rejection_denominator: str = "pre_mask"
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    eta_max: int | None = None
    stale_level: str = "token"
    abort_on_nonfinite_theta: bool = True

    def __post_init__(self) -> None:
        def choice(name: str, value: str, valid: tuple[str, ...]) -> None:
            if value not in valid:
                raise ValueError(
                    f"ObjectiveConfig.{name}={value!r} is not valid; choose one of: {', '.join(valid)}"
                )

        choice("kind", self.kind, KINDS)
        if self.agg is None:
            object.__setattr__(self, "agg", _AGG_DEFAULTS.get(self.kind, "token-mean"))
        choice("is_level", self.is_level, IS_LEVELS)
        choice("agg", self.agg, AGGREGATIONS)
        choice("rejection_denominator", self.rejection_denominator, REJECTION_DENOMINATORS)
        choice("stale_level", self.stale_level, STALE_LEVELS)
        choice("tbpo_w_mode", self.tbpo_w_mode, TBPO_W_MODES)

        lo_default, hi_default = _EPS_DEFAULTS.get(self.kind, (0.2, 0.2))
        if self.eps_low is None:
            object.__setattr__(self, "eps_low", lo_default)
        if self.eps_high is None:
            object.__setattr__(self, "eps_high", hi_default)
        for name in (
            "eps_low",
            "eps_high",
            "tbpo_eps_pos_high",
            "tbpo_eps_neg_low",
            "tbpo_eps_neg_high",
            "tbpo_w_low",
            "tbpo_w_high",
            "kl_coef",
            "entropy_coef",
        ):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"ObjectiveConfig.{name} must be a finite number, got {v!r}")
        if not 0 < self.eps_low < 1:
            raise ValueError(f"eps_low={self.eps_low} must be in (0, 1) (lower clip bound 1 - eps_low > 0)")
        if not self.eps_high > 0:
            raise ValueError(f"eps_high={self.eps_high} must be > 0 (upper clip bound 1 + eps_high)")
        if self.dual_clip is not None and not (self.dual_clip > 1 and math.isfinite(self.dual_clip)):
            raise ValueError(
                f"dual_clip={self.dual_clip} must be a finite number > 1 (e.g. 3.0), or None to disable it"
            )
        if self.is_cap is not None and not (self.is_cap > 0 and math.isfinite(self.is_cap)):
            raise ValueError(f"is_cap={self.is_cap} must be a finite number > 0 (TIS cap C, e.g. 2.0)")
        if self.is_cap is None and self.kind in ("tis", "acr"):
            raise ValueError(
                f"kind={self.kind!r} needs is_cap (C, e.g. 2.0); for an untruncated weight use "
                "kind='decoupled' with behav_cap=None"
            )
        if self.kind == "acr" and self.is_level != "token":
            raise ValueError("ACR adapts a per-token clip bound (§6.4): set is_level='token'")
        if self.behav_cap is not None and not (self.behav_cap > 0 and math.isfinite(self.behav_cap)):
            raise ValueError(
                f"behav_cap={self.behav_cap} must be a finite number > 0 (e.g. 5.0), or None for no mask"
            )
        if not 0 < self.tbpo_eps_neg_low < 1:
            raise ValueError(f"tbpo_eps_neg_low={self.tbpo_eps_neg_low} must be in (0, 1)")
        if not (self.tbpo_eps_pos_high > 0 and self.tbpo_eps_neg_high > 0):
            raise ValueError("tbpo_eps_pos_high and tbpo_eps_neg_high must be > 0")
        if not 0 < self.tbpo_w_low <= self.tbpo_w_high:
            raise ValueError(
                f"TBPO mismatch band needs 0 < tbpo_w_low <= tbpo_w_high, got "
                f"[{self.tbpo_w_low}, {self.tbpo_w_high}] (default [0.5, 2.0])"
            )
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("kl_coef and entropy_coef must be >= 0 (0 disables the term)")
        if self.eta_max is not None and (
            isinstance(self.eta_max, bool) or not isinstance(self.eta_max, int) or self.eta_max < 0
        ):
            raise ValueError(
                f"eta_max={self.eta_max!r} must be an int >= 0, or None (no staleness filter in the loss)"
            )
        if not isinstance(self.abort_on_nonfinite_theta, bool):
            raise ValueError("abort_on_nonfinite_theta must be True or False")

        # Hydra hands over lists; a frozen, hashable config stores tuples of strings.
        modes = tuple(str(m) for m in (self.rs_modes or ()))
        thresholds = tuple(str(t) for t in (self.rs_thresholds or ()))
        object.__setattr__(self, "rs_modes", modes)
        object.__setattr__(self, "rs_thresholds", thresholds)
        if len(modes) != len(thresholds):
            raise ValueError(
                f"rs_modes has {len(modes)} entries but rs_thresholds has {len(thresholds)}: give one "
                "threshold per mask, e.g. rs_modes=('seq_mean_k1',), rs_thresholds=('0.999_1.001',)"
            )
        for mode, thr in zip(modes, thresholds, strict=True):
            choice("rs_modes entry", mode, RS_MODES)
            parse_rs_threshold(mode, thr)
        if modes and self.kind in ("ppo", "tbpo"):
            raise ValueError(
                f"rejection masks act on the behaviour ratio: kind={self.kind!r} does not use them "
                "(ppo ignores the behaviour policy, tbpo has its own mismatch band); set rs_modes=()"
            )

    @property
    def uses_behaviour(self) -> bool:
        """False only for coupled PPO, which ignores ``behav_logp``."""
        return self.kind != "ppo"

    @property
    def sequence_level(self) -> bool:
        """True when a non-finite input removes the whole response (§2.5)."""
        return self.kind in SEQUENCE_KINDS or (self.kind == "tis" and self.is_level == "sequence")
