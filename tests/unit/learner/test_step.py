"""train_step on a one-rank FSDP2 model: denominators, micro-batching, skips, prox, schedule."""

from __future__ import annotations

import copy
import math

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
    token_logprobs,
    train_step,
)
from asyncrl.learner.fsdp import full_state_dict


def _state(model, info, opt="adamw", lr=1e-2, sched=None):
    shard_model(model, info)
    o = torch.optim.SGD(model.parameters(), lr=lr) if opt == "sgd" else build_optimizer(model, lr=lr)
    return TrainState(model=model, optimizer=o, scheduler=build_scheduler(o, sched or LRSchedule()))


def _delta(before, model):
    after = full_state_dict(model)
    return {k: after[k] - before[k] for k in before}


def _norm(tensors):
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)))


@pytest.mark.parametrize("kind", ["acr", "gspo"])  # token-mean and seq-mean-token-mean denominators
def test_micro_batch_split_gives_the_same_loss_and_gradient_as_the_whole_minibatch(tiny, dist_info, kind):
    objective = ObjectiveConfig(objective=kind, agg="token-mean" if kind == "acr" else "seq-mean-token-mean")
    batch = tiny.batch(5, seed=1, temperature=0.8)
    base = tiny.model(seed=3)
    before = {k: v.clone() for k, v in base.state_dict().items()}

    # Reference: the unsharded model, the whole batch in one policy_loss call.
    ref = copy.deepcopy(base)
    with torch.no_grad():
        prox, _ = token_logprobs(ref, batch)
    logp, _ = token_logprobs(ref, batch)
    loss, _ = policy_loss(
        logp, prox, batch.behav_logp, batch.advantages, batch.loss_mask, objective,
        versions=batch.versions, learner_version=0,
    )  # fmt: skip
    loss.backward()
    assert loss.item() != 0.0

    results = []
    for micro in (5, 2, 1):
        # SGD with lr 1 and no clipping: the weight change is exactly minus the gradient.
        state = _state(copy.deepcopy(base), dist_info, opt="sgd", lr=1.0)
        cfg = StepConfig(micro_batch_size=micro, grad_clip=0.0)
        m = train_step(state, batch, objective, cfg, dist_info)
        delta = _delta(before, state.model)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(-delta[name], p.grad, rtol=1e-4, atol=1e-6)
        results.append(m)
    assert results[0]["learner/loss"] == pytest.approx(loss.item(), rel=1e-5)
    for m in results[1:]:
        assert m["learner/loss"] == pytest.approx(results[0]["learner/loss"], rel=1e-5)
        assert m["actor/pg_loss"] == pytest.approx(results[0]["actor/pg_loss"], rel=1e-5)
        # Objective metrics merge exactly over micro-batches: counts, token means, maxima.
        assert m["actor/tokens"] == results[0]["actor/tokens"] == batch.num_tokens
        assert m["actor/ratio_mean"] == pytest.approx(1.0) and m["actor/ratio_max"] == pytest.approx(1.0)
        assert m["mismatch/kl_k3"] == pytest.approx(results[0]["mismatch/kl_k3"], rel=1e-6)


