"""Rollout-aligned forward (learner.rollout_aligned): the learner computes with the actor's low-bit values,
the published bits, and straight-through gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.learner import LRSchedule, StepConfig, TrainState, build_optimizer, build_scheduler, train_step
from asyncrl.learner.aligned import RolloutAlignment
from asyncrl.learner.logprobs import logprobs_from_logits, token_logprobs
from asyncrl.learner.policy import LoraSpec, policy_state_dict, prepare_policy
from asyncrl.quant import DEFAULT_KEEP_FULL_PRECISION, dequantize_weight, publish, quantize_model
from asyncrl.quant.formats import weight_suffixes

FORMATS = ["int8", "int8_wo", "fp8", "nvfp4", "mxfp4", "bf16"]
SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "up_proj", "down_proj"))


def _align(model, fmt, head=False, enabled=True, embedding=False):
    return RolloutAlignment(model, fmt, keep_full_precision=DEFAULT_KEEP_FULL_PRECISION, head=head,
                            embedding=embedding, enabled=enabled)


@pytest.mark.parametrize(("head", "embedding"), [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_rollout_aligned_logprobs_are_the_quantized_actors(tiny, fmt, head, embedding):
    """The aligned learner's log-probs equal the actor's (a model converted with quantize_model) up to the
    order of fp32 sums, while the full-precision learner's are quantisation error away. With the int8 token
    embedding (quant.embedding, on a tied model: with an int8 head the two share one table) too."""
    model = tiny.model(seed=1, tie=embedding)
    actor = quantize_model(copy.deepcopy(model), fmt, head=head, embedding=embedding)
    batch = tiny.batch(4, seed=3)
    al = _align(model, fmt, head=head, embedding=embedding)
    aligned = token_logprobs(model, batch)[0]
    with al.full_precision():
        full = token_logprobs(model, batch)[0]
    with torch.no_grad():  # the actor's own logits (a quantised head is no nn.Linear)
        logits = actor(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    ref = logprobs_from_logits(logits, batch.input_ids, batch.loss_mask, batch.temperature)[0]
    mask = batch.loss_mask
    gap_aligned = (aligned - ref)[mask].abs().max().item()
    gap_full = (full - ref)[mask].abs().max().item()
    assert gap_full > 1e-5, (fmt, gap_full)  # quantisation moved the log-probs...
    assert gap_aligned < 1e-6, (fmt, gap_aligned, gap_full)  # ...alignment takes it back: the same kernels


@pytest.mark.parametrize("fmt", ["int8", "nvfp4"])
@pytest.mark.parametrize(("lora", "embedding"), [(False, False), (True, False), (False, True), (True, True)])
def test_rollout_aligned_weights_are_the_published_bits(tiny, dist_info, fmt, lora, embedding):
    """The low-bit weights the learner computes with are the publication's, bit for bit; adopted from the
    publication, the forward quantises nothing itself (one quantisation per version). With the int8 token
    embedding and an int8 head of a tied model, the embedding's codes are the head's (published once)."""
    model = prepare_policy(tiny.model(seed=2, tie=True), dist_info, lora=SPEC if lora else None)
    if lora:  # non-zero adapters, so the merged weight differs from the base
        for n, p in model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1)
    al = _align(model, fmt, head=embedding, embedding=embedding)
    pub = publish(dict(policy_state_dict(model, SPEC if lora else None)), fmt, version=0, head=embedding,
                  embedding=embedding)
    for name in al.modules:
        codes = {s: pub.tensors[f"{name}.{s}"] for s in weight_suffixes(fmt)}
        k = al.modules[name].in_features
        assert torch.equal(al.weight(name), dequantize_weight(codes, fmt, k)), name
    batch = tiny.batch(3, seed=1)
    token_logprobs(model, batch)  # the embedding's codes are made at its first forward
    made = len(al.modules) + embedding
    assert al.quantizations == made
    if embedding:
        table = "lm_head" if fmt == "int8" else "model.embed_tokens"
        assert ("model.embed_tokens.qweight" in pub.tensors) == (fmt != "int8")  # one table with an int8 head
        cached = al._cache["model.embed_tokens"].codes
        assert torch.equal(cached["qweight"], pub.tensors[f"{table}.qweight"])
        assert torch.equal(cached["weight_scale"], pub.tensors[f"{table}.weight_scale"])
    al.invalidate()
    assert al.adopt(pub.tensors) == made
    token_logprobs(model, batch)
    assert al.quantizations == made  # nothing quantised again: the forward used the published codes


def _grads(model, batch):
    model.zero_grad(set_to_none=True)
    logp = token_logprobs(model, batch)[0]
    (logp * batch.loss_mask).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_straight_through_gradients_full_fine_tuning(tiny):
    """Weight-only format: the aligned model's gradient at W is the gradient a plain model holding the
    dequantised weights gets at them (the estimator passes it straight through)."""
    model = tiny.model(seed=4)
    plain = copy.deepcopy(model)  # before routing: a copy would share the routed forwards' closures
    al = _align(model, "nvfp4")
    with torch.no_grad():
        for name in al.modules:
            plain.get_submodule(name).weight.copy_(al.weight(name))
    batch = tiny.batch(4, seed=5)
    g_al, g_plain = _grads(model, batch), _grads(plain, batch)
    for name in al.modules:
        torch.testing.assert_close(g_al[f"{name}.weight"], g_plain[f"{name}.weight"], rtol=1e-5, atol=1e-7)


def test_straight_through_gradients_embedding(tiny):
    """The int8 token embedding: the aligned model's gradient at the master table is the gradient a plain
    model holding the dequantised table gets at it (and the value is that table's lookup)."""
    model = tiny.model(seed=4)
    plain = copy.deepcopy(model)
    al = _align(model, "nvfp4", embedding=True)  # weight-only linears: a plain model can hold what they compute
    actor = quantize_model(copy.deepcopy(model), "nvfp4", embedding=True).model.embed_tokens
    with torch.no_grad():
        table = actor(torch.arange(actor.num_embeddings))
        plain.model.embed_tokens.weight.copy_(table)
        for name in al.modules:
            plain.get_submodule(name).weight.copy_(al.weight(name))
    batch = tiny.batch(4, seed=5)
    ids = batch.input_ids
    assert torch.equal(model.model.embed_tokens(ids), table[ids])
    g_al, g_plain = _grads(model, batch), _grads(plain, batch)
    torch.testing.assert_close(g_al["model.embed_tokens.weight"], g_plain["model.embed_tokens.weight"],
                               rtol=1e-5, atol=1e-7)


def test_straight_through_gradients_lora(tiny, dist_info):
    """LoRA: dA and dB are those of the straight-through estimator through the merged weight
    W + s*B@A: with G the gradient at the merged dequantised weight, dB = s*G@A^T and dA = s*B^T@G."""
    model = prepare_policy(tiny.model(seed=6), dist_info, lora=SPEC)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    al = _align(model, "nvfp4")
    merged = dict(policy_state_dict(model, SPEC))
    plain = tiny.model(seed=6)
    plain.load_state_dict(merged)
    with torch.no_grad():
        for name in al.modules:
            plain.get_submodule(name).weight.copy_(al.weight(name))
    batch = tiny.batch(4, seed=7)
    g_al, g_plain = _grads(model, batch), _grads(plain, batch)
    s = SPEC.scaling
    for name in al.modules:
        mod = al.modules[name]
        if not hasattr(mod, "lora_A"):
            continue
        a, b = mod.lora_A["default"].weight, mod.lora_B["default"].weight
        g = g_plain[f"{name}.weight"]
        peft = f"base_model.model.{name}"
        torch.testing.assert_close(g_al[f"{peft}.lora_B.default.weight"], s * g @ a.detach().T, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(g_al[f"{peft}.lora_A.default.weight"], s * b.detach().T @ g, rtol=1e-4, atol=1e-6)


def test_rollout_aligned_cache_lives_one_version(tiny, dist_info):
    """Within a step every forward (proximal, training, both minibatches' recomputes) uses one quantisation
    per weight and version; the optimiser's step invalidates it, and training learns through it."""
    model = prepare_policy(tiny.model(seed=8), dist_info)
    opt = build_optimizer(model, lr=1e-2)
    state = TrainState(model=model, optimizer=opt, scheduler=build_scheduler(opt, LRSchedule()))
    al = _align(model, "int8")
    al.watch(opt)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = train_step(state, tiny.batch(6, seed=1), tiny.objective, StepConfig(n_minibatches=2), dist_info)
    assert metrics["learner/updates"] == 2
    # minibatch 0: one quantisation per weight; minibatch 1 runs after an update: one more each
    assert al.quantizations == 2 * len(al.modules)
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_rollout_alignment_refuses_what_it_cannot_align(tiny, dist_info):
    with pytest.raises(ValueError, match="quant.fmt=fp32 has nothing to align"):
        _align(tiny.model(), "fp32")
    model = prepare_policy(tiny.model(), dist_info, lora=LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj",),
                                                                   dropout=0.1))
    _align(model, "int8")
    with pytest.raises(ValueError, match="learner.lora.dropout=0"):
        token_logprobs(model, tiny.batch(2))
