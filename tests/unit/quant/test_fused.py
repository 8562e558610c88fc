"""int8 sibling fusion: one activation quantisation and one _int_mm per q/k/v (gate/up) group,
bit-identical to the unfused modules, and never stale."""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl import machine
from asyncrl.quant import fused, publish, quantize_model
from asyncrl.quant.cpu_int8 import kernel_status
from asyncrl.quant.fused import fuse_siblings
from asyncrl.quant.publish import load_published
from tests.unit.quant.conftest import make_tiny_qwen2


def _unfused_copy(model):
    out = copy.deepcopy(model)
    for m in out.modules():
        if getattr(m, "_group", None) is not None:
            m._group.dissolve()
    return out


CPU_INT8 = {"int_mm": "avx2 avx512_vnni", "int_mm_avx2": "avx2 fma", "int_mm_fp32": "fma"}
"""Flags of a CPU that picks each CPU int8 kernel: an int8 dot product (VNNI), AVX2 alone, neither."""


@pytest.fixture(params=list(CPU_INT8))
def int8_model(request, monkeypatch):
    """The int8 model on each CPU kernel, chosen as a CPU with (VNNI), with AVX2 only, and without either would."""
    if request.param == "int_mm_avx2" and kernel_status():
        pytest.skip(f"int_mm_avx2 cannot run here: {kernel_status()}")
    monkeypatch.setenv(machine.FLAGS_ENV, CPU_INT8[request.param])
    model = quantize_model(make_tiny_qwen2(seed=11), "int8")
    assert model.model.layers[0].self_attn.q_proj.kernel == request.param
    return model


def test_quantize_model_fuses_qkv_and_gate_up_of_every_block(int8_model):
    attn = int8_model.model.layers[1].self_attn
    mlp = int8_model.model.layers[1].mlp
    assert attn.q_proj._group is attn.k_proj._group is attn.v_proj._group is not None
    assert mlp.gate_proj._group is mlp.up_proj._group is not None
    assert attn.o_proj._group is None and mlp.down_proj._group is None
    g = attn.q_proj._group
    assert attn.k_proj.qweight.data_ptr() == g.codes[48].data_ptr()  # a view of the fused storage
    assert tuple(attn.k_proj.qweight.shape) == (24, 48) and tuple(attn.k_proj.bias.shape) == (24,)


def test_fused_model_is_bit_identical_to_unfused(int8_model, probe_ids):
    plain = _unfused_copy(int8_model)
    assert plain.model.layers[0].self_attn.q_proj._group is None
    with torch.no_grad():
        assert torch.equal(int8_model(probe_ids).logits, plain(probe_ids).logits)


def test_one_integer_matmul_per_group_and_kept_slices_are_used_once(int8_model, monkeypatch):
    calls = []
    attn = int8_model.model.layers[0].self_attn
    name = {"int_mm_avx2": "int8_linear_avx2"}.get(attn.q_proj.kernel, attn.q_proj.kernel)  # the GEMM's function
    real = getattr(fused, name)
    monkeypatch.setattr(fused, name, lambda *args: calls.append(tuple(real(*args).shape)) or real(*args))
    plain = _unfused_copy(int8_model).model.layers[0].self_attn
    x = torch.randn(2, 3, 48)
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    assert calls == [(6, 96)]  # q 48 + k 24 + v 24 output columns in one call
    for name, out in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
        assert torch.equal(out, getattr(plain, name)(x))
    calls.clear()
    attn.k_proj(x)  # its kept slice was consumed: recompute
    assert len(calls) == 1


def test_a_different_input_object_never_gets_a_kept_slice(int8_model):
    attn = int8_model.model.layers[0].self_attn
    plain = _unfused_copy(int8_model).model.layers[0].self_attn
    x1, x2 = torch.randn(4, 48), torch.randn(4, 48)
    attn.q_proj(x1)
    assert torch.equal(attn.k_proj(x2), plain.k_proj(x2))
    assert torch.equal(attn.v_proj(x1.clone()), plain.v_proj(x1))


def test_loads_write_through_to_the_fused_storage(int8_model, probe_ids):
    learner = make_tiny_qwen2(seed=12)
    load_published(int8_model, publish(learner.state_dict(), "int8", version=1))
    direct = _unfused_copy(quantize_model(copy.deepcopy(learner), "int8"))
    assert int8_model.model.layers[0].self_attn.q_proj._group is not None
    with torch.no_grad():
        assert torch.equal(int8_model(probe_ids).logits, direct(probe_ids).logits)


def test_replacing_buffers_dissolves_the_group_and_refusing_returns_to_fused(int8_model, probe_ids):
    ref = _unfused_copy(int8_model)
    int8_model._apply(lambda t: t.clone())  # what a device move does to every buffer
    assert all(getattr(m, "_group", None) is None for m in int8_model.modules())
    with torch.no_grad():
        assert torch.equal(int8_model(probe_ids).logits, ref(probe_ids).logits)
    assert fuse_siblings(int8_model) == 4
    with torch.no_grad():
        assert torch.equal(int8_model(probe_ids).logits, ref(probe_ids).logits)


def test_deepcopy_keeps_an_independent_intact_group(int8_model):
    twin = copy.deepcopy(int8_model)
    g, g2 = int8_model.model.layers[0].mlp.up_proj._group, twin.model.layers[0].mlp.up_proj._group
    assert g2 is not g and g2.is_intact() and g2.codes.data_ptr() != g.codes.data_ptr()
    with torch.no_grad():
        twin.model.layers[0].mlp.up_proj.qweight.zero_()
    assert int(g2.codes.abs().sum()) != 0 and g.codes.ne(0).any()
    assert twin.model.layers[0].mlp.up_proj.qweight.data_ptr() == g2.codes[80].data_ptr()
