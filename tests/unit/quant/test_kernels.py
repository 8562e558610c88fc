"""Device kernels of the quantised linears, run on CPU tensors against the CPU reference rules.

Covers: storage stability of every buffer across publication loads (all formats, with and without
the quantised head), the fp8 `torch._scaled_mm` path (CPU `_scaled_mm` is a real FP8 GEMM) against
the emulated rule, the bf16 weight-only rule of the CUDA path, bf16 sibling fusion, and the device
choice of `select_kernel`.
"""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.quant import FORMATS, load_published, publish, quantize_fp8_rows, quantize_model
from asyncrl.quant import kernels as K
from asyncrl.quant.fp8 import fp8_linear, quantize_act_fp8_codes
from asyncrl.quant.fused import fuse_siblings
from asyncrl.quant.int8 import int8_epilogue
from asyncrl.quant.linear import Bf16Linear, DecodedLinear, Fp8Linear, QuantLinear
from tests.unit.quant.conftest import make_tiny_qwen2

CUDA = torch.device("cuda")  # a device object only: select_kernel is asked about it, nothing runs there


def _storages(model: torch.nn.Module) -> dict[str, int]:
    out = {n: t.data_ptr() for n, t in model.named_parameters()}
    out |= {n: t.data_ptr() for n, t in model.named_buffers() if t is not None}
    return out


def _caches(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t for n, t in model.named_buffers() if n.rsplit(".", 1)[-1].startswith("_w")}


@pytest.mark.parametrize("head", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_buffer_keeps_its_storage_across_two_publications_and_holds_the_new_values(fmt, head, probe_ids):
    worker = quantize_model(make_tiny_qwen2(seed=1, tie=True), fmt, head=head)
    v1, v2 = make_tiny_qwen2(seed=2, tie=True), make_tiny_qwen2(seed=3, tie=True)
    load_published(worker, publish(v1.state_dict(), fmt, version=1, head=head))
    before = _storages(worker)
    assert any(n.endswith("_w_codes") or n.endswith("_w_decoded") for n in before) == (
        fmt in ("fp8", "int8_wo", "nvfp4", "mxfp4")
        or (fmt == "int8" and K.select_kernel("int8", torch.device("cpu"), 64, 64) == "int_mm_fp32"))
    load_published(worker, publish(v2.state_dict(), fmt, version=2, head=head))
    assert _storages(worker) == before
    direct = quantize_model(copy.deepcopy(v2), fmt, head=head)
    got, want = worker.state_dict(), direct.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), want[name].reshape(-1).view(torch.uint8)), name
    want_caches = _caches(direct)
    for name, t in _caches(worker).items():
        assert torch.equal(t, want_caches[name]), name
    with torch.no_grad():
        assert torch.equal(worker(probe_ids).logits, direct(probe_ids).logits)


def _fp8_pair(seed: int, n: int = 32, k: int = 64, bias: bool = True):
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    emul = Fp8Linear.from_linear(lin)
    real = Fp8Linear.from_linear(lin)
    real.use_kernel("scaled_mm")
    return emul, real


def _scaled_gemm_tolerance(qx, sx, qw, sw) -> torch.Tensor:
    """Per element: fp32 summation order (K terms) plus the two epilogue roundings, as a bound."""
    bound = (qx.double().abs() @ qw.double().abs().t()) * sx.double() * sw.double()[None, :]
    return bound * (qx.shape[1] + 2) * 2.0**-24


@pytest.mark.parametrize("rowwise", [True, False])
def test_scaled_mm_fp8_matches_the_emulated_rule_within_summation_order(rowwise):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 64, generator=g) * torch.exp(torch.randn(9, 1, generator=g))
    qw, sw = quantize_fp8_rows(torch.randn(48, 64, generator=g))
    qx, sx = quantize_act_fp8_codes(x)
    real = K.scaled_mm_fp8(qx, sx, qw, sw, rowwise=rowwise)
    emul = fp8_linear(x, qw.float(), sw)
    exact = (qx.double() @ qw.double().t()) * sx.double() * sw.double()[None, :]
    tol = _scaled_gemm_tolerance(qx, sx, qw, sw)
    assert ((real.double() - exact).abs() <= tol).all()
    assert ((emul.double() - exact).abs() <= tol).all()
    assert ((real.double() - emul.double()).abs() <= 2 * tol).all()


