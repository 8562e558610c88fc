"""Group advantages of outcome rewards, without torch (docs/algorithms.md §3.1-§3.2).

Owns the arithmetic of the group estimators (GRPO with unbiased std and epsilon 1e-6, Dr. GRPO
without std, RLOO) and the singleton and zero-variance rules (``GroupCounts``: the controller's
``Scores.zero_variance`` is read from them, so the dynamic-sampling filter and the batch metric agree with
the estimator). The controller scores every complete group here, so its process never loads torch (its
resident memory: docs/benchmarks.md §8).

Never: imports torch; sees log-probs or versions.

Invariants: float64 statistics; a zero-variance group gets exactly A = 0; a singleton group gets
A = 0 ([R]: verl would give A = R, deliberately not copied); rewards must be finite.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from asyncrl.config.algo import ADV_EPS, ADVANTAGES, require_choice

__all__ = ["GroupCounts", "outcome_advantages"]


class GroupCounts(NamedTuple):
    """What ``outcome_advantages`` saw: groups, singleton groups, and zero-variance groups among
    the ``multi`` groups of two or more members."""

    groups: int
    singleton: int
    zero_var: int
    multi: int


def outcome_advantages(
    rewards: Sequence[float] | np.ndarray,
    group_ids: Sequence[int] | np.ndarray | None = None,
    *,
    estimator: str = "grpo",
    eps: float = ADV_EPS,
) -> tuple[np.ndarray, GroupCounts]:
    """Outcome advantages A_i of complete groups (§3.1). rewards: [N]; group_ids: [N] any ints
    (None = one group). Returns (A [N] float64, counts).

    grpo: (R_i - mean) / (std_unbiased + eps); drgrpo: R_i - mean; rloo: R_i - mean of the
    other members = G/(G-1) (R_i - mean). Zero-variance group: 0 exactly; singleton group: 0.
    """
    require_choice("estimator", estimator, ADVANTAGES)
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be [N] (one scalar per response), got shape {tuple(r.shape)}")
    if not np.isfinite(r).all():
        raise ValueError("rewards contain NaN/inf: fix the verifier or drop the group before computing advantages")
    n = r.shape[0]
    if group_ids is None:
        inv, k = np.zeros(n, dtype=np.int64), (1 if n else 0)
    else:
        ids = np.asarray(group_ids)
        if ids.shape != (n,):
            raise ValueError(f"group_ids must have shape ({n},) like rewards, got {tuple(ids.shape)}")
        uniq, inv = np.unique(ids, return_inverse=True)
        k = int(uniq.size)
    size = np.bincount(inv, minlength=k).astype(np.float64)
    mean = np.bincount(inv, weights=r, minlength=k) / np.maximum(size, 1)
    dev = r - mean[inv]
    std = np.sqrt(np.bincount(inv, weights=dev * dev, minlength=k) / np.maximum(size - 1, 1))
    rmax, rmin = np.full(k, -np.inf), np.full(k, np.inf)
    np.maximum.at(rmax, inv, r)
    np.minimum.at(rmin, inv, r)
    singleton = size < 2
    zero_var = ~singleton & (rmax == rmin)
    if estimator == "grpo":
        adv = dev / (std[inv] + eps)
    elif estimator == "drgrpo":
        adv = dev
    else:
        adv = dev * (size / np.maximum(size - 1, 1))[inv]
    adv = np.where((singleton | zero_var)[inv], 0.0, adv)
    counts = GroupCounts(groups=k, singleton=int(singleton.sum()), zero_var=int(zero_var.sum()),
                         multi=int((~singleton).sum()))
    return adv, counts

