"""asyncrl.algo: the learner's math as a pure tensor library (docs/algorithms.md §2-§7, §10-§11).

Tensors in, ``(loss, metrics)`` out. Entry points:

* ``policy_loss(logp, prox_logp, behav_logp, advantages, mask, cfg, *, num_tokens=None,
  num_seqs=None, versions=None, learner_version=None, ref_logp=None, entropy=None)`` with a frozen
  ``ObjectiveConfig`` (kinds ppo, decoupled, tis, acr, tbpo, gspo);
* ``loss_denominators`` (global denominators for micro-batch / rank splits);
* ``outcome_advantages`` (§3.1: the group estimators on plain floats, without torch: the controller's);
* ``MetricDict`` / ``merge_metrics`` (metrics that reduce correctly across calls).

Never: imports torch.distributed, zmq, msgspec, the transport or any other asyncrl sub-package but its
options (``asyncrl.config.algo``, standard library only), does I/O, or reads global configuration.
Importing the package is cheap (no torch): its options are imported at once (the run schema nests their
``AlgoConfig``); the tensor modules load on first use of a name (``outcome`` needs only numpy).
Invariants: fp32 log-space arithmetic, clamped exponentials, where-masking before arithmetic,
finite losses; departures from the spec are marked DEPARTURE in the code and listed in
docs/algorithms.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl._lazy import lazy_exports
from asyncrl.config.algo import (
    ADVANTAGES,
    AGGREGATIONS,
    OBJECTIVES,
    RS_MODES,
    TBPO_W_MODES,
    AlgoConfig,
    ObjectiveConfig,
)

if TYPE_CHECKING:
    from asyncrl.algo.aggregation import Denominators, aggregate
    from asyncrl.algo.correction import is_weights, rejection_keep
    from asyncrl.algo.loss import loss_denominators, policy_loss
    from asyncrl.algo.outcome import GroupCounts, outcome_advantages
    from asyncrl.algo.stats import MetricDict, Stat, merge_metrics

_LAZY = {
    "outcome": ("GroupCounts", "outcome_advantages"),
    "aggregation": ("Denominators", "aggregate"),
    "correction": ("is_weights", "rejection_keep"),
    "loss": ("loss_denominators", "policy_loss"),
    "stats": ("MetricDict", "Stat", "merge_metrics"),
}
__getattr__ = lazy_exports(__name__, _LAZY)  # the torch side, imported on first use


__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "OBJECTIVES",
    "RS_MODES",
    "TBPO_W_MODES",
    "AlgoConfig",
    "Denominators",
    "GroupCounts",
    "MetricDict",
    "ObjectiveConfig",
    "Stat",
    "aggregate",
    "is_weights",
    "loss_denominators",
    "merge_metrics",
    "outcome_advantages",
    "policy_loss",
    "rejection_keep",
]
