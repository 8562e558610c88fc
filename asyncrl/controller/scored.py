"""A scored group: a complete group of samples with its rewards and advantages, typed.

Owns: ``ScoredGroup`` (what the controller logs and trains on), how its scores are attached to a group
in the ``GroupBuffer`` (``annotation``, kept in the buffer's checkpointed annotation dict, so the
checkpoint format is unchanged) and read back (``of``), the dynamic-sampling predicate on it
(``informative``: ``asyncrl.algo.is_informative_group`` on the rewards, docs/algorithms.md §3.2), and
what a batch's responses look like (``response_metrics``).
Never: computes scores (``scoring.GroupScorer`` does) or decides batches (``assembler``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

import protocols as P
from asyncrl.algo import is_informative_group
from asyncrl.controller.buffer import CompleteGroup


@dataclasses.dataclass(frozen=True)
class ScoredGroup:
    group: CompleteGroup
    rewards: tuple[float, ...]
    advantages: tuple[float, ...]

    @staticmethod
    def annotation(rewards: list[float], advantages: list[float]) -> dict[str, Any]:
        """The buffer annotation (``GroupBuffer.annotate(group_id, **annotation)``) that ``of`` reads."""
        return {"rewards": list(rewards), "advantages": list(advantages)}

    @classmethod
    def of(cls, group: CompleteGroup) -> ScoredGroup:
        """The scores of a complete group annotated with ``annotation``."""
        try:
            rewards, advantages = group.extra["rewards"], group.extra["advantages"]
        except KeyError:
            raise ValueError(f"group {group.group_id} was never scored (ControllerCore._complete annotates it)") from None
        return cls(group, tuple(float(r) for r in rewards), tuple(float(a) for a in advantages))

    def informative(self) -> bool:
        """Dynamic sampling keeps a group whose members' rewards differ (an identical group has no gradient)."""
        return is_informative_group(self.rewards)


def response_metrics(group_rewards: list[list[float]], responses: list[P.Array],
                     stop_ids: Sequence[int]) -> dict[str, float]:
    """What a batch's responses look like: mean/max length in tokens, the share of groups whose rewards
    are all equal (zero advantage: no gradient), and the share of samples that stopped at their first
    token (a chat model answering with its end-of-turn token at once), and the share of the batch's
    responses that are its most common one, stop tokens left out (one answer taking over every prompt)."""
    lengths = [r.to_numpy().size for r in responses]
    stops = set(stop_ids)
    first = [n == 1 and int(r.to_numpy()[0]) in stops for n, r in zip(lengths, responses, strict=True)]
    answers = Counter(tuple(int(t) for t in r.to_numpy() if int(t) not in stops) for r in responses)
    return {"train/response_len_mean": float(np.mean(lengths)), "train/response_len_max": float(max(lengths)),
            "train/zero_variance_groups": float(np.mean([len(set(g)) <= 1 for g in group_rewards])),
            "train/first_token_stop_frac": float(np.mean(first)),
            "train/majority_answer_share": answers.most_common(1)[0][1] / len(responses)}
