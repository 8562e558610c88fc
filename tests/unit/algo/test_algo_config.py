"""ObjectiveConfig: §11 defaults, frozen/hashable, and validation messages that name the fix."""

from __future__ import annotations

import dataclasses

import pytest

from asyncrl.algo import KINDS, ObjectiveConfig


def test_defaults_follow_section_11():
    c = ObjectiveConfig()
    assert c.kind == "tis" and c.is_level == "token" and c.agg == "token-mean"
    assert (c.eps_low, c.eps_high, c.dual_clip, c.is_cap, c.behav_cap) == (0.2, 0.2, 3.0, 2.0, 5.0)
    assert (c.tbpo_eps_pos_high, c.tbpo_eps_neg_low, c.tbpo_eps_neg_high) == (4e-4, 3e-4, 4e-4)
    assert (c.tbpo_w_low, c.tbpo_w_high) == (0.5, 2.0)
    assert (c.kl_coef, c.entropy_coef, c.rejection_denominator) == (0.0, 0.0, "pre_mask")
    assert c.abort_on_nonfinite_theta is True and c.eta_max is None


def test_gspo_gets_its_own_clip_range_unless_overridden():
    assert (ObjectiveConfig(kind="gspo").eps_low, ObjectiveConfig(kind="gspo").eps_high) == (3e-4, 4e-4)
    assert ObjectiveConfig(kind="gspo", eps_high=0.5).eps_high == 0.5


def test_sequence_objectives_default_to_seq_mean_token_mean():
    assert ObjectiveConfig(kind="gspo").agg == ObjectiveConfig(kind="tbpo").agg == "seq-mean-token-mean"
    assert ObjectiveConfig(kind="gspo", agg="token-mean").agg == "token-mean"
    assert ObjectiveConfig(kind="acr").agg == "token-mean"


def test_config_is_frozen_and_hashable_even_from_lists():
    c = ObjectiveConfig(kind="tis", rs_modes=["token_k1"], rs_thresholds=[" 0.5_2.0"])
    assert c.rs_modes == ("token_k1",) and isinstance(c.rs_thresholds, tuple)
    hash(c)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.kind = "ppo"


def test_unknown_kind_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        ObjectiveConfig(kind="grpo")
    assert all(k in str(err.value) for k in KINDS)


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        ({"agg": "mean"}, "token-mean"),
        ({"is_level": "seq"}, "sequence"),
        ({"rejection_denominator": "post"}, "post_mask"),
        ({"eps_low": 1.2}, "(0, 1)"),
        ({"eps_high": 0.0}, "> 0"),
        ({"dual_clip": 1.0}, "None to disable"),
        ({"is_cap": -1.0}, "TIS cap"),
        ({"kind": "tis", "is_cap": None}, "kind='decoupled'"),
        ({"kind": "acr", "is_level": "sequence"}, "is_level='token'"),
        ({"behav_cap": 0.0}, "None for no mask"),
        ({"tbpo_w_low": 3.0}, "tbpo_w_low <= tbpo_w_high"),
        ({"kl_coef": -1.0}, "0 disables"),
        ({"eta_max": -1}, "int >= 0"),
        ({"eps_low": float("nan")}, "finite"),
        ({"rs_modes": ("token_k1",)}, "one threshold per mask"),
        ({"rs_modes": ("token_k4",), "rs_thresholds": ("1",)}, "seq_mean_k1"),
        ({"rs_modes": ("seq_mean_k1",), "rs_thresholds": ("2.0",)}, "'lo_hi'"),
        ({"rs_modes": ("seq_mean_k1",), "rs_thresholds": ("2_1",)}, "0 < lo <= hi"),
        ({"rs_modes": ("token_k3",), "rs_thresholds": ("abc",)}, "upper bound"),
        ({"kind": "tbpo", "rs_modes": ("token_k3",), "rs_thresholds": ("1",)}, "rs_modes=()"),
        ({"abort_on_nonfinite_theta": 1}, "True or False"),
    ],
)
def test_invalid_settings_raise_value_error_naming_the_fix(kwargs, fix):
    with pytest.raises(ValueError, match=None) as err:
        ObjectiveConfig(**kwargs)
    assert fix in str(err.value)


def test_is_cap_may_be_none_for_gspo_and_decoupled():
    assert ObjectiveConfig(kind="gspo", is_cap=None).is_cap is None
    assert ObjectiveConfig(kind="decoupled", is_cap=None, behav_cap=None).behav_cap is None