def test_fp8_activation_codes_are_the_row_rule_codes():
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(4)) * 30
    x[2] = 0.0
    qx, sx = quantize_act_fp8_codes(x)
    qr, sr = quantize_fp8_rows(x)
    assert torch.equal(qx.view(torch.uint8), qr.view(torch.uint8))
    assert torch.equal(sx[:, 0], sr)


def test_the_scaled_mm_module_holds_no_decoded_copy_and_agrees_with_the_emulated_module():
    emul, real = _fp8_pair(seed=5)
    assert emul.kernel == "fp8_emul" and emul._w_codes is not None  # CPU default: the reference
    assert real.kernel == "scaled_mm" and real._w_codes is None
    assert "_w_codes" not in dict(real.named_buffers())
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(6))
    y_real, y_emul = real(x), emul(x)
    qx, sx = quantize_act_fp8_codes(x.reshape(-1, 64))
    tol = _scaled_gemm_tolerance(qx, sx, real.qweight, real.weight_scale).reshape(3, 5, -1)
    assert ((y_real.double() - y_emul.double()).abs() <= 2 * tol).all()
    emul.use_kernel("scaled_mm")  # switching drops the copy
    assert emul._w_codes is None and torch.equal(emul(x), y_real)


def test_an_fp8_model_on_scaled_mm_stays_with_its_emulated_twin(probe_ids):
    emul = quantize_model(make_tiny_qwen2(seed=8), "fp8")
    real = copy.deepcopy(emul)
    switched = 0
    for m in real.modules():
        if isinstance(m, Fp8Linear) and m.in_features % 16 == 0 and m.out_features % 16 == 0:
            m.use_kernel("scaled_mm")
            switched += 1
    assert switched == 2 * 5  # q, o, gate, up, down per block; k/v (24 rows) stay emulated
    load_published(real, publish(make_tiny_qwen2(seed=9).state_dict(), "fp8", version=1))
    load_published(emul, publish(make_tiny_qwen2(seed=9).state_dict(), "fp8", version=1))
    assert all(m._w_codes is None for m in real.modules() if getattr(m, "kernel", "") == "scaled_mm")
    with torch.no_grad():
        a, b = real(probe_ids).logits, emul(probe_ids).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_select_kernel_picks_device_kernels_only_for_devices_that_have_them():
    cpu = torch.device("cpu")
    assert K.select_kernel("fp8", cpu, 32, 64) == "fp8_emul"
    assert K.select_kernel("fp8", CUDA, 32, 64, capability=(9, 0)) == "scaled_mm"
    assert K.select_kernel("fp8", CUDA, 32, 64, capability=(8, 9)) == "scaled_mm"
    assert K.select_kernel("fp8", CUDA, 32, 64, capability=(8, 0)) == "fp8_emul"  # A100: no E4M3 cores
    assert K.select_kernel("fp8", CUDA, 24, 64, capability=(9, 0)) == "fp8_emul"  # N % 16 != 0
    assert K.select_kernel("fp8", CUDA, 32, 40, capability=(9, 0)) == "fp8_emul"  # K % 16 != 0
    for fmt in ("int8_wo", "nvfp4", "mxfp4"):
        assert K.select_kernel(fmt, cpu, 32, 64) == "wo_fp32"
        assert K.select_kernel(fmt, cpu, 32, 64, compiler=True) == "wo_fp32"  # CPU: the reference
        assert K.select_kernel(fmt, CUDA, 32, 64, capability=(9, 0), compiler=False) == "wo_bf16"
        assert K.select_kernel(fmt, CUDA, 32, 64, capability=(9, 0), compiler=True) == "wo_triton"
    assert not K.triton_available(cpu)  # an installed triton never makes a CPU device compile for a GPU
    assert K.select_kernel("int8", CUDA, 32, 64, compiler=True) == "int_mm_compiled"
    assert K.select_kernel("int8", CUDA, 32, 64, compiler=False) == "int_mm"
    vnni = frozenset({"avx2", "avx512_vnni"})
    assert K.select_kernel("int8", cpu, 32, 64, compiler=True, cpu_flags=vnni) == "int_mm"  # CPU: the reference
    assert K.select_kernel("bf16", cpu, 32, 64) == "bf16"
    with pytest.raises(ValueError, match="choose one of"):
        K.select_kernel("fp16", cpu, 32, 64)


