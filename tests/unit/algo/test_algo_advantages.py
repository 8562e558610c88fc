"""§3.1 group advantages (``outcome_advantages``, the controller's) beyond the §13.1 vectors."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.algo import GroupCounts, outcome_advantages


def test_dr_grpo_is_the_centred_reward():
    adv, _ = outcome_advantages([1.0, 0, 0, 0], estimator="drgrpo")
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_rloo_is_the_reward_minus_the_mean_of_the_others():
    r = [3.0, 1.0, 0.0, 2.0]
    adv, _ = outcome_advantages(r, estimator="rloo")
    expected = [r[i] - (sum(r) - r[i]) / 3 for i in range(4)]
    assert adv.tolist() == pytest.approx(expected)


def test_groups_are_identified_by_arbitrary_ids_in_any_order():
    rewards = [1.0, 5.0, 0.0, 5.0, 0.0, 1.0]
    adv, counts = outcome_advantages(rewards, [42, 7, 42, 7, 42, 9])
    a42, _ = outcome_advantages([1.0, 0.0, 0.0])
    assert adv[[0, 2, 4]].tolist() == pytest.approx(a42.tolist())
    assert adv[[1, 3]].tolist() == [0.0, 0.0]  # zero variance
    assert float(adv[5]) == 0.0  # singleton
    assert counts == GroupCounts(groups=3, singleton=1, zero_var=1, multi=2)


def test_nonfinite_rewards_are_rejected_with_the_fix():
    with pytest.raises(ValueError, match="verifier"):
        outcome_advantages([1.0, math.nan])
    with pytest.raises(ValueError, match="grpo, drgrpo, rloo"):
        outcome_advantages([1.0, 0.0], estimator="ppo")


@settings(max_examples=50, deadline=None)
@given(
    rewards=st.lists(st.floats(-5, 5, allow_nan=False), min_size=2, max_size=12),
    estimator=st.sampled_from(["grpo", "drgrpo", "rloo"]),
)
def test_group_advantages_sum_to_zero_and_ignore_a_reward_shift(rewards, estimator):
    r = np.asarray(rewards, dtype=np.float64)
    adv, _ = outcome_advantages(r, estimator=estimator)
    shifted, _ = outcome_advantages(r + 3.0, estimator=estimator)
    assert abs(float(adv.sum())) < 1e-6 * max(1.0, float(np.abs(adv).sum()))
    if float(r.max() - r.min()) > 1e-3:  # shift invariance up to float rounding of the mean
        np.testing.assert_allclose(adv, shifted, atol=1e-6, rtol=1e-6)


def test_grpo_is_scale_invariant_for_a_spread_group():
    a, _ = outcome_advantages([0.0, 1, 2, 3])
    b, _ = outcome_advantages([0.0, 10, 20, 30])
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
