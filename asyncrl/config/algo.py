"""The algorithm's configuration: ``ObjectiveConfig`` (one policy objective, docs/algorithms.md §4-§6,
§11) and ``AlgoConfig`` (the run's ``algo.*`` section: the objective plus the group settings).

Owns: every objective option, its default, the per-objective defaults (``OBJECTIVE_DEFAULTS``, the
one place they live), the value lists of the algorithm's choices (``OBJECTIVES``, ``AGGREGATIONS``,
``ADVANTAGES``, ...), and validation with messages that name the fix. The run schema nests
``AlgoConfig`` as is, so every field here is an ``algo.<field>=...`` key of ``asyncrl train``, and the
learner hands the run's ``cfg.algo`` to the loss (``asyncrl.algo``) unchanged.
Never: imports anything but the standard library (``asyncrl.algo`` imports it without msgspec), reads files
or environment, or knows about Hydra. Invariants: a constructed
config is valid; every consumer may rely on the enum fields holding one of the listed values.
``eps_low``, ``eps_high`` and ``agg`` keep what the user wrote (None: the objective's own); the
loss reads the values in effect from ``clip_low``, ``clip_high`` and ``aggregation``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "AlgoConfig",
    "LEVELS",
    "OBJECTIVES",
    "OBJECTIVE_DEFAULTS",
    "ObjectiveConfig",
    "REJECTION_DENOMINATORS",
    "RS_MODES",
    "SEQUENCE_OBJECTIVES",
    "TBPO_W_MODES",
    "parse_rs_threshold",
    "require_choice",
]

def require_choice(name: str, value: object, options: tuple[str, ...]) -> None:
    """Refuse ``value`` unless it is one of ``options``, in the wording of ``protocols.values.require_choice``.

    Its twin for the algorithm's options: importing ``protocols`` would load msgspec, which asyncrl.algo must not
    (tests/unit/algo/test_algo_imports.py).
    """
    if value not in options:
        raise ValueError(f"{name}={value!r} is not valid; choose one of: {', '.join(options)}")


OBJECTIVES = ("ppo", "decoupled", "tis", "acr", "tbpo", "gspo")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
ADVANTAGES = ("grpo", "drgrpo", "rloo")
"""Group advantage estimators (``asyncrl.algo.outcome.outcome_advantages``, §3.1)."""
ADV_EPS = 1e-6
"""epsilon_A of the GRPO advantage (verl)."""
LEVELS = ("token", "sequence")
"""Where a weight or a filter acts (``is_level``, ``stale_level``): per token or per whole response."""
REJECTION_DENOMINATORS = ("pre_mask", "post_mask")
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
SEQUENCE_OBJECTIVES = ("gspo", "tbpo")
"""Objectives whose trust ratio is the per-response geometric mean (whole-response removal, §2.5)."""

OBJECTIVE_DEFAULTS: dict[str, dict[str, Any]] = {
    "*": {"eps_low": 0.2, "eps_high": 0.2, "agg": "token-mean"},
    "gspo": {"eps_low": 3e-4, "eps_high": 4e-4, "agg": "seq-mean-token-mean"},
    "tbpo": {"agg": "seq-mean-token-mean"},
}
"""The per-objective defaults (§11; aggregation: §5 "used by"), the one place they live: an option
left at None (``eps_low``, ``eps_high``, ``agg``) takes the objective's entry, else ``"*"``'s. They
apply the same whether a run says ``algo=gspo`` (group file) or ``algo.objective=gspo``; a value the
user writes wins."""


def objective_default(objective: str, name: str) -> Any:
    """The default of option ``name`` for ``objective`` (``OBJECTIVE_DEFAULTS``)."""
    return OBJECTIVE_DEFAULTS.get(objective, {}).get(name, OBJECTIVE_DEFAULTS["*"][name])


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
    """One policy objective. Defaults follow docs/algorithms.md §11; every field is a key
    ``algo.<field>`` of ``asyncrl train`` (``AlgoConfig`` below adds the group settings)."""

    objective: str = "acr"
    """``ppo`` (coupled §6.1: prox is the old policy, behaviour ignored), ``decoupled`` (AReaL §6.2:
    weight r, tokens with r > behav_cap masked), ``tis`` (§6.3), ``acr`` (QuRL §6.4), ``tbpo`` (QaRL
    §6.7), ``gspo`` (§6.5, with a detached behaviour weight at ``is_level``)."""
    eps_low: float | None = None
    """Lower clip of the trust ratio (1 - eps_low); null = the objective's own (``OBJECTIVE_DEFAULTS``:
    0.2; GSPO 3e-4)."""
    eps_high: float | None = None
    """Upper clip (1 + eps_high); null = the objective's own (0.2; GSPO 4e-4). 0.28 for DAPO clip-higher."""
    dual_clip: float | None = 3.0
    """c of the dual clip for negative advantages (> 1); null disables it. Not used by gspo/tbpo (§6.5
    has no dual clip; TBPO's negative band replaces it)."""
    is_cap: float | None = 2.0
    """C, truncation of the behaviour weight (tis, acr, gspo); null = untruncated (gspo only)."""
    is_level: str = "token"
    """``token`` (min(r, C)) or ``sequence`` (min(exp(sum mu), C), verl) importance weights, tis and gspo."""
    behav_cap: float | None = 5.0
    """Decoupled only: tokens with prox/behaviour ratio r > behav_cap are masked; null = no mask."""
    rs_modes: tuple[str, ...] = ()
    """verl rejection masks (§6.3), pairwise with ``rs_thresholds``, e.g. ``algo.rs_modes=[seq_mean_k1]
    algo.rs_thresholds=['0.999_1.001']``. Used by decoupled, tis, acr, gspo; all masks must pass."""
    rs_thresholds: tuple[str, ...] = ()
    """One threshold per ``rs_modes`` entry: ``lo_hi`` ratio bounds for ``*_k1``, else one upper bound."""
    tbpo_eps_pos_high: float = 4e-4
    """TBPO positive cap 1 + eps_pos_high (§6.7)."""
    tbpo_eps_neg_low: float = 3e-4
    """TBPO negative band [1 - eps_neg_low, 1 + eps_neg_high]."""
    tbpo_eps_neg_high: float = 4e-4
    tbpo_w_low: float = 0.5
    """TBPO mismatch band [tbpo_w_low, tbpo_w_high] on the per-response weight w."""
    tbpo_w_high: float = 2.0
    tbpo_w_mode: str = "clamp"
    """What the mismatch band does (§6.7 revision 2026-12-01): ``clamp`` truncates w to the band and
    keeps every response (w also carries the staleness at eta > 0); ``drop`` removes the responses
    with w outside it (QaRL as written, for eta=0; with stale rollouts it can remove every positive
    response)."""
    agg: str | None = None
    """Loss aggregation (§5): token-mean, seq-mean-token-mean, seq-mean-token-sum; null = the
    objective's own (seq-mean-token-mean for gspo and tbpo, token-mean otherwise). A comparison of
    objectives should set one value for all."""
    rejection_denominator: str = "pre_mask"
    """``pre_mask`` (AReaL; rejected tokens stay in the denominator) or ``post_mask`` (verl;
    re-normalise over the survivors)."""
    kl_coef: float = 0.0
    """KL-to-reference coefficient (k3); 0 disables the reference forward."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient; 0 disables it."""
    eta_max: int | None = None
    """Drop tokens (or responses, ``stale_level``) staler than this inside the loss; null = no filter
    here (the controller's admission gate enforces ``rollout.eta``, §3.4)."""
    stale_level: str = "token"
    """What ``eta_max`` drops: ``token`` or the whole ``sequence``."""
    abort_on_nonfinite_theta: bool = True
    """A non-finite current log-prob (a learner bug) flags ``actor/skip_step``."""

    def __post_init__(self) -> None:
        require_choice("objective", self.objective, OBJECTIVES)
        require_choice("is_level", self.is_level, LEVELS)
        if self.agg is not None:
            require_choice("agg", self.agg, AGGREGATIONS)
        require_choice("rejection_denominator", self.rejection_denominator, REJECTION_DENOMINATORS)
        require_choice("stale_level", self.stale_level, LEVELS)
        require_choice("tbpo_w_mode", self.tbpo_w_mode, TBPO_W_MODES)
        for name in ("eps_low", "eps_high", "tbpo_eps_pos_high", "tbpo_eps_neg_low", "tbpo_eps_neg_high",
                     "tbpo_w_low", "tbpo_w_high", "kl_coef", "entropy_coef"):
            v = getattr(self, name)
            if v is None and name in ("eps_low", "eps_high"):
                continue
            if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if not 0 < self.clip_low < 1:
            raise ValueError(f"eps_low={self.clip_low} must be in (0, 1) (lower clip bound 1 - eps_low > 0), or "
                             "null for the objective's own")
        if not self.clip_high > 0:
            raise ValueError(f"eps_high={self.clip_high} must be > 0 (upper clip bound 1 + eps_high), or null for "
                             "the objective's own")
        if self.dual_clip is not None and not (self.dual_clip > 1 and math.isfinite(self.dual_clip)):
            raise ValueError(
                f"dual_clip={self.dual_clip} must be a finite number > 1 (e.g. 3.0), or null to disable it"
            )
        if self.is_cap is not None and not (self.is_cap > 0 and math.isfinite(self.is_cap)):
            raise ValueError(f"is_cap={self.is_cap} must be a finite number > 0 (TIS cap C, e.g. 2.0)")
        if self.is_cap is None and self.objective in ("tis", "acr"):
            raise ValueError(
                f"objective={self.objective!r} needs is_cap (C, e.g. 2.0); for an untruncated weight use "
                "objective=decoupled with behav_cap=null"
            )
        if self.objective == "acr" and self.is_level != "token":
            raise ValueError("ACR adapts a per-token clip bound (§6.4): set is_level=token")
        if self.behav_cap is not None and not (self.behav_cap > 0 and math.isfinite(self.behav_cap)):
            raise ValueError(
                f"behav_cap={self.behav_cap} must be a finite number > 0 (e.g. 5.0), or null for no mask"
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
                f"eta_max={self.eta_max!r} must be an int >= 0, or null (no staleness filter in the loss)"
            )
        if not isinstance(self.abort_on_nonfinite_theta, bool):
            raise ValueError("abort_on_nonfinite_theta must be true or false")

        # Hydra hands over lists; a frozen, hashable config stores tuples of strings.
        modes = tuple(str(m) for m in (self.rs_modes or ()))
        thresholds = tuple(str(t) for t in (self.rs_thresholds or ()))
        object.__setattr__(self, "rs_modes", modes)
        object.__setattr__(self, "rs_thresholds", thresholds)
        if len(modes) != len(thresholds):
            raise ValueError(
                f"rs_modes has {len(modes)} entries but rs_thresholds has {len(thresholds)}: give one "
                "threshold per mask, e.g. rs_modes=[seq_mean_k1] rs_thresholds=['0.999_1.001']"
            )
        for mode, thr in zip(modes, thresholds, strict=True):
            require_choice("rs_modes entry", mode, RS_MODES)
            parse_rs_threshold(mode, thr)
        if modes and self.objective in ("ppo", "tbpo"):
            raise ValueError(
                f"rejection masks act on the behaviour ratio: objective={self.objective!r} does not use them "
                "(ppo ignores the behaviour policy, tbpo has its own mismatch band); set rs_modes=[]"
            )

    @property
    def clip_low(self) -> float:
        """``eps_low`` in effect (the objective's default when None)."""
        return float(self.eps_low if self.eps_low is not None else objective_default(self.objective, "eps_low"))

    @property
    def clip_high(self) -> float:
        """``eps_high`` in effect (the objective's default when None)."""
        return float(self.eps_high if self.eps_high is not None else objective_default(self.objective, "eps_high"))

    @property
    def aggregation(self) -> str:
        """``agg`` in effect (the objective's default when None)."""
        return str(self.agg if self.agg is not None else objective_default(self.objective, "agg"))

    @property
    def uses_behaviour(self) -> bool:
        """False only for coupled PPO, which ignores ``behav_logp``."""
        return self.objective != "ppo"

    @property
    def sequence_level(self) -> bool:
        """True when a non-finite input removes the whole response (§2.5)."""
        return self.objective in SEQUENCE_OBJECTIVES or (self.objective == "tis" and self.is_level == "sequence")


@dataclass(frozen=True, kw_only=True, slots=True)
class AlgoConfig(ObjectiveConfig):
    """The run's ``algo.*`` section: the objective (every ``ObjectiveConfig`` field) plus how groups
    are formed and scored. The learner passes it to the loss as the ``ObjectiveConfig`` it is."""

    advantage: str = "grpo"
    """Group advantage estimator: grpo (unbiased std), drgrpo (no std), rloo."""
    group_size: int = 8
    """Responses per prompt (G)."""
    dynamic_sampling: bool = False
    """DAPO filter: drop groups whose rewards are all equal (they carry no gradient)."""

    def __post_init__(self) -> None:
        ObjectiveConfig.__post_init__(self)
        require_choice("advantage", self.advantage, ADVANTAGES)
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 2:
            raise ValueError(f"group_size={self.group_size!r}: GRPO needs groups of >= 2 responses")
        if not isinstance(self.dynamic_sampling, bool):
            raise ValueError("dynamic_sampling must be true or false")
