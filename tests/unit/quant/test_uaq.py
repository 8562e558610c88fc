"""UAQ folding (docs/algorithms.md §8, test vectors §13.9)."""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.quant import FORMATS, QuantError, fold_uaq, quantize_int8_rows, quantize_model, unfold_uaq
from tests.unit.quant.conftest import make_tiny_qwen2

QKV = ("q_proj", "k_proj", "v_proj")


def test_13_9_quantiser_is_scale_equivariant_for_s_2():
    w = torch.tensor([[0.5, -1.0], [2.0, 0.25]])
    q, s = quantize_int8_rows(w)
    q2, s2 = quantize_int8_rows(w / 2)
    assert torch.equal(q, q2) and torch.equal(s2, s / 2)
    assert s.tolist() == pytest.approx([1 / 127, 2 / 127], rel=1e-7)


def test_13_9_folded_gradient_is_s_times_larger():
    x = torch.tensor([1.0, 2.0])
    w = torch.tensor([[0.5, -1.0], [2.0, 0.25]], requires_grad=True)
    (w @ x)[0].backward()  # dL/dY = [1, 0]
    assert w.grad.tolist() == [[1.0, 2.0], [0.0, 0.0]]
    wf = (w.detach() / 2).requires_grad_(True)
    (wf @ (2 * x))[0].backward()
    assert wf.grad.tolist() == [[2.0, 4.0], [0.0, 0.0]]


def _attn_inputs(model, x):
    """q/k/v outputs of block 0 on the normed input, and the MLP gate/up on its own norm."""
    layer = model.model.layers[0]
    h = layer.input_layernorm(x)
    h2 = layer.post_attention_layernorm(x)
    return [getattr(layer.self_attn, n)(h) for n in QKV] + [layer.mlp.gate_proj(h2), layer.mlp.up_proj(h2)]


def _rel(a, b):
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()


@pytest.mark.parametrize("sites", [("attn_qkv",), ("attn_qkv", "mlp_gate_up")])
def test_13_9_folding_leaves_block_outputs_unchanged_to_fp32_rounding(sites, probe_ids):
    model = make_tiny_qwen2(seed=3)
    x = torch.randn(4, 6, 48, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = _attn_inputs(model, x)
        logits = model(probe_ids).logits
        fold_uaq(model, s=1.5, sites=sites)
        after = _attn_inputs(model, x)
        folded_logits = model(probe_ids).logits
    for a, b in zip(after, before, strict=True):
        assert _rel(a, b) < 1e-6
    assert _rel(folded_logits, logits) < 1e-6
    g = model.model.layers[0].input_layernorm.weight
    assert g.dtype == torch.float32


def test_folding_scales_exactly_the_documented_tensors():
    model = make_tiny_qwen2(seed=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fold_uaq(model, s=1.5)
    after = model.state_dict()
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    expected = sorted(
        [f"model.layers.{i}.input_layernorm.weight" for i in range(2)]
        + [f"model.layers.{i}.self_attn.{n}.weight" for i in range(2) for n in QKV]
    )
    assert changed == expected
    l0 = "model.layers.0."
    assert torch.equal(after[l0 + "input_layernorm.weight"], before[l0 + "input_layernorm.weight"] * 1.5)
    assert torch.equal(after[l0 + "self_attn.k_proj.weight"], before[l0 + "self_attn.k_proj.weight"] / 1.5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_13_9_initial_quantised_model_is_unchanged_for_power_of_two_s(fmt, probe_ids):
    model = make_tiny_qwen2(seed=5)
    plain = quantize_model(copy.deepcopy(model), fmt)
    folded = quantize_model(fold_uaq(copy.deepcopy(model), s=2.0, sites=("attn_qkv", "mlp_gate_up")), fmt)
    with torch.no_grad():
        assert torch.equal(plain(probe_ids).logits, folded(probe_ids).logits)
    if fmt not in ("fp32", "bf16"):
        q = plain.model.layers[1].self_attn.q_proj
        qf = folded.model.layers[1].self_attn.q_proj
        assert torch.equal(q.qweight.view(torch.uint8), qf.qweight.view(torch.uint8))


def test_13_9_s_1_5_moves_a_code_only_at_a_rounding_boundary(probe_ids):
    model = make_tiny_qwen2(seed=6)
    w = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    plain = quantize_model(copy.deepcopy(model), "int8")
    folded = quantize_model(fold_uaq(copy.deepcopy(model), s=1.5), "int8")
    q, qf = plain.model.layers[0].self_attn.q_proj.qweight, folded.model.layers[0].self_attn.q_proj.qweight
    moved = q != qf
    assert moved.float().mean().item() < 1e-3
    ratio = w / (w.abs().amax(dim=1, keepdim=True) / 127)
    frac = (ratio - ratio.floor() - 0.5).abs()
    assert (frac[moved] < 1e-4).all() and ((q.int() - qf.int()).abs() <= 1).all()
    with torch.no_grad():
        a, b = plain(probe_ids).logits, folded(probe_ids).logits
    assert _rel(b, a) < 1e-3


def test_state_dict_folding_returns_a_new_dict_and_unfold_inverts():
    model = make_tiny_qwen2(seed=7)
    sd = model.state_dict()
    before = {k: v.clone() for k, v in sd.items()}
    folded = fold_uaq(sd, s=2.0, sites=("attn_qkv", "mlp_gate_up"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    back = unfold_uaq(folded, s=2.0, sites=("attn_qkv", "mlp_gate_up"))
    assert all(torch.equal(back[k], before[k]) for k in before)
    back15 = unfold_uaq(fold_uaq(sd, s=1.5), s=1.5)
    assert all(torch.allclose(back15[k], before[k], rtol=2e-7, atol=0) for k in before)


def test_uaq_refuses_bf16_weights_unless_s_is_a_power_of_two():
    model = make_tiny_qwen2(seed=8).to(torch.bfloat16)
    with pytest.raises(QuantError, match="fp32 master weights"):
        fold_uaq(model, s=1.5)
    fold_uaq(model, s=2.0)


@pytest.mark.parametrize("s", [0.0, -1.0, float("nan"), float("inf")])
def test_uaq_rejects_bad_scale(s):
    with pytest.raises(QuantError, match="scale s"):
        fold_uaq(make_tiny_qwen2(), s=s)


def test_uaq_rejects_unknown_site_and_non_decoder_models():
    with pytest.raises(QuantError, match="sites"):
        fold_uaq(make_tiny_qwen2(), sites=("o_proj",))
    with pytest.raises(QuantError, match="input_layernorm"):
        fold_uaq({"w": torch.ones(2, 2)})