def test_step_with_no_loss_tokens_skips_the_update_but_bumps_the_version(tiny, dist_info):
    empty = LearnerBatch.from_samples(
        [[1, 2]] * 3, [[3, 4]] * 3, [np.zeros(2, np.float32)] * 3, [np.zeros(2, np.int32)] * 3, [1.0] * 3,
        response_masks=[np.zeros(2)] * 3,
    )  # fmt: skip
    assert empty.num_tokens == 0
    state = _state(tiny.model(), dist_info)
    state.version = 4
    before = full_state_dict(state.model)
    m = train_step(state, empty, tiny.objective, StepConfig(n_minibatches=3), dist_info)
    after = full_state_dict(state.model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert m["learner/skipped_empty_minibatches"] == 3 and m["learner/updates"] == 0
    assert state.version == 5 and m["learner/version"] == 5
    assert not state.optimizer.state  # AdamW never stepped, so no moments were created


def test_tokens_staler_than_eta_max_leave_the_denominator_and_can_empty_the_step(tiny, dist_info):
    batch = tiny.batch(3, version=0)  # every token was sampled by version 0
    state = _state(tiny.model(), dist_info)
    state.version = 10
    m = train_step(state, batch, ObjectiveConfig(objective="acr", eta_max=2), StepConfig(), dist_info)
    assert m["learner/num_tokens"] == 0 and m["learner/skipped_empty_minibatches"] == 1


def test_non_finite_loss_skips_the_update_and_is_counted(tiny, dist_info):
    def nan_loss(logp, *args, **kwargs):
        return logp.sum() * float("nan"), {}

    state = _state(tiny.model(), dist_info)
    before = full_state_dict(state.model)
    m = train_step(
        state, tiny.batch(4), tiny.objective, StepConfig(n_minibatches=2), dist_info, loss_fn=nan_loss
    )
    after = full_state_dict(state.model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert m["learner/skipped_nonfinite_minibatches"] == 2 and m["learner/updates"] == 0
    assert state.version == 1


def test_objective_skip_flag_skips_the_update(tiny, dist_info):
    def flagged(*args, **kwargs):
        loss, metrics = policy_loss(*args, **kwargs)
        metrics["actor/skip_step"] = 1.0
        return loss, metrics

    state = _state(tiny.model(), dist_info)
    before = full_state_dict(state.model)
    m = train_step(state, tiny.batch(4), tiny.objective, StepConfig(), dist_info, loss_fn=flagged)
    assert all(torch.equal(before[k], v) for k, v in full_state_dict(state.model).items())
    assert m["learner/skipped_nonfinite_minibatches"] == 1 and m["learner/updates"] == 0


def test_prox_logp_comes_from_step_start_weights_in_every_minibatch(tiny, dist_info):
    batch = tiny.batch(4, seed=2)
    base = tiny.model(seed=5)
    with torch.no_grad():
        want = token_logprobs(base, batch)[0]
    seen = []

    def recording_loss(logp, prox, *args, **kwargs):
        seen.append((prox.detach().clone(), logp.detach().clone()))
        return policy_loss(logp, prox, *args, **kwargs)

    state = _state(copy.deepcopy(base), dist_info, lr=0.05)
    cfg = StepConfig(n_minibatches=2, micro_batch_size=8)
    m = train_step(state, batch, tiny.objective, cfg, dist_info, loss_fn=recording_loss)
    assert m["learner/updates"] == 2
    (p0, l0), (p1, l1) = seen
    torch.testing.assert_close(p0, want[:2, : p0.shape[1]], rtol=0, atol=1e-6)
    torch.testing.assert_close(p1, want[2:, : p1.shape[1]], rtol=0, atol=1e-6)
    torch.testing.assert_close(l0, p0, rtol=0, atol=1e-6)  # first minibatch: theta == theta_k
    assert not torch.allclose(l1, p1)  # second minibatch: theta moved, prox did not


def test_learning_rate_follows_the_schedule_once_per_step_and_metrics_are_floats(tiny, dist_info):
    sched = LRSchedule(kind="linear", warmup_steps=1, total_steps=3, min_lr_ratio=0.1)
    state = _state(tiny.model(), dist_info, lr=1e-3, sched=sched)
    cfg = StepConfig(n_minibatches=2, log_entropy=True)
    lrs = []
    for v in range(4):
        m = train_step(state, tiny.batch(2, version=v), tiny.objective, cfg, dist_info)
        lrs.append(m["learner/lr"])
        assert all(isinstance(v, float) and math.isfinite(v) for v in m.values())
        assert "actor/entropy" in m and "actor/ratio_max" in m
    assert lrs == pytest.approx([1e-3, 1e-3, 0.55e-3, 0.1e-3])
    assert state.version == 4


def test_grad_clipping_scales_the_update_to_the_max_norm_and_reports_the_raw_norm(tiny, dist_info):
    batch = tiny.batch(4, seed=3)
    base = tiny.model(seed=6)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    free = _state(copy.deepcopy(base), dist_info, opt="sgd", lr=1.0)
    m_free = train_step(free, batch, tiny.objective, StepConfig(grad_clip=0.0), dist_info)
    raw = _norm(_delta(before, free.model).values())
    assert m_free["learner/grad_norm"] == pytest.approx(raw, rel=1e-5)

    clipped = _state(copy.deepcopy(base), dist_info, opt="sgd", lr=1.0)
    m = train_step(clipped, batch, tiny.objective, StepConfig(grad_clip=1e-3), dist_info)
    assert m["learner/grad_norm"] == pytest.approx(raw, rel=1e-5)
    assert _norm(_delta(before, clipped.model).values()) == pytest.approx(1e-3, rel=1e-3)


def test_loss_fn_returning_plain_metrics_is_rejected_with_the_fix(tiny, dist_info):
    def plain(logp, *args, **kwargs):
        return logp.sum() * 0.0, {"x": 1.0}

    state = _state(tiny.model(), dist_info)
    with pytest.raises(ValueError, match="MetricDict"):
        train_step(state, tiny.batch(2), tiny.objective, StepConfig(), dist_info, loss_fn=plain)


def test_kl_to_reference_without_a_reference_model_is_rejected(tiny, dist_info):
    state = _state(tiny.model(), dist_info)
    with pytest.raises(ValueError, match="ref_model"):
        train_step(state, tiny.batch(2), ObjectiveConfig(objective="tis", kl_coef=1e-3), StepConfig(), dist_info)


def test_kl_to_reference_uses_the_reference_models_logprobs(tiny, dist_info):
    objective = ObjectiveConfig(objective="tis", kl_coef=1e-3)
    batch = tiny.batch(3)
    same = train_step(
        _state(tiny.model(seed=1), dist_info), batch, objective, StepConfig(), dist_info,
        ref_model=shard_model(tiny.model(seed=1), dist_info),
    )  # fmt: skip
    other = train_step(
        _state(tiny.model(seed=1), dist_info), batch, objective, StepConfig(), dist_info,
        ref_model=shard_model(tiny.model(seed=2), dist_info),
    )  # fmt: skip
    assert same["actor/kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert other["actor/kl_ref"] > 1e-4


def test_step_config_rejects_bad_values():
    with pytest.raises(ValueError, match="n_minibatches"):
        StepConfig(n_minibatches=0)
    with pytest.raises(ValueError, match="micro_batch_size"):
        StepConfig(micro_batch_size=0)


def test_coupled_ppo_uses_the_sampler_log_probs_as_the_old_policy(tiny, dist_info):
    """§6.1: kind=ppo has no proximal policy; the ratio is current / behaviour (the naive baseline)."""
    batch = tiny.batch(4, seed=2, temperature=1.0)
    model = tiny.model(seed=3)
    with torch.no_grad():
        current, _ = token_logprobs(copy.deepcopy(model), batch)
    mask = batch.loss_mask
    expected = float(torch.exp(torch.where(mask, current - batch.behav_logp, 0.0))[mask].mean())
    state = _state(model, dist_info, lr=1e-6)
    metrics = train_step(state, batch, ObjectiveConfig(objective="ppo"), StepConfig(micro_batch_size=8), dist_info)
    assert metrics["actor/ratio_mean"] == pytest.approx(expected, rel=1e-4)
    assert abs(metrics["actor/ratio_mean"] - 1.0) > 1e-3  # behav differs from the learner: not a recompute
