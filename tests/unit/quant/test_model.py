"""quantize_model: which modules are swapped, what they compute, and the keep_full_precision rule."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from asyncrl.quant import (
    FORMATS,
    QuantError,
    QuantLinear,
    UnknownFormatError,
    dequantize_weight,
    kl_vs_full_precision,
    model_format,
    quantize_model,
)
from asyncrl.quant.model import is_target_linear, name_matches

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_fp32_is_a_no_op(tiny_model):
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    out = quantize_model(tiny_model, "fp32")
    assert out is tiny_model and model_format(tiny_model) == "fp32"
    assert not any(isinstance(m, QuantLinear) for m in tiny_model.modules())
    assert all(torch.equal(before[k], v) for k, v in tiny_model.state_dict().items())


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "fp32"])
def test_swaps_exactly_the_attention_and_mlp_projections(tiny_model, fmt):
    quantize_model(tiny_model, fmt)
    swapped = sorted(n for n, m in tiny_model.named_modules() if isinstance(m, QuantLinear))
    assert len(swapped) == 2 * len(PROJ) and all(n.rsplit(".", 1)[1] in PROJ for n in swapped)
    assert isinstance(tiny_model.lm_head, nn.Linear) and tiny_model.lm_head.weight.dtype == torch.float32
    assert tiny_model.model.embed_tokens.weight.dtype == torch.float32
    assert model_format(tiny_model) == fmt


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "fp32"])
def test_quantised_model_stays_close_to_full_precision(tiny_model, probe_ids, fmt):
    ref = copy.deepcopy(tiny_model)
    quantize_model(tiny_model, fmt)
    kl = kl_vs_full_precision(tiny_model, ref, probe_ids)
    bound = {"bf16": 1e-4, "int8": 1e-3, "int8_wo": 1e-3, "fp8": 5e-3, "nvfp4": 5e-2, "mxfp4": 5e-2}[fmt]
    assert 0.0 < kl < bound


@pytest.mark.parametrize("fmt", ["int8_wo", "nvfp4", "mxfp4"])
def test_weight_only_modules_compute_with_the_dequantised_weight(tiny_model, fmt):
    lin = tiny_model.model.layers[0].mlp.down_proj  # in_features 80: mxfp4 pads to 96
    x = torch.randn(3, lin.in_features)
    quantize_model(tiny_model, fmt)
    mod = tiny_model.model.layers[0].mlp.down_proj
    w = dequantize_weight(mod.weight_tensors(), fmt, mod.in_features)
    assert torch.equal(mod(x), torch.nn.functional.linear(x, w))


def test_bf16_module_runs_its_matmul_in_bf16(tiny_model):
    lin = tiny_model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 5, lin.in_features)
    expected = torch.nn.functional.linear(x.bfloat16(), lin.weight.bfloat16()).float() + lin.bias
    quantize_model(tiny_model, "bf16")
    mod = tiny_model.model.layers[0].self_attn.q_proj
    assert mod.weight.dtype == torch.bfloat16 and mod.bias.dtype == torch.float32
    assert torch.equal(mod(x), expected)


def test_module_output_follows_input_dtype(tiny_model):
    quantize_model(tiny_model, "int8")
    mod = tiny_model.model.layers[0].mlp.up_proj
    assert mod(torch.randn(2, mod.in_features, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_keep_full_precision_matches_dotted_components():
    assert name_matches("model.layers.0.mlp.down_proj", "down_proj")
    assert name_matches("model.layers.0.mlp.down_proj", "layers.0")
    assert not name_matches("model.layers.10.mlp.down_proj", "layers.1")
    assert not name_matches("model.layers.0.mlp.down_proj", "own_proj")
    assert not is_target_linear("lm_head", ())
    assert not is_target_linear("model.layers.0.mlp.down_proj", ("layers.0",))
    assert is_target_linear("model.layers.1.mlp.down_proj", ("layers.0",))


def test_keep_full_precision_leaves_listed_linears_alone(tiny_model):
    quantize_model(tiny_model, "int8", keep_full_precision=("lm_head", "layers.0", "down_proj"))
    kept = [n for n, m in tiny_model.named_modules() if type(m) is nn.Linear]
    assert "model.layers.0.self_attn.q_proj" in kept and "model.layers.1.mlp.down_proj" in kept
    assert isinstance(tiny_model.model.layers[1].self_attn.q_proj, QuantLinear)


def test_converting_twice_or_to_an_unknown_format_is_an_error(tiny_model):
    with pytest.raises(UnknownFormatError, match="int4"):
        quantize_model(tiny_model, "int4")
    quantize_model(tiny_model, "int8")
    with pytest.raises(QuantError, match="already converted"):
        quantize_model(tiny_model, "fp8")


def test_bad_weight_leaves_the_model_unconverted(tiny_model):
    with torch.no_grad():
        tiny_model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(QuantError, match="model.layers.1.mlp.up_proj.weight"):
        quantize_model(tiny_model, "nvfp4")
    assert model_format(tiny_model) == "fp32"
    assert not any(isinstance(m, QuantLinear) for m in tiny_model.modules())


def test_model_without_projections_is_rejected():
    with pytest.raises(QuantError, match="Llama/Qwen2"):
        quantize_model(nn.Sequential(nn.Linear(4, 4)), "int8")
