"""§3 advantages and sample selection beyond the §13.1 vectors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.algo import (
    apply_truncation_policy,
    filter_groups,
    group_advantages,
    is_informative_group,
    overlong_penalty,
    token_advantages,
)


def test_dr_grpo_is_the_centred_reward():
    adv, _ = group_advantages(torch.tensor([1.0, 0, 0, 0]), estimator="drgrpo")
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_rloo_is_the_reward_minus_the_mean_of_the_others():
    r = [3.0, 1.0, 0.0, 2.0]
    adv, _ = group_advantages(torch.tensor(r), estimator="rloo")
    expected = [r[i] - (sum(r) - r[i]) / 3 for i in range(4)]
    assert adv.tolist() == pytest.approx(expected)


def test_groups_are_identified_by_arbitrary_ids_in_any_order():
    rewards = torch.tensor([1.0, 5.0, 0.0, 5.0, 0.0, 1.0])
    ids = torch.tensor([42, 7, 42, 7, 42, 9])
    adv, m = group_advantages(rewards, ids)
    a42, _ = group_advantages(torch.tensor([1.0, 0.0, 0.0]))
    assert adv[[0, 2, 4]].tolist() == pytest.approx(a42.tolist())
    assert adv[[1, 3]].tolist() == [0.0, 0.0]  # zero variance
    assert float(adv[5]) == 0.0  # singleton
    assert m["adv/singleton_groups"] == 1.0 and m["adv/groups"] == 3.0
    assert m["adv/zero_std_group_frac"] == 0.5  # of the two groups with G >= 2


def test_nonfinite_rewards_are_rejected_with_the_fix():
    with pytest.raises(ValueError, match="verifier"):
        group_advantages(torch.tensor([1.0, math.nan]))
    with pytest.raises(ValueError, match="grpo, drgrpo, rloo"):
        group_advantages(torch.tensor([1.0, 0.0]), estimator="ppo")


@settings(max_examples=50, deadline=None)
@given(
    rewards=st.lists(st.floats(-5, 5, allow_nan=False), min_size=2, max_size=12),
    estimator=st.sampled_from(["grpo", "drgrpo", "rloo"]),
)
def test_group_advantages_sum_to_zero_and_ignore_a_reward_shift(rewards, estimator):
    r = torch.tensor(rewards, dtype=torch.float64)
    adv, _ = group_advantages(r, estimator=estimator)
    shifted, _ = group_advantages(r + 3.0, estimator=estimator)
    assert abs(float(adv.sum())) < 1e-6 * max(1.0, float(adv.abs().sum()))
    if float(r.max() - r.min()) > 1e-3:  # shift invariance up to float rounding of the mean
        torch.testing.assert_close(adv, shifted, atol=1e-6, rtol=1e-6)


def test_grpo_is_scale_invariant_for_a_spread_group():
    a, _ = group_advantages(torch.tensor([0.0, 1, 2, 3], dtype=torch.float64))
    b, _ = group_advantages(torch.tensor([0.0, 10, 20, 30], dtype=torch.float64))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_token_advantages_broadcast_onto_the_mask():
    out = token_advantages(torch.tensor([2.0, -1.0]), torch.tensor([[1, 1, 0], [0, 0, 0]]))
    assert out.tolist() == [[2.0, 2.0, 0.0], [0.0, 0.0, 0.0]]


def test_overlong_penalty_is_linear_inside_the_buffer_and_validates_its_arguments():
    out = overlong_penalty(torch.tensor([90, 95, 100, 101]), max_len=100, cache_len=10, penalty_factor=2.0)
    assert out.tolist() == pytest.approx([0.0, -1.0, -2.0, -2.0])
    with pytest.raises(ValueError, match="cache_len <= max_len"):
        overlong_penalty(torch.tensor([1]), max_len=10, cache_len=20)


@pytest.mark.parametrize("policy", ["keep", "mask", "overlong_shaping"])
def test_truncation_policy_keeps_masks_or_shapes_rewards(policy):
    rewards = torch.tensor([1.0, 0.0])
    lengths = torch.tensor([18432, 20480])
    truncated = torch.tensor([False, True])
    r, keep = apply_truncation_policy(rewards, lengths, truncated, policy=policy)
    if policy == "keep":
        assert r.tolist() == [1.0, 0.0] and keep.all()
    elif policy == "mask":
        assert r.tolist() == [1.0, 0.0] and keep.tolist() == [True, False]
    else:
        assert r.tolist() == pytest.approx([0.5, -1.0]) and keep.all()


def test_dynamic_sampling_keeps_only_groups_with_differing_accuracy():
    assert (
        is_informative_group([1, 0, 1]) and not is_informative_group([0, 0]) and not is_informative_group([])
    )
    keep, m = filter_groups(torch.tensor([1.0, 1, 0, 1, 0, 0]), torch.tensor([0, 0, 1, 1, 2, 2]))
    assert keep.tolist() == [False, False, True, True, False, False]
    assert m["data/filtered_group_frac"] == pytest.approx(2 / 3) and m["data/filtered_groups"] == 2.0
