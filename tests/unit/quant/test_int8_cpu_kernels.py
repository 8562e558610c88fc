"""The int8 kernels of a CPU without an int8 dot product (``int_mm_avx2``, ``int_mm_fp32``), and how the CPU's
flags choose among them.

Both must give `torch._int_mm`'s int32 sums bit for bit (so a worker on any CPU samples the same tokens with the
same behaviour log-probs): at the largest sums (every code -127, and weight codes of -128 for the AVX2 kernel),
across K slices and the AVX2 kernel's row, column and K tails; the CPU flags (faked with ``ASYNCRL_CPU_FLAGS``)
decide which kernel a module runs, and a machine where the AVX2 kernel cannot be built falls back, saying why.
"""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl import machine
from asyncrl.quant import cpu_int8, load_published, publish, quantize_model
from asyncrl.quant import kernels as K
from asyncrl.quant.fused import fuse_siblings
from asyncrl.quant.int8 import (
    FP32_EXACT_K,
    int8_epilogue,
    int_mm,
    int_mm_fp32,
    quantize_act_int8,
    quantize_act_int8_f32,
)
from asyncrl.quant.linear import Int8Linear
from tests.unit.quant.conftest import make_tiny_qwen2

AVX2 = "fpu sse2 avx avx2 fma"  # a Zen 2/3 or a client Intel CPU: no int8 dot product, no bf16 matmul
NO_AVX2 = "fpu sse2 avx fma"  # neither: int_mm_fp32
AVX2_KERNEL = "int_mm_avx2" if cpu_int8.kernel_status() == "" else "int_mm_fp32"
"""What an AVX2 CPU runs here: the C kernel where this machine can build and run it."""
needs_avx2_kernel = pytest.mark.skipif(cpu_int8.kernel_status() != "", reason=f"int_mm_avx2: {cpu_int8.kernel_status()}")
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
    for flags, kernel in ((AVX2, AVX2_KERNEL), (NO_AVX2, "int_mm_fp32"), (VNNI, "int_mm"), ("avx2 avx_vnni", "int_mm"),
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


@pytest.mark.parametrize("flags,kernel", [(NO_AVX2, "int_mm_fp32"), (AVX2, AVX2_KERNEL)])
def test_an_int8_model_on_a_cpu_kernel_gives_the_int_mm_logits_fused_and_across_loads(monkeypatch, probe_ids, flags,
                                                                                       kernel):
    monkeypatch.setenv(machine.FLAGS_ENV, VNNI)
    reference = quantize_model(make_tiny_qwen2(seed=21), "int8")
    monkeypatch.setenv(machine.FLAGS_ENV, flags)
    model = quantize_model(make_tiny_qwen2(seed=21), "int8")
    kernels = {m.kernel for m in model.modules() if isinstance(m, Int8Linear)}
    assert kernels == {kernel} and {m.kernel for m in reference.modules() if isinstance(m, Int8Linear)} == {
        "int_mm"}
    fused = copy.deepcopy(model)
    assert fuse_siblings(fused) == 4
    with torch.no_grad():
        want = reference(probe_ids).logits
        assert torch.equal(model(probe_ids).logits, want)
        assert torch.equal(fused(probe_ids).logits, want)
    codes = {n: b.data_ptr() for n, b in fused.named_buffers() if n.endswith("_w_codes")}
    assert bool(codes) == (kernel == "int_mm_fp32")  # its fp32 copy of the codes is held, kept in place across a load
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


# ----------------------------------------------------------------------------------------- int_mm_avx2
@needs_avx2_kernel
@pytest.mark.parametrize("k", [2, 31, 32, 33, 95, 576, 1536, 4097])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 33])
@pytest.mark.parametrize("n", [1, 3, 4, 7, 24])
def test_int_mm_avx2_gives_the_int32_sums_of_int_mm_bit_for_bit(m, n, k):
    """Every tail of the kernel: an odd last row of activations, the last N % 4 weight rows, K % 32 in scalar code;
    weight codes over the whole int8 range (-128 too: a publication's bytes are not the quantiser's to vouch for)."""
    g = torch.Generator().manual_seed(m * 1_000_000 + n * 10_000 + k)
    a, w = _int8((m, k), g), _int8((n, k), g, lo=-128)
    want = (a.long() @ w.long().t()).to(torch.int32)  # exact in int64
    got = cpu_int8.int_mm_avx2(a, w)
    assert got.dtype == torch.int32 and got.shape == (m, n)
    assert torch.equal(got, want)
    if k > 2 and not (m == 1 and k > 4000):
        assert torch.equal(got, int_mm(a, w.t()))  # torch._int_mm's own sums (not asked at K = 1; see above)


@needs_avx2_kernel
@pytest.mark.parametrize("k", [1024, 1025, 132_104])
def test_int_mm_avx2_is_exact_at_the_largest_sums(k):
    # every pair product at its largest: |a| = 127 against |w| = 128 is 2 * 16256 = 32512 in a vpmaddubsw lane,
    # below int16's 32767; and K = 132104 is the longest K whose sums of such products fit int32
    a = torch.full((3, k), -127, dtype=torch.int8)
    a[1] = 127
    w = torch.full((6, k), -128, dtype=torch.int8)
    w[1] = 127
    w[2, ::2] = -127
    w[5, 1::3] = 0
    want = (a.long() @ w.long().t())
    assert int(want.abs().max()) == k * 127 * 128 and want.abs().max() < 2**31
    assert torch.equal(cpu_int8.int_mm_avx2(a, w), want.to(torch.int32))


