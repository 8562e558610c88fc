"""The lean learner step: reused prox, zero-advantage rows without backward, token budget, bf16."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from asyncrl.algo import ObjectiveConfig, policy_loss
from asyncrl.learner import (
    LearnerBatch,
    LRSchedule,
    StepConfig,
    TrainState,
    build_optimizer,
    build_scheduler,
    shard_model,
    train_step,
)
from asyncrl.learner.plan import budget_groups, plan_step, zero_advantage_rows


def _state(model, info, *, shard=True, lr=1e-2):
    if shard:
        shard_model(model, info)
    o = build_optimizer(model, lr=lr)
    return TrainState(model=model, optimizer=o, scheduler=build_scheduler(o, LRSchedule()))


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("shard", [True, False])
@pytest.mark.parametrize("n_minibatches", [1, 2])
def test_reused_prox_gives_bit_identical_weights_and_metrics(tiny, dist_info, shard, n_minibatches):
    batch = tiny.batch(6, seed=7)
    base = tiny.model(seed=8)
    out = {}
    for reuse in (True, False):
        state = _state(copy.deepcopy(base), dist_info, shard=shard)
        cfg = StepConfig(n_minibatches=n_minibatches, micro_batch_size=2, reuse_prox=reuse)
        m = train_step(state, batch, tiny.objective, cfg, dist_info)
        assert m["learner/prox_reused"] == float(reuse)
        out[reuse] = (m, _weights(state.model))
    (m_r, w_r), (m_s, w_s) = out[True], out[False]
    assert all(torch.equal(w_r[k], w_s[k]) for k in w_s)
    for key in ("learner/loss", "learner/grad_norm", "actor/ratio_mean", "mismatch/kl_k3", "actor/entropy"):
        assert m_r[key] == m_s[key], key


def test_a_non_finite_reused_prox_redoes_the_minibatch_like_the_separate_pass(tiny, dist_info):
    batch = tiny.batch(4, seed=1)
    base = tiny.model(seed=2)
    with torch.no_grad():
        base.lm_head.weight[3].fill_(float("nan"))  # every log-prob is NaN: no token is usable
    res = {}
    for reuse in (True, False):
        state = _state(copy.deepcopy(base), dist_info)
        res[reuse] = train_step(state, batch, tiny.objective, StepConfig(reuse_prox=reuse), dist_info)
    assert res[True]["learner/prox_redone"] == 1 and res[False]["learner/prox_redone"] == 0
    for m in res.values():
        assert m["learner/skipped_empty_minibatches"] == 1 and m["learner/updates"] == 0


def _with_zero_groups(batch: LearnerBatch, zero_rows: list[int]) -> LearnerBatch:
    adv = batch.advantages.clone()
    adv[zero_rows] = 0.0
    return LearnerBatch(input_ids=batch.input_ids, attention_mask=batch.attention_mask, loss_mask=batch.loss_mask,
                        behav_logp=batch.behav_logp, advantages=adv, versions=batch.versions,
                        temperature=batch.temperature)  # fmt: skip


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_zero_advantage_rows_get_no_backward_and_leave_the_update_unchanged(tiny, dist_info, agg):
    batch = _with_zero_groups(tiny.batch(6, seed=3), [1, 2, 4])
    objective = ObjectiveConfig(objective="acr", agg=agg)
    base = tiny.model(seed=4)
    seen_rows = []

    def counting(logp, *a, **kw):
        seen_rows.append(logp.shape[0])
        return policy_loss(logp, *a, **kw)

    out = {}
    for skip in (True, False):
        seen_rows.clear()
        state = _state(copy.deepcopy(base), dist_info, lr=1e-3)
        cfg = StepConfig(skip_zero_advantage=skip, micro_batch_size=8)
        m = train_step(state, batch, objective, cfg, dist_info, loss_fn=counting)
        out[skip] = (m, _weights(state.model), sum(seen_rows))
    (m_k, w_k, rows_k), (m_a, w_a, rows_a) = out[True], out[False]
    assert rows_k == 3 and rows_a == 6 and m_k["learner/zero_adv_seqs_no_backward"] == 3
    assert m_k["learner/num_tokens"] == m_a["learner/num_tokens"] == batch.num_tokens  # still in the denominator
    assert m_k["learner/loss"] == pytest.approx(m_a["learner/loss"], rel=1e-5, abs=1e-8)
    assert m_k["learner/grad_norm"] == pytest.approx(m_a["learner/grad_norm"], rel=1e-5)
    for k in w_a:
        torch.testing.assert_close(w_k[k], w_a[k], rtol=1e-5, atol=1e-7)


def test_a_minibatch_of_only_zero_advantages_makes_no_update(tiny, dist_info):
    batch = _with_zero_groups(tiny.batch(4, seed=3), [0, 1, 2, 3])
    state = _state(tiny.model(seed=1), dist_info)
    before = _weights(state.model)
    m = train_step(state, batch, tiny.objective, StepConfig(), dist_info)
    assert m["learner/skipped_zero_adv_minibatches"] == 1 and m["learner/updates"] == 0
    assert all(torch.equal(before[k], v) for k, v in _weights(state.model).items())
    assert state.version == 1
    assert m["actor/pg_loss"] == 0.0 and m["actor/loss"] == 0.0  # the loss curve has a point at every step


def test_a_zero_advantage_minibatch_counts_with_loss_zero_in_the_mean_minibatch_loss(tiny, dist_info):
    batch = _with_zero_groups(tiny.batch(4, seed=3), [2, 3])  # minibatch 1 (rows 2, 3) is all zero
    base = tiny.model(seed=1)
    out = {}
    for skip in (True, False):
        state = _state(copy.deepcopy(base), dist_info)
        cfg = StepConfig(skip_zero_advantage=skip, n_minibatches=2, micro_batch_size=8)
        out[skip] = train_step(state, batch, tiny.objective, cfg, dist_info)
    assert out[True]["learner/skipped_zero_adv_minibatches"] == 1
    assert out[True]["actor/pg_loss"] == pytest.approx(out[False]["actor/pg_loss"], rel=1e-6, abs=1e-9)


def test_zero_advantage_rows_are_trained_when_a_kl_or_entropy_term_is_on(tiny, dist_info):
    batch = _with_zero_groups(tiny.batch(4, seed=3), [0, 1])
    state = _state(tiny.model(seed=1), dist_info)
    m = train_step(state, batch, ObjectiveConfig(objective="acr", entropy_coef=0.01), StepConfig(), dist_info)
    assert m["learner/zero_adv_seqs_no_backward"] == 0 and m["learner/updates"] == 1
    assert zero_advantage_rows(batch).tolist() == [True, True, False, False]


def test_budget_groups_respect_rows_and_padded_tokens():
    lengths = [5, 9, 3, 9, 2, 7]
    groups = budget_groups(lengths, max_rows=8, max_tokens=18)
    assert sorted(i for g in groups for i in g) == list(range(6))
    for g in groups:
        assert max(lengths[i] for i in g) * len(g) <= 18 or len(g) == 1
    assert groups[0] == [1, 3]  # longest first
    assert budget_groups([30, 2], max_rows=8, max_tokens=10) == [[0], [1]]  # too long: alone
    assert budget_groups(lengths, max_rows=4, max_tokens=0) == [[0, 1, 2, 3], [4, 5]]  # by count, in order


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_rank_gets_the_same_number_of_micro_batches_under_a_token_budget(tiny, world_size):
    batch = tiny.batch(7, seed=5)
    plans = [plan_step(batch, n_minibatches=2, rank=r, world_size=world_size, micro_batch_size=8,
                       max_tokens_per_micro_batch=12) for r in range(world_size)]  # fmt: skip
    for j in range(2):
        counts = {len(p[j].micros) for p in plans}
        assert len(counts) == 1
        rows = sum(m.loss_mask.any(1).sum() for p in plans for m in p[j].micros)
        assert rows == batch.split(2)[j].num_seqs


def test_token_budget_gives_the_same_update_as_one_micro_batch(tiny, dist_info):
    batch = tiny.batch(6, seed=9)
    base = tiny.model(seed=1)
    res = []
    for cfg in (StepConfig(micro_batch_size=64), StepConfig(micro_batch_size=64, max_tokens_per_micro_batch=10)):
        state = _state(copy.deepcopy(base), dist_info, lr=1e-3)
        res.append((train_step(state, batch, tiny.objective, cfg, dist_info), _weights(state.model)))
    assert res[0][0]["learner/loss"] == pytest.approx(res[1][0]["learner/loss"], rel=1e-5)
    for k in res[0][1]:
        torch.testing.assert_close(res[0][1][k], res[1][1][k], rtol=1e-5, atol=1e-7)


def test_entropy_is_logged_by_default_and_bf16_autocast_keeps_fp32_master_weights(tiny, dist_info):
    batch = tiny.batch(4, seed=2)
    base = tiny.model(seed=3)
    fp32 = train_step(_state(copy.deepcopy(base), dist_info), batch, tiny.objective, StepConfig(), dist_info)
    assert fp32["actor/entropy"] > 0
    state = _state(copy.deepcopy(base), dist_info)
    bf16 = train_step(state, batch, tiny.objective, StepConfig(autocast="bf16"), dist_info)
    assert all(p.dtype == torch.float32 for p in state.model.parameters())
    assert bf16["learner/updates"] == 1 and np.isfinite(bf16["learner/loss"])
    assert bf16["actor/entropy"] == pytest.approx(fp32["actor/entropy"], rel=5e-2)
    with pytest.raises(ValueError, match="autocast"):
        StepConfig(autocast="fp16")
