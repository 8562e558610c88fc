"""§2 numerics: non-finite inputs, empty responses and batches, extreme ratios, staleness filter,
and the input errors that must name their fix."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.algo import OBJECTIVES, ObjectiveConfig, loss_denominators, policy_loss
from tests.unit.algo.algo_helpers import random_batch

ALL_KINDS = [
    ObjectiveConfig(objective=k, **({"agg": "seq-mean-token-mean"} if k in ("gspo", "tbpo") else {}))
    for k in OBJECTIVES
]


def _call(cfg, b, logp=None, **kw):
    lp = (b["logp"] if logp is None else logp).clone().requires_grad_(True)
    loss, m = policy_loss(lp, b["prox"], b["behav"], b["adv"], b["mask"], cfg, **kw)
    loss.backward()
    return loss.detach(), lp.grad, m


def _finite(loss, grad):
    return bool(torch.isfinite(loss)) and bool(torch.isfinite(grad).all())


@pytest.mark.parametrize("cfg", ALL_KINDS, ids=OBJECTIVES)
def test_nan_and_inf_inputs_give_a_finite_loss_and_are_counted(cfg):
    b = random_batch(1, dtype=torch.float32, nonfinite=True)  # NaN behav at (0,0), inf adv at (2,0)
    loss, grad, m = _call(cfg, b)
    assert _finite(loss, grad)
    expected = 1 if cfg.objective == "ppo" else 2  # ppo ignores behav_logp entirely
    assert m["mismatch/nonfinite_tokens"] == expected
    assert m["mismatch/nonfinite_seqs"] == expected
    assert float(grad[2, 0]) == 0.0


@pytest.mark.parametrize("kind", ["gspo", "tbpo"])
def test_sequence_objectives_drop_the_whole_response_with_a_nonfinite_input(kind):
    cfg = ObjectiveConfig(objective=kind, tbpo_w_low=0.01, tbpo_w_high=100.0)
    b = random_batch(2, dtype=torch.float32)
    b["mask"][0] = True
    clean = _call(cfg, b)[2]["actor/tokens"]
    b["behav"][0, 3] = -math.inf
    _, grad, m = _call(cfg, b)
    assert m["actor/tokens"] == clean - b["mask"][0].sum().item()
    assert grad[0].abs().sum() == 0.0
    assert m["mismatch/nonfinite_tokens"] == 1.0


def test_sequence_tis_also_drops_the_whole_response():
    cfg = ObjectiveConfig(objective="tis", is_level="sequence")
    b = random_batch(2, dtype=torch.float32)
    b["mask"][0] = True
    b["prox"][0, 2] = math.nan
    _, grad, m = _call(cfg, b)
    assert grad[0].abs().sum() == 0.0 and m["mismatch/nonfinite_seqs"] == 1.0


@pytest.mark.parametrize("abort", [True, False])
def test_nonfinite_current_logprob_is_masked_counted_and_flags_the_step(abort):
    cfg = ObjectiveConfig(objective="acr", abort_on_nonfinite_theta=abort)
    b = random_batch(3, dtype=torch.float32)
    b["mask"][0, 0] = True
    logp = b["logp"].clone()
    logp[0, 0] = math.nan
    loss, grad, m = _call(cfg, b, logp=logp)
    assert _finite(loss, grad) and float(grad[0, 0]) == 0.0
    assert m["actor/nonfinite_logp_theta"] == 1.0
    assert m["actor/skip_step"] == (1.0 if abort else 0.0)
    # DEPARTURE: the token stays in the denominator (decided before the forward pass)
    assert loss_denominators(b["prox"], b["behav"], b["adv"], b["mask"], cfg).num_tokens == m["actor/tokens"]


def test_garbage_outside_the_mask_is_ignored_entirely():
    cfg = ObjectiveConfig(objective="tis")
    b = random_batch(4, dtype=torch.float32)
    ref_loss, ref_grad, _ = _call(cfg, b)
    for key in ("logp", "prox", "behav", "adv"):
        b[key] = torch.where(b["mask"], b[key], torch.full_like(b[key], math.nan))
    loss, grad, m = _call(cfg, b)
    assert float(loss.detach()) == pytest.approx(float(ref_loss.detach()), abs=1e-7)
    torch.testing.assert_close(grad, ref_grad)
    assert m["mismatch/nonfinite_tokens"] == 0.0


@pytest.mark.parametrize("cfg", ALL_KINDS, ids=OBJECTIVES)
@pytest.mark.parametrize("shape", [(3, 0), (0, 4), (2, 3)], ids=["zero-length", "zero-rows", "all-masked"])
def test_batch_without_a_valid_token_gives_zero_loss_and_a_skip_flag(cfg, shape):
    z = torch.zeros(shape)
    mask = torch.zeros(shape, dtype=torch.bool)
    logp = z.clone().requires_grad_(True)
    loss, m = policy_loss(logp, z, z, z, mask, cfg)
    loss.backward()
    assert float(loss.detach()) == 0.0 and loss.requires_grad
    assert m["actor/skip_step"] == 1.0
    assert m["actor/tokens"] == 0.0 and m["actor/seqs"] == 0.0
    assert "actor/clipfrac_hi" not in m  # a mean over nothing is not reported


def test_empty_micro_batch_of_a_non_empty_step_is_not_flagged():
    z = torch.zeros(2, 3)
    loss, m = policy_loss(
        z, z, z, z, torch.zeros(2, 3, dtype=torch.bool), ObjectiveConfig(objective="tis"), num_tokens=10, num_seqs=3
    )
    assert float(loss) == 0.0 and m["actor/skip_step"] == 0.0


@pytest.mark.parametrize("cfg", ALL_KINDS, ids=OBJECTIVES)
def test_extreme_log_ratios_stay_finite(cfg):
    b = random_batch(5, dtype=torch.float32)
    b["logp"] = b["prox"] + torch.tensor([1e4, -1e4, 60.0, -60.0, 0.0]).repeat(6, 1)
    b["behav"] = b["prox"] - torch.tensor([-1e4, 1e4, 30.0, -30.0, 0.0]).repeat(6, 1)
    loss, grad, m = _call(cfg, b)
    assert _finite(loss, grad)
    if cfg.objective != "ppo":
        assert m["mismatch/r_max"] > 1e13  # reported from the unclamped log value (§2.3)


def test_low_precision_inputs_are_computed_in_float32():
    b = random_batch(6, dtype=torch.float32)
    lp16 = b["logp"].to(torch.bfloat16).requires_grad_(True)
    loss, _ = policy_loss(
        lp16, b["prox"].bfloat16(), b["behav"].bfloat16(), b["adv"], b["mask"], ObjectiveConfig(objective="tis")
    )
    assert loss.dtype == torch.float32


def test_rejected_tokens_stay_in_the_denominator_unless_post_mask():
    b = random_batch(7, dtype=torch.float32, mu_scale=1.0)
    pre = ObjectiveConfig(objective="decoupled", behav_cap=1.2)
    post = ObjectiveConfig(objective="decoupled", behav_cap=1.2, rejection_denominator="post_mask")
    d_pre = loss_denominators(b["prox"], b["behav"], b["adv"], b["mask"], pre)
    d_post = loss_denominators(b["prox"], b["behav"], b["adv"], b["mask"], post)
    assert d_pre.num_tokens == b["mask"].sum() > d_post.num_tokens > 0
    l_pre = _call(pre, b)[0]
    l_post = _call(post, b)[0]
    assert float(l_post) == pytest.approx(float(l_pre) * d_pre.num_tokens / d_post.num_tokens, rel=1e-5)


@pytest.mark.parametrize("level, dropped", [("token", 2), ("sequence", 3)])
def test_eta_max_drops_stale_tokens_before_the_denominator(level, dropped):
    cfg = ObjectiveConfig(objective="tis", eta_max=1, stale_level=level)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    versions = torch.tensor([[5, 3, 5], [4, 5, -1]], dtype=torch.int32)  # learner 5: staleness 0 2 0 | 1 0
    versions[0, 2] = 3  # -> row 0 has two stale tokens
    z = torch.zeros(2, 3)
    loss, m = policy_loss(z, z, z, torch.ones(2, 3), mask, cfg, versions=versions, learner_version=5)
    assert m["stale/dropped_tokens"] == dropped
    assert m["stale/dropped_frac"] == pytest.approx(dropped / 5)
    assert m["actor/tokens"] == 5 - dropped
    assert (
        loss_denominators(z, z, z, mask, cfg, versions=versions, learner_version=5).num_tokens == 5 - dropped
    )


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(OBJECTIVES),
    values=st.lists(
        st.sampled_from([0.0, -0.5, 1.0, -3.0, 25.0, -25.0, 1e30, -1e30, math.nan, math.inf, -math.inf]),
        min_size=4 * 3 * 4,
        max_size=4 * 3 * 4,
    ),
    mask_bits=st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_any_inputs_including_nonfinite_give_a_finite_loss_and_gradient(kind, values, mask_bits):
    t = torch.tensor(values, dtype=torch.float32).reshape(4, 3, 4)
    mask = torch.tensor(mask_bits).reshape(3, 4)
    logp = t[0].clone().requires_grad_(True)
    loss, m = policy_loss(logp, t[1], t[2], t[3], mask, ObjectiveConfig(objective=kind))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    # exp of an unclamped log value may overflow to inf (r_max, ratio_max); an overflowing loss (|A| ~ 1e30)
    # is returned as 0, flagged for skipping, and its parts keep their raw value for diagnosis
    overflow = m["actor/nonfinite_loss"] == 1.0
    if overflow:
        assert m["actor/skip_step"] == 1.0 and m["actor/loss"] == 0.0
    raw = ("actor/pg_loss", "actor/kl_loss", "actor/entropy_loss") if overflow else ()
    bad = [k for k, v in m.items() if not math.isfinite(v)]
    assert all(k in raw or (k in ("mismatch/r_max", "actor/ratio_max") and m[k] == math.inf) for k in bad), (
        bad
    )


# ---------------------------------------------------------------- input errors


def test_errors_name_the_fix():
    z = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="needs behav_logp"):
        policy_loss(z, z, None, z, mask, ObjectiveConfig(objective="tis"))
    with pytest.raises(ValueError, match="must be \\[B, T\\]"):
        policy_loss(z, z, z, torch.zeros(2, 4), mask, ObjectiveConfig(objective="tis"))
    with pytest.raises(ValueError, match="needs ref_logp"):
        policy_loss(z, z, z, z, mask, ObjectiveConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="needs entropy"):
        policy_loss(z, z, z, z, mask, ObjectiveConfig(entropy_coef=0.1))
    with pytest.raises(ValueError, match="loss_denominators"):
        policy_loss(z, z, z, z, mask, ObjectiveConfig(objective="tis"), num_tokens=3)
    with pytest.raises(ValueError, match="pass versions and learner_version"):
        policy_loss(z, z, z, z, mask, ObjectiveConfig(eta_max=2))
    with pytest.raises(ValueError, match="newer than learner_version"):
        policy_loss(z, z, z, z, mask, ObjectiveConfig(objective="tis"), versions=torch.full((2, 3), 4), learner_version=3)
    with pytest.raises(ValueError, match="ObjectiveConfig"):
        policy_loss(z, z, z, z, mask, {"objective": "tis"})


def test_per_sequence_advantages_broadcast_over_tokens():
    b = random_batch(8, dtype=torch.float32, per_sequence_adv=True)
    cfg = ObjectiveConfig(objective="tis")
    full, _ = policy_loss(b["logp"], b["prox"], b["behav"], b["adv"], b["mask"], cfg)
    short, _ = policy_loss(b["logp"], b["prox"], b["behav"], b["adv"][:, 0], b["mask"], cfg)
    assert float(full) == float(short)
