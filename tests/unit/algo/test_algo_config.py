"""ObjectiveConfig: §11 defaults, frozen/hashable, and validation messages that name the fix."""

from __future__ import annotations

import dataclasses

import pytest

from asyncrl.algo import OBJECTIVES, ObjectiveConfig


def test_defaults_follow_section_11():
    c = ObjectiveConfig()
    assert c.objective == "acr" and c.is_level == "token" and c.aggregation == "token-mean"
    assert (c.eps_low, c.eps_high, c.agg) == (None, None, None)  # what the user wrote: nothing
    assert (c.clip_low, c.clip_high, c.dual_clip, c.is_cap, c.behav_cap) == (0.2, 0.2, 3.0, 2.0, 5.0)
    assert (c.tbpo_eps_pos_high, c.tbpo_eps_neg_low, c.tbpo_eps_neg_high) == (4e-4, 3e-4, 4e-4)
    assert (c.tbpo_w_low, c.tbpo_w_high) == (0.5, 2.0)
    assert (c.kl_coef, c.entropy_coef, c.rejection_denominator) == (0.0, 0.0, "pre_mask")
    assert c.abort_on_nonfinite_theta is True and c.eta_max is None


def test_gspo_gets_its_own_clip_range_unless_overridden():
    gspo = ObjectiveConfig(objective="gspo")
    assert (gspo.clip_low, gspo.clip_high) == (3e-4, 4e-4)
    assert ObjectiveConfig(objective="gspo", eps_high=0.5).clip_high == 0.5


def test_sequence_objectives_default_to_seq_mean_token_mean():
    seq = "seq-mean-token-mean"
    assert ObjectiveConfig(objective="gspo").aggregation == ObjectiveConfig(objective="tbpo").aggregation == seq
    assert ObjectiveConfig(objective="gspo", agg="token-mean").aggregation == "token-mean"
    assert ObjectiveConfig(objective="acr").aggregation == "token-mean"


def test_config_is_frozen_and_hashable_even_from_lists():
    c = ObjectiveConfig(objective="tis", rs_modes=["token_k1"], rs_thresholds=[" 0.5_2.0"])
    assert c.rs_modes == ("token_k1",) and isinstance(c.rs_thresholds, tuple)
    hash(c)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.objective = "ppo"


def test_unknown_objective_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        ObjectiveConfig(objective="grpo")
    assert all(k in str(err.value) for k in OBJECTIVES)


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        ({"agg": "mean"}, "token-mean"),
        ({"is_level": "seq"}, "sequence"),
        ({"rejection_denominator": "post"}, "post_mask"),
        ({"eps_low": 1.2}, "(0, 1)"),
        ({"eps_high": 0.0}, "> 0"),
        ({"dual_clip": 1.0}, "null to disable"),
        ({"is_cap": -1.0}, "TIS cap"),
        ({"objective": "tis", "is_cap": None}, "objective=decoupled"),
        ({"objective": "acr", "is_level": "sequence"}, "is_level=token"),
        ({"behav_cap": 0.0}, "null for no mask"),
        ({"tbpo_w_low": 3.0}, "tbpo_w_low <= tbpo_w_high"),
        ({"kl_coef": -1.0}, "0 disables"),
        ({"eta_max": -1}, "int >= 0"),
        ({"eps_low": float("nan")}, "finite"),
        ({"rs_modes": ("token_k1",)}, "one threshold per mask"),
        ({"rs_modes": ("token_k4",), "rs_thresholds": ("1",)}, "seq_mean_k1"),
        ({"rs_modes": ("seq_mean_k1",), "rs_thresholds": ("2.0",)}, "'lo_hi'"),
        ({"rs_modes": ("seq_mean_k1",), "rs_thresholds": ("2_1",)}, "0 < lo <= hi"),
        ({"rs_modes": ("token_k3",), "rs_thresholds": ("abc",)}, "upper bound"),
        ({"objective": "tbpo", "rs_modes": ("token_k3",), "rs_thresholds": ("1",)}, "rs_modes=[]"),
        ({"abort_on_nonfinite_theta": 1}, "true or false"),
    ],
)
def test_invalid_settings_raise_value_error_naming_the_fix(kwargs, fix):
    with pytest.raises(ValueError, match=None) as err:
        ObjectiveConfig(**kwargs)
    assert fix in str(err.value)


def test_is_cap_may_be_none_for_gspo_and_decoupled():
    assert ObjectiveConfig(objective="gspo", is_cap=None).is_cap is None
    assert ObjectiveConfig(objective="decoupled", is_cap=None, behav_cap=None).behav_cap is None
