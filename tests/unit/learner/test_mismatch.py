"""The mismatch decomposition (mismatch/noise, quant, lag0, stale) on behaviour log-probs a real quantised
actor produced."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from asyncrl.learner.aligned import RolloutAlignment
from asyncrl.learner.logprobs import logprobs_from_logits, token_logprobs
from asyncrl.learner.mismatch import mismatch_decomposition
from asyncrl.quant import DEFAULT_KEEP_FULL_PRECISION, quantize_model


def _with_actor_behaviour(tiny, fmt, version, stale_rows=()):
    """A batch whose behaviour log-probs are the ``fmt`` actor's at the learner's weights (lag 0), except rows
    in ``stale_rows``, sampled by an older policy (another seed) ``version - 1``."""
    model = tiny.model(seed=11)
    batch = tiny.batch(6, seed=2, version=version)
    behav = batch.behav_logp.clone()
    versions = batch.versions.clone()
    for rows, source, v in (((i for i in range(6) if i not in stale_rows), model, version),
                            (stale_rows, tiny.model(seed=12), version - 1)):
        actor = quantize_model(copy.deepcopy(source), fmt)
        with torch.no_grad():
            logits = actor(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
        lp = logprobs_from_logits(logits, batch.input_ids, batch.loss_mask, batch.temperature)[0]
        for i in rows:
            behav[i] = lp[i]
            versions[i] = torch.where(batch.loss_mask[i], v, -1)
    batch.behav_logp.copy_(behav)
    batch.versions.copy_(versions)
    return model, batch


@pytest.mark.parametrize("fmt", ["int8", "nvfp4"])
def test_mismatch_decomposition_separates_noise_quantization_and_staleness(tiny, fmt):
    model, batch = _with_actor_behaviour(tiny, fmt, version=5, stale_rows=(1, 4))
    al = RolloutAlignment(model, fmt, keep_full_precision=DEFAULT_KEEP_FULL_PRECISION, enabled=False)
    kw = {"version": 5, "rows": 6, "autocast": contextlib.nullcontext()}
    unaligned = mismatch_decomposition(model, batch, aligned=al, **kw)
    assert set(unaligned) == {"mismatch/noise", "mismatch/quant", "mismatch/lag0", "mismatch/stale"}
    assert unaligned["mismatch/noise"] < 1e-5  # same function, another batch shape: fp32 summation order only
    assert unaligned["mismatch/quant"] > 20 * unaligned["mismatch/noise"]
    # an unaligned learner's lag-0 gap is the quantisation gap
    assert unaligned["mismatch/lag0"] == pytest.approx(unaligned["mismatch/quant"], rel=0.5)
    assert unaligned["mismatch/stale"] > 10 * unaligned["mismatch/lag0"]  # another policy: far larger
    with al.set_enabled(True):
        aligned = mismatch_decomposition(model, batch, aligned=al, **kw)
        assert al.enabled  # the measurement switches the quantiser for its own passes only
    # aligned, the learner computes what the actor computed: the lag-0 gap falls to kernel noise
    assert aligned["mismatch/lag0"] < unaligned["mismatch/lag0"] / 20
    assert aligned["mismatch/quant"] == unaligned["mismatch/quant"]  # a property of the weights, not the mode


def test_routes_installed_for_a_measurement_are_removed_after_it(tiny):
    """An unaligned run routes its linears only while it measures: afterwards the model is its own again."""
    model, batch = _with_actor_behaviour(tiny, "int8", version=2)
    before = token_logprobs(model, batch)[0]
    with RolloutAlignment.routed(model, "int8", keep_full_precision=DEFAULT_KEEP_FULL_PRECISION, head=True,
                                 enabled=False) as al:
        out = mismatch_decomposition(model, batch, version=2, rows=6, aligned=al, autocast=contextlib.nullcontext())
        assert "forward" in vars(al.modules["model.layers.0.mlp.up_proj"])
    assert out["mismatch/quant"] > 0
    assert not any("forward" in vars(m) for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert not hasattr(model.lm_head, "asyncrl_head_transform")
    assert torch.equal(token_logprobs(model, batch)[0], before)


def test_mismatch_decomposition_without_quantizer_or_old_tokens(tiny):
    """An fp32 rollout has no quantiser (quant is 0); a step without old tokens has no stale entry."""
    model, batch = _with_actor_behaviour(tiny, "int8", version=3)
    out = mismatch_decomposition(model, batch, version=3, rows=2, aligned=None, autocast=contextlib.nullcontext())
    assert out["mismatch/quant"] == 0.0 and "mismatch/stale" not in out and out["mismatch/lag0"] > 0
