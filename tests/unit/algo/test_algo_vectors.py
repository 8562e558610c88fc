"""Every test vector of docs/algorithms.md §13.1-§13.8, reproduced through the public API."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algo import (
    ObjectiveConfig,
    aggregate,
    is_weights,
    outcome_advantages,
    policy_loss,
    rejection_keep,
)
from tests.unit.algo.algo_helpers import mismatch_block, one_token, run

TOL = 1e-5


# ---------------------------------------------------------------- 13.1 advantages


@pytest.mark.parametrize(
    "rewards, expected",
    [
        ([1, 0, 0, 1], [0.866024, -0.866024, -0.866024, 0.866024]),
        ([1, 0, 0, 0], [1.499997, -0.499999, -0.499999, -0.499999]),
        ([1, 1, 1, 1], [0.0, 0.0, 0.0, 0.0]),
        ([1], [0.0]),
    ],
)
def test_grpo_advantages_match_13_1(rewards, expected):
    adv, _ = outcome_advantages(rewards)
    assert adv.astype("float32").tolist() == pytest.approx(expected, abs=TOL)  # the float32 values trained on


def test_grpo_uses_unbiased_std_not_population_std():
    adv, _ = outcome_advantages([1.0, 0, 0, 1])
    assert abs(float(adv[0]) - 0.999998) > 0.1  # population std would give +-0.999998


def test_zero_std_group_is_exactly_zero_and_counted_for_the_dapo_filter():
    adv, counts = outcome_advantages([0.1, 0.1, 0.1])
    assert adv.tolist() == [0.0, 0.0, 0.0]
    assert counts.zero_var == 1 == counts.multi  # what the controller's Scores.zero_variance is read from


def test_singleton_group_gets_zero_and_is_counted():
    adv, counts = outcome_advantages([1.0, 1.0, 0.0], [7, 3, 3])
    assert float(adv[0]) == 0.0
    assert counts.singleton == 1


# ---------------------------------------------------------------- 13.2 coupled PPO

PPO = ObjectiveConfig(objective="ppo", eps_low=0.2, eps_high=0.2, dual_clip=3.0)


@pytest.mark.parametrize(
    "A, R, loss, g, hi, lo, dual",
    [
        (+1, 1.5, -1.2, 0.0, 1, 0, 0),
        (+1, 0.5, -0.5, -0.5, 0, 0, 0),
        (-1, 0.5, 0.8, 0.0, 0, 1, 0),
        (-1, 4.0, 3.0, 0.0, 0, 0, 1),
        (-1, 2.0, 2.0, 2.0, 0, 0, 0),
    ],
)
def test_coupled_ppo_token_matches_13_2(A, R, loss, g, hi, lo, dual):
    val, grad, m = one_token(PPO, A, R)
    assert val == pytest.approx(loss, abs=TOL)
    assert grad == pytest.approx(g, abs=TOL)
    assert (m["actor/clipfrac_hi"], m["actor/clipfrac_lo"], m["actor/clipfrac_dual"]) == (hi, lo, dual)


def test_coupled_ppo_five_tokens_token_mean_and_clip_fractions():
    A = [[1, 1, -1, -1, -1]]
    R = [[1.5, 0.5, 0.5, 4.0, 2.0]]
    loss, _, m = run(PPO, [[math.log(x) for x in R[0]]], A)
    assert loss == pytest.approx(0.82, abs=TOL)
    assert m["actor/clipfrac_hi"] == pytest.approx(0.2)
    assert m["actor/clipfrac_lo"] == pytest.approx(0.2)
    assert m["actor/clipfrac_dual"] == pytest.approx(0.2)


def test_without_dual_clip_negative_token_keeps_its_gradient():
    val, grad, _ = one_token(ObjectiveConfig(objective="ppo", dual_clip=None), -1, 4.0)
    assert (val, grad) == (pytest.approx(4.0, abs=TOL), pytest.approx(4.0, abs=TOL))


def test_dapo_clip_higher_raises_only_the_upper_bound():
    dapo = ObjectiveConfig(objective="ppo", eps_low=0.2, eps_high=0.28)
    assert one_token(dapo, +1, 1.25)[:2] == (pytest.approx(-1.25, abs=TOL), pytest.approx(-1.25, abs=TOL))
    assert one_token(PPO, +1, 1.25)[:2] == (pytest.approx(-1.2, abs=TOL), pytest.approx(0.0, abs=TOL))
    assert one_token(dapo, -1, 0.75)[:2] == (pytest.approx(0.8, abs=TOL), pytest.approx(0.0, abs=TOL))


# ---------------------------------------------------------------- 13.3 decoupled / TIS / ACR

# (p^p/p^b, A, R) for tokens a..e
TOKENS_13_3 = [
    (0.5 / 0.4, +1, 1.0),
    (0.4 / 0.5, +1, 1.4),
    (0.5 / 0.2, +1, 1.0),
    (0.5 / 0.4, -1, 0.7),
    (0.5 / 0.2, -1, 0.9),
]
DECOUPLED = ObjectiveConfig(objective="decoupled", behav_cap=None)
TIS = ObjectiveConfig(objective="tis", is_cap=2.0)
ACR = ObjectiveConfig(objective="acr", is_cap=2.0)


@pytest.mark.parametrize(
    "i, dec, tis, acr",
    [
        (0, (-1.25, -1.25), (-1.25, -1.25), (-1.20, 0.0)),
        (1, (-0.96, 0.0), (-0.96, 0.0), (-1.12, -1.12)),
        (2, (-2.50, -2.50), (-2.00, -2.00), (-0.96, 0.0)),
        (3, (1.00, 0.0), (1.00, 0.0), (1.00, 0.0)),
        (4, (2.25, 2.25), (1.80, 1.80), (1.80, 1.80)),
    ],
)
def test_decoupled_tis_acr_tokens_match_13_3(i, dec, tis, acr):
    r, A, R = TOKENS_13_3[i]
    for cfg, (loss, g) in ((DECOUPLED, dec), (TIS, tis), (ACR, acr)):
        val, grad, _ = one_token(cfg, A, R, r)
        assert val == pytest.approx(loss, abs=TOL), cfg.objective
        assert grad == pytest.approx(g, abs=TOL), cfg.objective


def _five(cfg):
    delta = [[math.log(R) for _, _, R in TOKENS_13_3]]
    adv = [[A for _, A, _ in TOKENS_13_3]]
    mu = [[math.log(r) for r, _, _ in TOKENS_13_3]]
    return run(cfg, delta, adv, mu)


def test_token_means_over_a_to_e_match_13_3():
    assert _five(TIS)[0] == pytest.approx(-0.282, abs=TOL)
    loss, _, m = _five(ACR)
    assert loss == pytest.approx(-0.096, abs=TOL)
    assert m["acr/empty_band_frac"] == pytest.approx(2 / 5)  # tokens c and e: r = 2.5 > 1.2/0.8


def test_areal_mask_cap_keeps_rejected_tokens_in_the_denominator():
    loss, grad, m = _five(ObjectiveConfig(objective="decoupled", behav_cap=2.0))
    assert loss == pytest.approx(-0.242, abs=TOL)
    assert float(grad[0, 2]) == 0.0 and float(grad[0, 4]) == 0.0
    assert m["decoupled/masked_frac"] == pytest.approx(0.4)


def test_acr_with_clip_higher_matches_13_3():
    acr = ObjectiveConfig(objective="acr", is_cap=2.0, eps_high=0.28)
    loss, grad, m = one_token(acr, +1, 1.0, 1.25)
    assert (loss, grad) == (pytest.approx(-1.25, abs=TOL), pytest.approx(-1.25, abs=TOL))
    assert m["acr/hi_mean"] == pytest.approx(1.024, abs=TOL)
    assert one_token(acr, +1, 1.1, 1.25)[:2] == (pytest.approx(-1.28, abs=TOL), pytest.approx(0.0, abs=TOL))


def test_nonfinite_behaviour_logprob_removes_the_token_and_leaves_the_rest_unchanged():
    delta = [[math.log(R) for _, _, R in TOKENS_13_3]]
    adv = [[A for _, A, _ in TOKENS_13_3]]
    mu = [[math.log(r) for r, _, _ in TOKENS_13_3]]
    base, _, _ = run(TIS, [delta[0][1:]], [adv[0][1:]], [mu[0][1:]])
    mu_bad = [[math.inf] + mu[0][1:]]  # p^b = 0 at token a: l_b = -inf, mu = +inf
    loss, grad, m = run(TIS, delta, adv, mu_bad)
    assert m["mismatch/nonfinite_tokens"] == 1.0
    assert loss == pytest.approx(base, abs=TOL)
    assert float(grad[0, 0]) == 0.0 and torch.isfinite(grad).all()


# ---------------------------------------------------------------- 13.4 verl rollout correction


def test_sequence_tis_weight_is_the_capped_product_on_every_token():
    mu = torch.full((1, 3), 0.5, dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert math.exp(1.5) == pytest.approx(4.481689, abs=TOL)
    w = is_weights(mu, mask, 2.0, "sequence")
    assert w[0].tolist() == pytest.approx([2.0, 2.0, 2.0], abs=TOL)
    # through the loss: A=+1, R=1 -> lambda = -2 per token
    loss, _, m = run(ObjectiveConfig(objective="tis", is_level="sequence"), [[0.0] * 3], [[1.0] * 3], [[0.5] * 3])
    assert loss == pytest.approx(-2.0, abs=TOL)
    assert m["is/trunc_frac"] == 1.0


@pytest.mark.parametrize("threshold, kept", [("0.999_1.001", False), ("0.5_2.0", True)])
def test_geo_rs_seq_mean_k1_matches_13_4(threshold, kept):
    mu = torch.full((1, 3), 0.5)
    keep = rejection_keep(mu, torch.ones(1, 3, dtype=torch.bool), ("seq_mean_k1",), (threshold,))
    assert keep.all().item() is kept and keep.any().item() is kept
    cfg = ObjectiveConfig(objective="tis", rs_modes=("seq_mean_k1",), rs_thresholds=(threshold,))
    _, grad, m = run(cfg, [[0.0] * 3], [[1.0] * 3], [[0.5] * 3])
    assert m["rs/seq_masked_frac"] == (0.0 if kept else 1.0)
    assert bool((grad != 0).all()) is kept


def test_token_tis_weights_and_trunc_frac_match_13_4():
    mu = torch.tensor([[math.log(3), math.log(0.25)]])
    w = is_weights(mu, torch.ones(1, 2, dtype=torch.bool), 2.0, "token")
    assert w[0].tolist() == pytest.approx([2.0, 0.25], abs=TOL)
    m = mismatch_block(mu, torch.zeros(1, 2), torch.ones(1, 2), is_cap=2.0)
    assert m["is/trunc_frac"] == 0.5


# ---------------------------------------------------------------- 13.5 GSPO

GSPO = ObjectiveConfig(objective="gspo", agg="seq-mean-token-mean")


@pytest.mark.parametrize(
    "delta, A, rho, loss, g",
    [
        ([0.3, -0.1, 0.1], +1, 1.105171, -1.0004, 0.0),
        ([0.3, -0.1, 0.1], -1, 1.105171, 1.105171, 1.105171),
        ([2e-4, 2e-4], +1, 1.000200, -1.000200, -1.000200),
    ],
)
def test_gspo_sequences_match_13_5(delta, A, rho, loss, g):
    assert (GSPO.clip_low, GSPO.clip_high) == (3e-4, 4e-4)
    L = len(delta)
    val, grad, m = run(GSPO, [delta], [[A] * L])
    assert val == pytest.approx(loss, abs=TOL)
    # g is w.r.t. the mean log-prob: each token carries g / L
    assert grad[0].tolist() == pytest.approx([g / L] * L, abs=TOL)
    assert m["gspo/rho_mean"] == pytest.approx(rho, abs=TOL)


def test_gspo_per_token_gradient_of_case_2_is_0_368390():
    _, grad, _ = run(GSPO, [[0.3, -0.1, 0.1]], [[-1.0] * 3])
    assert float(grad[0, 0]) == pytest.approx(0.368390, abs=TOL)


def test_gspo_empty_response_is_excluded_from_the_sequence_count():
    delta = [[0.3, -0.1, 0.1], [0.0, 0.0, 0.0]]
    mask = [[True] * 3, [False] * 3]
    loss, grad, m = run(GSPO, delta, [[-1.0] * 3, [5.0] * 3], mask=mask)
    assert loss == pytest.approx(1.105171, abs=TOL)  # N_seq = 1
    assert grad[1].tolist() == [0.0, 0.0, 0.0]
    assert m["actor/seqs"] == 1.0


# ---------------------------------------------------------------- 13.6 TBPO

TBPO = ObjectiveConfig(
    objective="tbpo",
    tbpo_w_mode="drop",  # the 13.6 table drops sequence 3 (w = 3 outside [0.5, 2])
    agg="seq-mean-token-mean",
    tbpo_eps_pos_high=0.2,
    tbpo_eps_neg_low=0.2,
    tbpo_eps_neg_high=0.2,
    tbpo_w_low=0.5,
    tbpo_w_high=2.0,
)
# (A, rho, w) of sequences 1..4, one token each
SEQS_13_6 = [(+1, 1.1, 1.5), (-1, 1.5, 1.0), (+1, 1.0, 3.0), (-1, 0.7, 0.5)]


def _tbpo(cfg, rows):
    delta = [[math.log(rho)] for _, rho, _ in rows]
    adv = [[A] for A, _, _ in rows]
    mu = [[math.log(w)] for _, _, w in rows]
    return run(cfg, delta, adv, mu, dtype=torch.float32)


@pytest.mark.parametrize("i, loss, g", [(0, -1.65, -1.65), (1, 1.20, 0.0), (2, 0.0, 0.0), (3, 0.40, 0.0)])
def test_tbpo_sequences_match_13_6(i, loss, g):
    val, grad, _ = _tbpo(TBPO, [SEQS_13_6[i]])
    assert val == pytest.approx(loss, abs=TOL)
    assert float(grad[0, 0]) == pytest.approx(g, abs=TOL)


def test_tbpo_batch_loss_and_fractions_match_13_6():
    loss, _, m = _tbpo(TBPO, SEQS_13_6)
    assert loss == pytest.approx(-0.0125, abs=TOL)
    assert m["tbpo/seq_masked_frac"] == 0.25
    assert m["tbpo/kept_seq_frac"] == 0.75
    assert m["tbpo/neg_band_frac"] == 1.0
    assert m["tbpo/pos_clip_frac"] == 0.0
    post = ObjectiveConfig(**{**_fields(TBPO), "rejection_denominator": "post_mask"})
    assert _tbpo(post, SEQS_13_6)[0] == pytest.approx(-0.016667, abs=TOL)


def _fields(cfg):
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


# ---------------------------------------------------------------- 13.6b TBPO, default bands, w_mode

# (A, delta, mu) per response; response 6 is empty (excluded, N_seq = 5)
SEQS_13_6B = [
    (+1.0, [2e-4, 1e-4, 0.0], [0.1, -0.2, 0.4]),
    (+1.0, [1e-3, 5e-4], [-1.0, -0.6]),
    (-1.0, [-2e-4, 0.0], [0.9, 0.7]),
    (-1.0, [1e-3] * 4, [0.0, 0.0, 0.0, 0.4]),
    (-0.5, [-1e-3], [-0.3]),
    (0.0, [], []),
]


def _tbpo_13_6b(mode: str):
    width = 4
    delta = [d + [0.0] * (width - len(d)) for _, d, _ in SEQS_13_6B]
    mu = [m + [0.0] * (width - len(m)) for _, _, m in SEQS_13_6B]
    adv = [[A] * width for A, _, _ in SEQS_13_6B]
    mask = [[t < len(d) for t in range(width)] for _, d, _ in SEQS_13_6B]
    return run(ObjectiveConfig(objective="tbpo", tbpo_w_mode=mode), delta, adv, mu, mask, dtype=torch.float64)


def test_tbpo_default_w_mode_is_clamp():
    assert ObjectiveConfig(objective="tbpo").tbpo_w_mode == "clamp"
    with pytest.raises(ValueError, match="tbpo_w_mode='cut' is not valid; choose one of: clamp, drop"):
        ObjectiveConfig(objective="tbpo", tbpo_w_mode="cut")


@pytest.mark.parametrize(
    "mode, loss, g3",
    [("drop", 0.0741259067, 0.0), ("clamp", 0.3740459087, 0.1999800010)],
)
def test_tbpo_w_mode_matches_13_6b(mode, loss, g3):
    val, grad, m = _tbpo_13_6b(mode)
    assert val == pytest.approx(loss, abs=1e-10)
    assert grad[0, :3].tolist() == pytest.approx([-0.0736854294] * 3, abs=1e-10)
    assert grad[2, :2].tolist() == pytest.approx([g3] * 2, abs=1e-10)
    for i in (1, 3, 4, 5):  # 2 and 4 are clipped (rho above the band), 5 below it, 6 empty
        assert grad[i].abs().max().item() == 0.0
    assert grad[0, 3].item() == grad[2, 2:].abs().max().item() == 0.0
    # responses 2 (w = e^-0.8 < 0.5, A > 0) and 3 (w = e^0.8 > 2, A < 0) are outside the w band
    name = "tbpo/w_clamped_frac" if mode == "clamp" else "tbpo/seq_masked_frac"
    assert m[name] == pytest.approx(2 / 5)
    assert m[f"{name}/pos"] == pytest.approx(1 / 2)
    assert m[f"{name}/neg"] == pytest.approx(1 / 3)
    assert m["tbpo/kept_seq_frac"] == pytest.approx(1.0 if mode == "clamp" else 3 / 5)


# ---------------------------------------------------------------- 13.7 aggregation


def _agg_inputs():
    values = torch.tensor([[2.0, 0, 0], [1.0, 1, 1], [0.0, 0, 0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    return values, mask


@pytest.mark.parametrize(
    "agg, expected", [("token-mean", 1.25), ("seq-mean-token-mean", 1.5), ("seq-mean-token-sum", 2.5)]
)
def test_aggregation_modes_match_13_7(agg, expected):
    values, mask = _agg_inputs()
    assert float(aggregate(values, mask, agg)) == pytest.approx(expected, abs=TOL)
    parts = [aggregate(values[i : i + 1], mask[i : i + 1], agg, num_tokens=4, num_seqs=2) for i in range(3)]
    assert float(sum(parts)) == pytest.approx(expected, abs=1e-7)


def test_aggregation_through_policy_loss_with_split_micro_batches():
    # lambda = -A R with R = 1, A = -value (unclipped): token losses 2 | 1 1 1 | (empty)
    cfg = ObjectiveConfig(objective="ppo", agg="seq-mean-token-mean")
    values, mask = _agg_inputs()
    logp = torch.zeros(3, 3)
    whole, _ = policy_loss(logp, logp, None, -values, mask, cfg)
    parts = [
        policy_loss(
            logp[i : i + 1],
            logp[i : i + 1],
            None,
            -values[i : i + 1],
            mask[i : i + 1],
            cfg,
            num_tokens=4,
            num_seqs=2,
        )[0]
        for i in range(3)
    ]
    assert float(whole) == pytest.approx(1.5, abs=TOL)
    assert float(sum(parts)) == pytest.approx(float(whole), abs=1e-7)


# ---------------------------------------------------------------- 13.8 mismatch metrics


def test_mismatch_metrics_match_13_8():
    mu = torch.tensor([[math.log(2), math.log(0.5), 0.0, 0.0]])
    m = mismatch_block(mu, torch.zeros(1, 4), torch.ones(1, 4), is_cap=1.5)
    assert m["mismatch/kl_k1"] == pytest.approx(0.0, abs=TOL)
    assert m["mismatch/kl_k2"] == pytest.approx(0.120113, abs=TOL)
    assert m["mismatch/kl_k3"] == pytest.approx(0.125, abs=TOL)
    assert m["mismatch/chi2_token"] == pytest.approx(0.5625, abs=TOL)
    assert m["is/ess_raw"] == pytest.approx(0.81, abs=TOL)
    assert m["is/ess_trunc"] == pytest.approx(0.888889, abs=TOL)