def test_use_kernel_refuses_what_the_format_or_shape_cannot_run():
    lin = torch.nn.Linear(48, 24)
    fp8 = Fp8Linear.from_linear(lin)
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8.use_kernel("scaled_mm")
    with pytest.raises(ValueError, match="runs one of the kernels"):
        fp8.use_kernel("int_mm")
    with pytest.raises(ValueError, match="fp8_emul"):
        Fp8Linear.from_linear(torch.nn.Linear(48, 32), act_quant=False).use_kernel("scaled_mm")
    assert fp8.kernel == "fp8_emul"


@pytest.mark.parametrize("fmt", ["int8_wo", "nvfp4", "mxfp4"])
def test_weight_only_bf16_kernel_is_the_bf16_rule_over_the_rounded_decoded_weight(fmt, probe_ids):
    model = quantize_model(make_tiny_qwen2(seed=10), fmt)
    ref = copy.deepcopy(model)
    mods = [m for m in model.modules() if isinstance(m, DecodedLinear)]
    for m in mods:
        m.use_kernel("wo_bf16")
    x = torch.randn(4, 48, generator=torch.Generator().manual_seed(11))
    for m, r in zip(mods, [m for m in ref.modules() if isinstance(m, DecodedLinear)], strict=True):
        assert m._w_decoded.dtype == torch.bfloat16 and r._w_decoded.dtype == torch.float32
        assert torch.equal(m._w_decoded, r._w_decoded.to(torch.bfloat16))
        if fmt == "mxfp4":  # e2m1 * 2**E has at most 2 significant bits: exact in bf16
            assert torch.equal(m._w_decoded.float(), r._w_decoded)
        if m.in_features == 48:
            want = torch.nn.functional.linear(x.to(torch.bfloat16), r._w_decoded.to(torch.bfloat16)).float()
            if r.bias is not None:
                want = want + r.bias
            assert torch.equal(m(x), want)
    before = {id(m): m._w_decoded.data_ptr() for m in mods}
    load_published(model, publish(make_tiny_qwen2(seed=12).state_dict(), fmt, version=1))
    load_published(ref, publish(make_tiny_qwen2(seed=12).state_dict(), fmt, version=1))
    assert {id(m): m._w_decoded.data_ptr() for m in mods} == before  # decoded in place, in bf16
    for m, r in zip(mods, [m for m in ref.modules() if isinstance(m, DecodedLinear)], strict=True):
        assert torch.equal(m._w_decoded, r._w_decoded.to(torch.bfloat16))
    with torch.no_grad():
        torch.testing.assert_close(model(probe_ids).logits, ref(probe_ids).logits, atol=0.05, rtol=0.05)


def _dissolved(model):
    out = copy.deepcopy(model)
    for m in out.modules():
        if isinstance(m, QuantLinear) and m._group is not None:
            m._group.dissolve()
    return out


def test_bf16_siblings_share_one_cast_and_one_gemm_and_match_the_unfused_modules(monkeypatch, probe_ids):
    model = quantize_model(make_tiny_qwen2(seed=13), "bf16")
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.q_proj._group is attn.k_proj._group is attn.v_proj._group is not None
    assert mlp.gate_proj._group is mlp.up_proj._group is not None and attn.o_proj._group is None
    assert attn.v_proj.weight.data_ptr() == attn.q_proj._group.fused["weight"][72].data_ptr()
    plain = _dissolved(model)
    calls: list[tuple[int, ...]] = []
    real = K.linear_bf16
    monkeypatch.setattr("asyncrl.quant.fused.linear_bf16", lambda x, w: calls.append(tuple(w.shape)) or real(x, w))
    x = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(14))
    outs = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    assert calls == [(96, 48)]
    p = plain.model.layers[0].self_attn
    for out, mod in zip(outs, (p.q_proj, p.k_proj, p.v_proj), strict=True):
        want = mod(x)
        assert out.is_contiguous() and out.dtype == torch.float32
        # the same K-term sums rounded once to bf16: equal up to the GEMM's summation order
        torch.testing.assert_close(out, want, atol=0, rtol=2.0**-7)
    with torch.no_grad():
        torch.testing.assert_close(model(probe_ids).logits, plain(probe_ids).logits, atol=1e-2, rtol=1e-2)
    load_published(model, publish(make_tiny_qwen2(seed=15).state_dict(), "bf16", version=1))
    assert attn.q_proj._group is not None and attn.q_proj._group.is_intact()  # loads write through
    assert isinstance(attn.q_proj, Bf16Linear)


