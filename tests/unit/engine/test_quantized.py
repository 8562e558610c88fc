"""Quantized actors in the native engine: log-probs are those of the quantized model that sampled.

References: plain HF ``forward`` of ``asyncrl.quant.quantize_model(fp32 model, fmt)`` (every format), and for
weight-only formats an fp32 HF model whose projection weights are the dequantized codes.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from asyncrl.engine import GenRequest, SamplingParams
from asyncrl.engine.native.engine import NativeEngine

quant = pytest.importorskip("asyncrl.quant")

QUANTIZED = ("bf16", "int8", "int8_wo", "fp8", "nvfp4", "mxfp4")
WEIGHT_ONLY = ("int8_wo", "nvfp4", "mxfp4")


def ids(text: str) -> list[int]:
    return [1] + [4 + b for b in text.encode()]


def requests(n: int = 8, tokens: int = 12) -> list[GenRequest]:
    texts = ["1+2=", "What is 17+25? ", "9*9=", "3-8", "answer: ", "100/4=", "x", "12345+"]
    return [
        GenRequest(
            f"r{i}",
            ids(texts[i % len(texts)]),
            SamplingParams(max_new_tokens=tokens, stop_token_ids=(), seed=i),
        )
        for i in range(n)
    ]


def token_errors(results, model, temperature: float = 1.0) -> np.ndarray:
    errs = []
    for res in results:
        full = torch.tensor([res.prompt_ids + res.response_ids])
        with torch.no_grad():
            logits = model(full).logits[0, len(res.prompt_ids) - 1 : -1].float()
        ref = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(res.response_ids)[:, None])[
            :, 0
        ]
        errs.append(np.abs(ref.numpy() - res.behav_logp))
    return np.concatenate(errs)


def dequantized_fp32_model(fp32_model, fmt: str):
    """fp32 HF model whose quantized projections hold ``dequant(quant(W))``."""
    qmodel = quant.quantize_model(copy.deepcopy(fp32_model), fmt)
    model = copy.deepcopy(fp32_model)
    with torch.no_grad():
        for name, mod in qmodel.named_modules():
            if isinstance(mod, quant.QuantLinear):
                w = quant.dequantize_weight(mod.weight_tensors(), fmt, mod.in_features)
                model.get_submodule(name).weight.copy_(w)
    return model


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_quantized_logps_match_the_same_format_forward_not_fp32(tiny_hf, fmt):
    engine = NativeEngine(copy.deepcopy(tiny_hf), quant_format=fmt, max_batch_size=4)
    results = list(engine.generate(requests()))
    same = token_errors(results, quant.quantize_model(copy.deepcopy(tiny_hf), fmt))
    fp32 = token_errors(results, tiny_hf)
    # Rounding flips from fp32 noise are rare (conftest LOGP_ATOL); a wrong model is off on most tokens.
    assert np.mean(same <= 1e-4) >= 0.9, np.sort(same)[-5:]
    assert same.max() <= 1e-2
    assert np.mean(fp32 <= 1e-4) < 0.5, "the quantized actor should differ measurably from fp32"
    assert engine.capabilities()["quant_format"] == fmt


@pytest.mark.parametrize("fmt", WEIGHT_ONLY)
def test_weight_only_logps_equal_the_dequantized_fp32_model(tiny_hf, fmt):
    engine = NativeEngine(copy.deepcopy(tiny_hf), quant_format=fmt, max_batch_size=4)
    results = list(engine.generate(requests(4, 10)))
    errs = token_errors(results, dequantized_fp32_model(tiny_hf, fmt))
    assert errs.max() <= 1e-4


def test_published_update_swaps_at_the_boundary_without_requantizing(tiny_hf, tiny_hf_v1, reference):
    engine = NativeEngine(copy.deepcopy(tiny_hf), quant_format="int8_wo")
    published = quant.publish(tiny_hf_v1.state_dict(), "int8_wo", version=1)
    engine.submit([GenRequest("a", ids("7+7="), SamplingParams(max_new_tokens=9, stop_token_ids=()))])
    for _ in range(3):
        engine.step()
    engine.update_weights(1, published)
    (res,) = list(engine.generate())
    assert res.versions.tolist() == [0] * 3 + [1] * 6
    ref0 = quant.quantize_model(copy.deepcopy(tiny_hf), "int8_wo")
    ref1 = quant.quantize_model(copy.deepcopy(tiny_hf_v1), "int8_wo")
    ref = reference.swapped(ref0, ref1, res.prompt_ids, res.response_ids, 3, 1.0).numpy()
    np.testing.assert_allclose(res.behav_logp, ref, atol=1e-4, rtol=0)


def test_state_dict_update_to_a_quantized_engine_equals_the_published_update(tiny_hf, tiny_hf_v1):
    def run(weights):
        engine = NativeEngine(copy.deepcopy(tiny_hf), quant_format="nvfp4")
        engine.update_weights(2, weights)
        return list(engine.generate(requests(2, 6)))

    a = run(tiny_hf_v1.state_dict())
    b = run(quant.publish(tiny_hf_v1.state_dict(), "nvfp4", version=2))
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    np.testing.assert_array_equal(
        np.concatenate([r.behav_logp for r in a]), np.concatenate([r.behav_logp for r in b])
    )


def test_publication_in_another_format_is_rejected_before_queueing(tiny_hf, tiny_hf_v1):
    engine = NativeEngine(copy.deepcopy(tiny_hf), quant_format="int8")
    with pytest.raises(ValueError, match="publish in 'int8'"):
        engine.update_weights(1, quant.publish(tiny_hf_v1.state_dict(), "fp8", version=1))
    assert engine.version == 0


def test_fp32_engine_accepts_an_fp32_publication(tiny_hf, tiny_hf_v1, reference):
    engine = NativeEngine(copy.deepcopy(tiny_hf))
    engine.update_weights(4, quant.publish(tiny_hf_v1.state_dict(), "fp32", version=4))
    (res,) = engine.generate(requests(1, 5))
    assert res.versions.tolist() == [4] * 5
    ref = reference.plain(tiny_hf_v1, res.prompt_ids, res.response_ids, 1.0).numpy()
    np.testing.assert_allclose(res.behav_logp, ref, atol=1e-4, rtol=0)
