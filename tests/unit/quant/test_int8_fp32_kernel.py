"""The int8 kernel of a CPU without an int8 dot product (``int_mm_fp32``) and how the CPU's flags choose it.

``int_mm_fp32`` must give `torch._int_mm`'s int32 sums bit for bit (so a worker on either CPU samples the same
tokens with the same behaviour log-probs), at the largest sums a K slice can hold (every code -127) and across
slices; the CPU flags (faked both ways with ``ASYNCRL_CPU_FLAGS``) decide which kernel a module runs.
"""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl import machine
from asyncrl.quant import kernels as K
from asyncrl.quant import load_published, publish, quantize_model
from asyncrl.quant.fused import fuse_siblings
from asyncrl.quant.int8 import FP32_EXACT_K, int_mm, int_mm_fp32, quantize_act_int8, quantize_act_int8_f32
from asyncrl.quant.linear import Int8Linear
from tests.unit.quant.conftest import make_tiny_qwen2

AVX2 = "fpu sse2 avx avx2 fma"  # a Zen 2/3 or a client Intel CPU: no int8 dot product, no bf16 matmul
VNNI = "fpu sse2 avx avx2 fma avx512f avx512_vnni avx512_bf16"


def _int8(shape, gen, lo=-127, hi=127):
    return torch.randint(lo, hi + 1, shape, generator=gen, dtype=torch.int8)


# K = 1 is left out: torch 2.13's CPU `_int_mm` returns unwritten memory for it (no linear has K = 1)
@pytest.mark.parametrize("k", [3, 1000, FP32_EXACT_K, FP32_EXACT_K + 1, 1536, 4097])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_int_mm_fp32_gives_the_int32_sums_of_int_mm_bit_for_bit(m, k):
    g = torch.Generator().manual_seed(m * 10_000 + k)
    a, w = _int8((m, k), g), _int8((24, k), g)
    want = int_mm(a, w.t())
    got = int_mm_fp32(a.float(), w.float().t())
    assert got.dtype == (torch.float32 if k <= FP32_EXACT_K else torch.int32)
    assert torch.equal(got.to(torch.int32), want)


@pytest.mark.parametrize("k", [FP32_EXACT_K, FP32_EXACT_K + 1, 3 * FP32_EXACT_K])
def test_int_mm_fp32_is_exact_at_the_largest_sums_every_code_minus_127(k):
    # 1024 * 127**2 = 16,516,096: the largest sum one fp32 slice must hold exactly (2**24 = 16,777,216).
    a = torch.full((3, k), -127, dtype=torch.int8)
    w = torch.full((8, k), -127, dtype=torch.int8)
    w[1] = 127  # the most negative sums too
    w[2, ::2] = 126  # and sums that are odd, so no rounding to an even neighbour could hide
    want = int_mm(a, w.t())
    assert int(want.abs().max()) == k * 127 * 127
    assert torch.equal(int_mm_fp32(a.float(), w.float().t()).to(torch.int32), want)


def test_fp32_activation_codes_are_the_int8_codes():
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(3))
    x[1] = 0.0
    qf, sf = quantize_act_int8_f32(x)
    q, s = quantize_act_int8(x)
    assert qf.dtype == torch.float32 and torch.equal(qf.to(torch.int8), q) and torch.equal(sf, s)


def test_the_cpu_flags_choose_the_int8_kernel(monkeypatch):
    cpu = torch.device("cpu")
    for flags, kernel in ((AVX2, "int_mm_fp32"), (VNNI, "int_mm"), ("avx2 avx_vnni", "int_mm"),
                          ("avx512f amx_int8", "int_mm"), ("", "int_mm_fp32")):
        assert K.select_kernel("int8", cpu, 32, 64, cpu_flags=frozenset(flags.split())) == kernel, flags
        monkeypatch.setenv(machine.FLAGS_ENV, flags)
        assert K.select_kernel("int8", cpu, 32, 64) == kernel, flags
        assert Int8Linear.from_linear(torch.nn.Linear(64, 32)).kernel == kernel
    # a CUDA device is never asked about the CPU's flags
    monkeypatch.setenv(machine.FLAGS_ENV, AVX2)
    assert K.select_kernel("int8", torch.device("cuda"), 32, 64, compiler=False) == "int_mm"