@needs_avx2_kernel
def test_int_mm_avx2_reads_row_strides_and_refuses_what_it_cannot_take():
    g = torch.Generator().manual_seed(5)
    a_wide, w_wide = _int8((4, 100), g), _int8((9, 80), g)
    a, w = a_wide[:, 10:74], w_wide[:, 3:67]  # rows 64 long, 100 and 80 apart
    assert torch.equal(cpu_int8.int_mm_avx2(a, w), (a.long() @ w.long().t()).to(torch.int32))
    assert torch.equal(cpu_int8.int_mm_avx2(a, w_wide[:, :64].t().contiguous().t()), (a.long() @ w_wide[:, :64].long().t()).int())
    with pytest.raises(ValueError, match=r"CPU int8 \[M, K\] and \[N, K\]"):
        cpu_int8.int_mm_avx2(a.float(), w)
    with pytest.raises(ValueError, match="int8"):
        cpu_int8.int_mm_avx2(a, _int8((9, 63), g))


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """The kernel built again, into an empty cache folder, with what the test sets; this process's own after."""
    monkeypatch.setenv(cpu_int8.CACHE_ENV, str(tmp_path / "kernels"))
    cpu_int8._load.cache_clear()
    yield tmp_path / "kernels"
    monkeypatch.undo()
    cpu_int8._load.cache_clear()


@needs_avx2_kernel
def test_the_kernel_is_built_once_into_its_cache_folder_and_loaded_from_it(fresh_kernel):
    assert cpu_int8.kernel_status() == ""
    built = list(fresh_kernel.glob("int8_gemm_avx2-*.so"))
    assert len(built) == 1 and not [p for p in fresh_kernel.iterdir() if p not in built]  # no temporary left
    mtime = built[0].stat().st_mtime_ns
    cpu_int8._load.cache_clear()
    assert cpu_int8.kernel_status() == "" and built[0].stat().st_mtime_ns == mtime  # loaded, not built again
    a = torch.ones(1, 40, dtype=torch.int8)
    assert cpu_int8.int_mm_avx2(a, a).item() == 40


def test_without_a_compiler_an_avx2_cpu_falls_back_to_int_mm_fp32_and_says_why(fresh_kernel, monkeypatch):
    monkeypatch.setenv("CC", str(fresh_kernel / "no-such-cc"))
    why = cpu_int8.kernel_status()
    assert why and ("no-such-cc" in why or "no AVX2" in why), why
    cpu = torch.device("cpu")
    assert K.select_kernel("int8", cpu, 32, 64, cpu_flags=frozenset(AVX2.split())) == "int_mm_fp32"
    line = K.explain_kernels("int8", {"int_mm_fp32"}, "cpu", frozenset(AVX2.split()))
    assert "the AVX2 kernel cannot run: " + why in line
    with pytest.raises(RuntimeError, match="int_mm_avx2 cannot run here: .*int_mm_fp32"):
        cpu_int8.int_mm_avx2(torch.ones(1, 8, dtype=torch.int8), torch.ones(1, 8, dtype=torch.int8))


@needs_avx2_kernel
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (3, 5, 7), (2, 4, 32), (5, 7, 33), (16, 96, 576), (33, 24, 1536)])
def test_the_whole_avx2_linear_gives_the_bits_of_the_int8_rules(m, n, k, bias):
    """Quantisation, GEMM and epilogue in one C call against int8.py's torch ops: ties rounded to even, a zero row
    (the scale's floor), a row of subnormals, and values of very different sizes per row."""
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]
    if k >= 4:
        x[0, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])  # scale 1: the ties go to the even neighbour
    if m >= 3:
        x[1] = 0.0
        x[2] = torch.full((k,), 1e-40) * torch.randn(k, generator=g).sign()
    w = torch.randn(n, k, generator=g)
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(w)
    mod = Int8Linear.from_linear(lin)
    qx, sx = quantize_act_int8(x)
    want = int8_epilogue(int_mm(qx, mod.qweight.t()) if k > 1 else (qx.int() @ mod.qweight.int().t()), sx,
                         mod.weight_scale, mod.bias)
    got = cpu_int8.int8_linear_avx2(x, mod.qweight, mod.weight_scale, mod.bias)
    assert torch.equal(got, want)
    mod.use_kernel("int_mm_avx2")
    assert torch.equal(mod(x), want)  # the module's path


@needs_avx2_kernel
def test_a_nan_activation_makes_its_own_row_nan_and_no_other():
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    x[1, 5] = float("nan")
    mod = Int8Linear.from_linear(torch.nn.Linear(40, 8))
    mod.use_kernel("int_mm_avx2")
    y = mod(x)
    assert y[1].isnan().all() and y[[0, 2]].isfinite().all()
