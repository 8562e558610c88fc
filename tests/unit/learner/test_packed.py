"""A quantized base under LoRA (learner.base_format): the policy is Deq(Quant(W)) + s*B@A everywhere, the
adapters train exactly as over an fp32 base holding the decoded weights, and the base takes a fraction of
fp32."""

from __future__ import annotations

import pytest
import torch

from asyncrl.learner import LRSchedule, StepConfig, TrainState, build_optimizer, build_scheduler, train_step
from asyncrl.learner.aligned import RolloutAlignment
from asyncrl.learner.logprobs import token_logprobs
from asyncrl.learner.packed import PackedLinear, pack_lora_base
from asyncrl.learner.policy import LoraSpec, base_model, policy_state_dict, prepare_policy
from asyncrl.quant import DEFAULT_KEEP_FULL_PRECISION, dequantize_weight, quantize_weight

SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"))


def _policies(tiny, dist_info, fmt, seed=3):
    """(a policy with a packed base, the same policy over an fp32 base holding the decoded weights)."""
    packed = prepare_policy(tiny.model(seed=seed), dist_info, lora=SPEC, base_format=fmt)
    plain = prepare_policy(tiny.model(seed=seed), dist_info, lora=SPEC)
    theirs = dict(plain.named_parameters())
    with torch.no_grad():
        for n, p in packed.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1)
            theirs[n].copy_(p)
        for name, mod in base_model(packed).named_modules():
            if isinstance(mod, PackedLinear):
                base_model(plain).get_submodule(name).weight.copy_(mod.dequantized())
    return packed, plain


@pytest.mark.parametrize("fmt", ["int8", "nvfp4", "mxfp4"])
def test_packed_base_trains_like_an_fp32_base_of_the_decoded_weights(tiny, dist_info, fmt):
    packed, plain = _policies(tiny, dist_info, fmt)
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == 2 * len(SPEC.target_modules)
    batch = tiny.batch(5, seed=4)
    for model in (packed, plain):
        model.zero_grad()
        (token_logprobs(model, batch)[0] * batch.loss_mask).sum().backward()
    grads = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)
    for n, p in packed.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-7)
    merged, reference = policy_state_dict(packed, SPEC), policy_state_dict(plain, SPEC)
    assert sorted(merged) == sorted(reference)  # the base model's names, no codes
    for k in reference:
        torch.testing.assert_close(merged[k], reference[k], rtol=0, atol=0)


def test_packed_base_holds_a_fraction_of_fp32(tiny, dist_info):
    model = prepare_policy(tiny.model(), dist_info, lora=SPEC, base_format="nvfp4")
    for mod in model.modules():
        if isinstance(mod, PackedLinear):
            held = sum(t.numel() * t.element_size() for t in mod.codes().values())
            assert held <= 0.2 * mod.in_features * mod.out_features * 4, (held, mod)
            codes = quantize_weight(mod.dequantized(), "nvfp4")  # decoding then re-encoding is the identity
            torch.testing.assert_close(dequantize_weight(codes, "nvfp4", mod.in_features), mod.dequantized())


def test_packed_base_under_rollout_alignment_and_training(tiny, dist_info):
    """The rollout-aligned forward quantizes the merged weight over the decoded base; a training step moves
    only the adapters, and the codes stay."""
    model = prepare_policy(tiny.model(seed=5), dist_info, lora=SPEC, base_format="nvfp4")
    opt = build_optimizer(model, lr=1e-2)
    al = RolloutAlignment(model, "int8", keep_full_precision=DEFAULT_KEEP_FULL_PRECISION)
    al.watch(opt)
    codes = {n: b.clone() for n, b in model.named_buffers() if n.endswith("qweight")}
    state = TrainState(model=model, optimizer=opt, scheduler=build_scheduler(opt, LRSchedule()))
    metrics = train_step(state, tiny.batch(6, seed=1), tiny.objective, StepConfig(), dist_info, ref_model=model)
    assert metrics["learner/updates"] >= 1
    assert all(torch.equal(b, codes[n]) for n, b in model.named_buffers() if n in codes)


def test_base_format_refuses_what_it_cannot_pack(tiny):
    with pytest.raises(ValueError, match="learner.lora.rank > 0"):
        pack_lora_base(tiny.model(), "nvfp4")
    with pytest.raises(ValueError, match="choose one of int8, nvfp4, mxfp4"):
        pack_lora_base(tiny.model(), "fp8")
