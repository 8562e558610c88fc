"""A complete group's scores, typed: one reward and one advantage per member, and whether it has zero variance.

Owns: ``Scores`` (what ``core.score_group`` computes when a group completes; kept on the group by
``GroupBuffer.score``, checkpointed with it, and read by the batch, the dynamic-sampling filter and the batch
metrics) and its checkpoint form. Standard library only (tests/unit/test_layout.py).
Never: computes a reward or an advantage (``asyncrl.tasks.scoring`` and ``asyncrl.algo.outcome`` do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Scores:
    rewards: tuple[float, ...]
    """One per member, in member order."""
    advantages: tuple[float, ...]
    """The float32 values the learner trains on, in member order."""
    zero_variance: bool
    """Every member got the same reward (a one-member group too): every advantage is 0, so the group carries no
    gradient. Decided once, by the estimator (``asyncrl.algo.outcome_advantages``); dynamic sampling drops such
    a group (docs/algorithms.md §3.2) and ``train/zero_variance_groups`` counts it."""

    def state(self) -> dict[str, Any]:
        return {"rewards": list(self.rewards), "advantages": list(self.advantages), "zero_variance": self.zero_variance}

    @classmethod
    def from_state(cls, item: dict[str, Any] | None) -> Scores | None:
        """``state()`` read back; None for a group not scored yet. States of older runs kept the rewards and
        advantages in an untyped annotation, without ``zero_variance``: it is read off the rewards."""
        if not item:
            return None
        rewards = tuple(float(r) for r in item["rewards"])
        zero = item.get("zero_variance", len(set(rewards)) <= 1)
        return cls(rewards, tuple(float(a) for a in item["advantages"]), bool(zero))
