"""Architectures the native decoder runs exactly: tiny random Llama, Qwen2, Qwen3 and Mistral models.

Each model is built with ``from_config`` from a seeded generator (never downloaded). The native engine's
behaviour log-probs, on both the static and the eager decode step, must equal an fp32 HF forward of the
sampled tokens within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from asyncrl.engine import GenRequest, SamplingParams
from asyncrl.engine.native.decoder import NATIVE_MODEL_TYPES, check_supported, native_unsupported_reason
from asyncrl.engine.native.engine import NativeEngine

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)
FAMILIES = {
    "llama": dict(attention_bias=False),
    "qwen2": dict(),
    "qwen3": dict(head_dim=24),  # head_dim != hidden / heads, q_norm / k_norm per head
    "mistral": dict(sliding_window=None),
}


def tiny(model_type: str, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**COMMON, **FAMILIES[model_type], **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms too: unit gains would hide a norm applied to the wrong tensor
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else 0.08) + (p.dim() == 1))
    return model


@pytest.mark.parametrize("decode_step", ["static", "eager"])
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_native_logprobs_equal_an_fp32_hf_forward(model_type, decode_step, reference):
    assert model_type in NATIVE_MODEL_TYPES
    model = tiny(model_type)
    engine = NativeEngine(model, max_batch_size=3, decode_step=decode_step, eos_token_ids=[])
    prompts = [[1, 5, 9, 17, 33], [1, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [1, 40, 41]]
    reqs = [GenRequest(f"r{i}", p, SamplingParams(max_new_tokens=6 + 3 * i, seed=i, temperature=0.9,
                                                  stop_token_ids=()))
            for i, p in enumerate(prompts)]
    results = list(engine.generate(reqs))
    assert len(results) == 4
    for res in results:
        ref = reference.plain(model, res.prompt_ids, res.response_ids, 0.9)
        torch.testing.assert_close(torch.from_numpy(res.behav_logp), ref, atol=1e-5, rtol=0)
    engine.close()


def test_mistral_sliding_window_shorter_than_the_sequence_limit_is_refused_with_the_fix(reference):
    model = tiny("mistral", sliding_window=32)
    with pytest.raises(ValueError, match=r"max_seq_len <= 32"):
        NativeEngine(model, decode_step="static")
    fallback = NativeEngine(model)  # auto: the model's own HF forward, which slides the window
    assert fallback.capabilities()["decode_step"] == "eager"
    fallback.close()
    assert native_unsupported_reason(model.config, 32) is None
    engine = NativeEngine(model, max_seq_len=32)  # a window that covers every position never slides
    (res,) = engine.generate([GenRequest("a", [1, 2, 3], SamplingParams(max_new_tokens=40, stop_token_ids=()))])
    assert res.finish_reason == "length" and len(res.response_ids) == 29
    torch.testing.assert_close(torch.from_numpy(res.behav_logp),
                               reference.plain(model, res.prompt_ids, res.response_ids, 1.0), atol=1e-5, rtol=0)
    engine.close()


def test_unsupported_configs_name_the_reason():
    from transformers import AutoConfig

    assert "model_type" in native_unsupported_reason(AutoConfig.for_model("gpt2"))
    qwen3 = AutoConfig.for_model("qwen3", **COMMON, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="use_sliding_window=False"):
        check_supported(qwen3)