def test_compiled_int8_kernel_gives_the_eager_bits(probe_ids):
    """The compiled epilogue (Inductor with EAGER_NUMERICS; here its C++ backend) gives the eager outputs bit for
    bit, and a model on int_mm_compiled (its activation quantisation: ops.CUDA_KERNELS, checked in test_ops.py)
    the eager logits, alone and fused."""
    g = torch.Generator().manual_seed(16)
    for m in (1, 5, 33):
        acc = torch.randint(-(2**20), 2**20, (m, 24), dtype=torch.int32, generator=g)
        sx, sw, bias = torch.rand(m, 1, generator=g), torch.rand(24, generator=g), torch.randn(24, generator=g)
        assert torch.equal(K.int8_epilogue_compiled(acc, sx, sw, bias), int8_epilogue(acc, sx, sw, bias))
    assert not K.int8_epilogue_compiled.failed
    eager = quantize_model(make_tiny_qwen2(seed=17), "int8")
    compiled = copy.deepcopy(eager)
    for mod in compiled.modules():
        if isinstance(mod, QuantLinear):
            mod.use_kernel("int_mm_compiled")
    assert fuse_siblings(compiled) == 4  # fused groups run the compiled kernels too
    assert compiled.model.layers[0].self_attn.q_proj.kernel == "int_mm_compiled"
    with torch.no_grad():
        assert torch.equal(compiled(probe_ids).logits, eager(probe_ids).logits)


@pytest.mark.parametrize(("fmt", "kernel"), [("fp8", "fp8_emul"), ("fp8", "scaled_mm"), ("int8_wo", "wo_bf16"),
                                             ("nvfp4", "wo_bf16"), ("mxfp4", "wo_bf16")])
def test_fp8_and_weight_only_siblings_fuse_and_match_the_unfused_modules(fmt, kernel, monkeypatch, probe_ids):
    model = quantize_model(make_tiny_qwen2(seed=18, hidden=64, inter=96), fmt)  # every shape a multiple of 16
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.use_kernel(kernel)  # dissolves the groups quantize_model formed
    assert fuse_siblings(model) == 4
    attn = model.model.layers[1].self_attn
    assert attn.q_proj._group is attn.v_proj._group is not None and attn.q_proj._group.kernel == kernel
    plain = _dissolved(model)
    calls: list[int] = []
    real = K.scaled_mm_fp8
    monkeypatch.setattr("asyncrl.quant.fused.scaled_mm_fp8", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(19))
    outs = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
    assert len(calls) == (kernel == "scaled_mm")  # one GEMM for the three
    p = plain.model.layers[1].self_attn
    for out, mod in zip(outs, (p.q_proj, p.k_proj, p.v_proj), strict=True):
        assert out.is_contiguous()
        torch.testing.assert_close(out, mod(x), atol=1e-5, rtol=2.0**-7)  # summation order (bf16: one rounding)
    pub = publish(make_tiny_qwen2(seed=20, hidden=64, inter=96).state_dict(), fmt, version=1)
    before = _storages(model)
    load_published(model, pub)
    load_published(plain, pub)
    assert _storages(model) == before and attn.q_proj._group is not None  # decoded in place, rows of one cache
    with torch.no_grad():
        torch.testing.assert_close(model(probe_ids).logits, plain(probe_ids).logits, atol=1e-3, rtol=1e-3)


def test_weight_only_siblings_stay_unfused_on_the_cpu_kernel():
    model = quantize_model(make_tiny_qwen2(seed=21), "nvfp4")
    assert all(m._group is None for m in model.modules() if isinstance(m, QuantLinear))
    assert fuse_siblings(model) == 0  # wo_fp32: each member's addmm is faster on CPU