def test_the_flags_are_read_and_named(monkeypatch):
    monkeypatch.setenv(machine.FLAGS_ENV, AVX2)
    assert not machine.int8_dot_native() and not machine.bf16_native() and machine.flags_forced()
    line = machine.describe()
    assert "avx2" in line and "no int8 dot product" in line and "no bf16 matmul" in line
    assert machine.FLAGS_ENV in line and f"{machine.cpu_model()}, " in line
    monkeypatch.setenv(machine.FLAGS_ENV, VNNI)
    assert machine.int8_dot_native() and machine.bf16_native()
    assert "avx512_vnni" in machine.describe() and "(no" not in machine.describe()
    record = machine.machine_record()
    assert record["cpu_flags"] == ["avx2", "avx512f", "avx512_vnni", "avx512_bf16"] and record["cpu_flags_forced"]
    monkeypatch.delenv(machine.FLAGS_ENV)
    assert machine.cpu_flags() == machine._cpuinfo()[1]  # this machine's own


def test_an_int8_model_on_the_fp32_kernel_gives_the_int_mm_logits_fused_and_across_loads(monkeypatch, probe_ids):
    monkeypatch.setenv(machine.FLAGS_ENV, VNNI)
    reference = quantize_model(make_tiny_qwen2(seed=21), "int8")
    monkeypatch.setenv(machine.FLAGS_ENV, AVX2)
    model = quantize_model(make_tiny_qwen2(seed=21), "int8")
    kernels = {m.kernel for m in model.modules() if isinstance(m, Int8Linear)}
    assert kernels == {"int_mm_fp32"} and {m.kernel for m in reference.modules() if isinstance(m, Int8Linear)} == {
        "int_mm"}
    fused = copy.deepcopy(model)
    assert fuse_siblings(fused) == 4
    with torch.no_grad():
        want = reference(probe_ids).logits
        assert torch.equal(model(probe_ids).logits, want)
        assert torch.equal(fused(probe_ids).logits, want)
    codes = {n: b.data_ptr() for n, b in fused.named_buffers() if n.endswith("_w_codes")}
    assert codes  # the fp32 copy of the codes is held, and kept in place across a load
    new = make_tiny_qwen2(seed=22)
    load_published(fused, publish(new.state_dict(), "int8", version=1))
    load_published(reference, publish(new.state_dict(), "int8", version=1))
    assert {n: b.data_ptr() for n, b in fused.named_buffers() if n.endswith("_w_codes")} == codes
    with torch.no_grad():
        assert torch.equal(fused(probe_ids).logits, reference(probe_ids).logits)


def test_the_workers_precision_line_names_the_kernels_and_what_to_use_where_a_format_cannot_pay():
    avx2, bf16 = frozenset(AVX2.split()), frozenset(VNNI.split())
    line = K.explain_kernels("int8", {"int_mm_fp32"}, "cpu", avx2)
    assert line.startswith("int8 on int_mm_fp32: exact int8 sums") and "no int8 dot product" in line
    assert K.explain_kernels("int8", {"int_mm"}, "cpu", bf16) == "int8 on int_mm: torch._int_mm on the int8 codes"
    slow = K.explain_kernels("bf16", {"bf16"}, "cpu", avx2)
    assert "no bf16 matmul instructions" in slow and "use quant=fp32 or int8 here" in slow
    assert "use quant" not in K.explain_kernels("bf16", {"bf16"}, "cpu", bf16)
    assert "use quant" not in K.explain_kernels("bf16", {"bf16"}, "cuda", avx2)
    assert K.explain_kernels("fp32", set(), "cpu") == "fp32: full-precision GEMMs"
