"""train_step on a one-rank FSDP2 model: denominators, micro-batching, skips, prox, schedule."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

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
from asyncrl.learner.fsdp import full_state_dict


def _sgd_state(model, info, lr=1.0):
    """Plain SGD with lr 1: the weight change of one update is exactly minus the gradient."""
    shard_model(model, info)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return TrainState(model=model, optimizer=opt, scheduler=build_scheduler(opt, LRSchedule()))


def _delta(before, model):
    after = full_state_dict(model)
    return {k: after[k] - before[k] for k in before}


def test_micro_batch_split_gives_the_same_gradient_as_the_whole_minibatch(tiny, dist_info):
    batch = tiny.batch(5, seed=1, temperature=0.8)
    base = tiny.model(seed=3)
    before = {k: v.clone() for k, v in base.state_dict().items()}

    # Reference: unsharded copy, whole batch in one forward, loss over the global token count.
    ref = copy.deepcopy(base)
    from asyncrl.learner import token_logprobs

    with torch.no_grad():
        prox, _ = token_logprobs(ref, batch)
    logp, _ = token_logprobs(ref, batch)
    loss, _ = tiny.loss(
        logp,
        prox,
        batch.behav_logp,
        batch.advantages,
        batch.loss_mask,
        None,
        num_tokens=batch.num_tokens,
        num_seqs=batch.num_seqs,
        versions=batch.versions,
        learner_version=0,
    )
    loss.backward()
    ref_grad = {n: p.grad for n, p in ref.named_parameters()}

    results = []
    for micro in (5, 2, 1):
        state = _sgd_state(copy.deepcopy(base), dist_info)
        m = train_step(
            state,
            batch,
            None,
            StepConfig(micro_batch_size=micro, max_grad_norm=0.0),
            dist_info,
            loss_fn=tiny.loss,
        )
        grad = {k: -d for k, d in _delta(before, state.model).items()}
        for name, g in ref_grad.items():
            torch.testing.assert_close(grad[name], g, rtol=1e-4, atol=1e-6)
        results.append(m["learner/loss"])
    assert results[0] == pytest.approx(loss.item(), rel=1e-5)
    assert results == pytest.approx([results[0]] * 3, rel=1e-5)


def test_step_with_no_loss_tokens_skips_the_update_but_bumps_the_version(tiny, dist_info):
    b = tiny.batch(3)
    empty = LearnerBatch.from_samples(
        [[1, 2]] * 3,
        [[3, 4]] * 3,
        [np.zeros(2, np.float32)] * 3,
        [np.zeros(2, np.int32)] * 3,
        [1.0] * 3,
        response_masks=[np.zeros(2)] * 3,
    )
    assert empty.num_tokens == 0 and b.num_tokens > 0
    model = shard_model(tiny.model(), dist_info)
    opt = build_optimizer(model, lr=1e-2)
    state = TrainState(model=model, optimizer=opt, scheduler=build_scheduler(opt, LRSchedule()), version=4)
    before = full_state_dict(model)
    m = train_step(state, empty, None, StepConfig(n_minibatches=3), dist_info, loss_fn=tiny.loss)
    after = full_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert m["learner/skipped_empty_minibatches"] == 3 and m["learner/updates"] == 0
    assert state.version == 5 and m["learner/version"] == 5
    assert not opt.state  # AdamW never stepped, so no moments were created


def test_non_finite_loss_skips_the_update_and_is_counted(tiny, dist_info):
    def nan_loss(logp, *args, **kwargs):
        return logp.sum() * float("nan"), {}

    model = shard_model(tiny.model(), dist_info)
    opt = build_optimizer(model, lr=1e-2)
    state = TrainState(model=model, optimizer=opt, scheduler=build_scheduler(opt, LRSchedule()))
    before = full_state_dict(model)
    m = train_step(state, tiny.batch(4), None, StepConfig(n_minibatches=2), dist_info, loss_fn=nan_loss)
    after = full_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert m["learner/skipped_nonfinite_minibatches"] == 2 and m["learner/updates"] == 0
    assert state.version == 1


def test_prox_logp_comes_from_step_start_weights_in_every_minibatch(tiny, dist_info):
    batch = tiny.batch(4, seed=2)
    base = tiny.model(seed=5)
    from asyncrl.learner import token_logprobs

    with torch.no_grad():
        want = token_logprobs(base, batch)[0]
    seen = []

    def recording_loss(logp, prox, *args, **kwargs):
        seen.append((prox.detach().clone(), logp.detach().clone()))
        return tiny.loss(logp, prox, *args, **kwargs)

    model = shard_model(copy.deepcopy(base), dist_info)
    opt = build_optimizer(model, lr=0.05)
    state = TrainState(model=model, optimizer=opt, scheduler=build_scheduler(opt, LRSchedule()))
    m = train_step(
        state, batch, None, StepConfig(n_minibatches=2, micro_batch_size=8), dist_info, loss_fn=recording_loss
    )
    assert m["learner/updates"] == 2
    (p0, l0), (p1, l1) = seen
    torch.testing.assert_close(p0, want[:2, : p0.shape[1]], rtol=0, atol=1e-6)
    torch.testing.assert_close(p1, want[2:, : p1.shape[1]], rtol=0, atol=1e-6)
    torch.testing.assert_close(l0, p0, rtol=0, atol=1e-6)  # first minibatch: theta == theta_k
    assert not torch.allclose(l1, p1)  # second minibatch: theta moved, prox did not


def test_learning_rate_follows_the_schedule_once_per_step_and_metrics_are_floats(tiny, dist_info):
    model = shard_model(tiny.model(), dist_info)
    opt = build_optimizer(model, lr=1e-3)
    sched = LRSchedule(kind="linear", warmup_steps=1, total_steps=3, min_lr_ratio=0.1)
    state = TrainState(model=model, optimizer=opt, scheduler=build_scheduler(opt, sched))
    lrs = []
    for _ in range(4):
        m = train_step(
            state,
            tiny.batch(2),
            None,
            StepConfig(n_minibatches=2, log_entropy=True),
            dist_info,
            loss_fn=tiny.loss,
        )
        lrs.append(m["learner/lr"])
        assert all(isinstance(v, float) and math.isfinite(v) for v in m.values())
        assert "actor/entropy" in m and "actor/ratio_max" in m
    assert lrs == pytest.approx([1e-3, 1e-3, 0.55e-3, 0.1e-3])
    assert state.version == 4


def test_step_config_rejects_bad_values():
    with pytest.raises(ValueError, match="n_minibatches"):
        StepConfig(n_minibatches=0)
    with pytest.raises(ValueError, match="micro_batch_size"):
        StepConfig(micro_batch_size=0)


def test_grad_clipping_scales_the_update_to_the_max_norm_and_reports_the_raw_norm(tiny, dist_info):
    batch = tiny.batch(4, seed=3)
    base = tiny.model(seed=6)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    free = _sgd_state(copy.deepcopy(base), dist_info)
    m_free = train_step(free, batch, None, StepConfig(max_grad_norm=0.0), dist_info, loss_fn=tiny.loss)
    raw = torch.sqrt(sum((d.double() ** 2).sum() for d in _delta(before, free.model).values()))
    assert m_free["learner/grad_norm"] == pytest.approx(float(raw), rel=1e-5)

    clipped = _sgd_state(copy.deepcopy(base), dist_info)
    m = train_step(clipped, batch, None, StepConfig(max_grad_norm=1e-3), dist_info, loss_fn=tiny.loss)
    step_norm = torch.sqrt(sum((d.double() ** 2).sum() for d in _delta(before, clipped.model).values()))
    assert m["learner/grad_norm"] == pytest.approx(float(raw), rel=1e-5)
    assert float(step_norm) == pytest.approx(1e-3, rel=1e-3)
