"""Gradients: torch.autograd.gradcheck in float64 for every kind, and micro-batch / rank splits with
global denominators reproducing the whole-batch loss and gradient (§5)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.algo import AGGREGATIONS, ObjectiveConfig, loss_denominators, merge_metrics, policy_loss
from tests.unit.algo.algo_helpers import random_batch

WIDE = {"eps_low": 0.2, "eps_high": 0.25}
CONFIGS = {
    "ppo": ObjectiveConfig(objective="ppo"),
    "ppo_no_dual": ObjectiveConfig(objective="ppo", dual_clip=None, eps_high=0.28),
    "decoupled": ObjectiveConfig(objective="decoupled", behav_cap=1.5),
    "tis": ObjectiveConfig(objective="tis", is_cap=1.3),
    "tis_seq": ObjectiveConfig(objective="tis", is_cap=2.0, is_level="sequence"),
    "tis_rs": ObjectiveConfig(
        objective="tis", rs_modes=("token_k3", "seq_mean_k1"), rs_thresholds=("0.3", "0.6_1.6")
    ),
    "acr": ObjectiveConfig(objective="acr", is_cap=2.0),
    "gspo": ObjectiveConfig(objective="gspo", agg="seq-mean-token-mean", **WIDE),
    "gspo_seq_is": ObjectiveConfig(objective="gspo", is_level="sequence", is_cap=1.5, **WIDE),
    "tbpo": ObjectiveConfig(
        objective="tbpo",
        agg="seq-mean-token-mean",
        tbpo_eps_pos_high=0.2,
        tbpo_eps_neg_low=0.2,
        tbpo_eps_neg_high=0.2,
        tbpo_w_low=0.7,
        tbpo_w_high=1.4,
    ),
}


def _args(b):
    return b["prox"], b["behav"], b["adv"], b["mask"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gradcheck_float64_for_each_kind(name):
    cfg = CONFIGS[name]
    b = random_batch(11, delta_scale=0.15 if cfg.objective in ("gspo", "tbpo") else 0.3)
    logp = b["logp"].clone().requires_grad_(True)

    def f(lp):
        return policy_loss(lp, *_args(b), cfg, compute_dtype=torch.float64)[0]

    assert torch.autograd.gradcheck(f, (logp,), eps=1e-6, atol=1e-7)
    f(logp).backward()
    assert logp.grad.abs().sum() > 0, "the check must exercise a non-zero gradient"


def test_gradcheck_gspo_at_its_default_band():
    cfg = ObjectiveConfig(objective="gspo", agg="seq-mean-token-mean")
    b = random_batch(5, delta_scale=1e-4)
    logp = b["logp"].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda lp: policy_loss(lp, *_args(b), cfg, compute_dtype=torch.float64)[0],
        (logp,),
        eps=1e-8,
        atol=1e-7,
    )


def test_gradcheck_with_kl_and_entropy_terms():
    cfg = ObjectiveConfig(objective="acr", kl_coef=0.05, entropy_coef=0.01, agg="seq-mean-token-sum")
    b = random_batch(3)
    ref = b["prox"] + 0.1
    logp = b["logp"].clone().requires_grad_(True)
    ent = torch.rand_like(logp).requires_grad_(True)

    def f(lp, h):
        return policy_loss(lp, *_args(b), cfg, ref_logp=ref, entropy=h, compute_dtype=torch.float64)[0]

    assert torch.autograd.gradcheck(f, (logp, ent), eps=1e-6, atol=1e-7)


def _split_equals_whole(cfg, b, cuts, *, atol=1e-6):
    kw = {"versions": b["versions"], "learner_version": 6}
    logp = b["logp"].clone().requires_grad_(True)
    whole, m_whole = policy_loss(logp, *_args(b), cfg, **kw)
    whole.backward()
    g_whole = logp.grad.clone()

    bounds = [0, *cuts, b["mask"].shape[0]]
    pieces = [{k: v[s:e] for k, v in b.items()} for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    total = None
    for p in pieces:  # the learner sums these over micro-batches and ranks before the first forward
        d = loss_denominators(*_args(p), cfg, versions=p["versions"], learner_version=6)
        total = d if total is None else total + d
    logp2 = b["logp"].clone().requires_grad_(True)
    loss_sum, parts = 0.0, []
    for (s, e), p in zip(zip(bounds[:-1], bounds[1:], strict=True), pieces, strict=True):
        lp = logp2[s:e]
        loss, m = policy_loss(
            lp,
            *_args(p),
            cfg,
            num_tokens=total.num_tokens,
            num_seqs=total.num_seqs,
            versions=p["versions"],
            learner_version=6,
        )
        loss.backward()
        loss_sum += float(loss.detach())
        parts.append(m)
    assert loss_sum == pytest.approx(float(whole.detach()), abs=atol)
    torch.testing.assert_close(logp2.grad, g_whole, atol=atol, rtol=0)
    return m_whole, merge_metrics(parts)


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_micro_batches_with_global_denominators_equal_the_whole_batch(name, agg):
    cfg = ObjectiveConfig(
        **{**{f: getattr(CONFIGS[name], f) for f in CONFIGS[name].__dataclass_fields__}, "agg": agg}
    )
    b = random_batch(7, B=8, T=6, dtype=torch.float32, nonfinite=True)
    _split_equals_whole(cfg, b, [3, 5])


def test_post_mask_denominators_split_like_the_whole_batch():
    cfg = ObjectiveConfig(objective="decoupled", behav_cap=1.2, rejection_denominator="post_mask")
    _split_equals_whole(cfg, random_batch(8, B=8, T=6, dtype=torch.float32), [2, 4, 7])


def test_merged_micro_batch_metrics_equal_whole_batch_metrics():
    cfg = ObjectiveConfig(objective="tis", eta_max=1)
    m_whole, m_merged = _split_equals_whole(cfg, random_batch(9, B=8, T=6, dtype=torch.float32), [1, 4])
    for name, v in m_whole.items():
        if name == "mismatch/log_r_p99":  # merged as the max of the parts: an upper bound
            assert m_merged[name] >= v - 1e-6
        elif name not in ("actor/skip_step",):
            assert m_merged[name] == pytest.approx(v, rel=1e-5, abs=1e-6), name
    assert set(m_merged) == set(m_whole)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    cuts=st.lists(st.integers(1, 9), min_size=1, max_size=4, unique=True),
    kind=st.sampled_from(sorted(CONFIGS)),
)
def test_any_split_of_any_batch_gives_the_whole_batch_loss_and_gradient(seed, cuts, kind):
    b = random_batch(seed, B=10, T=4, dtype=torch.float32, nonfinite=seed % 2 == 0)
    _split_equals_whole(CONFIGS[kind], b, sorted(cuts))
