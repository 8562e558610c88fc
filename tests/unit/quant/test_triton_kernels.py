"""The Triton kernels of asyncrl/quant/triton_kernels.py, run on CPU tensors by Triton's interpreter.

How the interpreter is turned on: ``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates a function, and
triton_kernels.py decorates its kernels on first use, once per mode. So a test sets the variable
(``monkeypatch.setenv``, the `interpret` fixture) before its first call, in the same process, whatever was
imported before: no subprocess and no import order is needed. Without the variable a CPU tensor runs the torch
fallback (`test_triton_fallback_*`). The interpreter runs each program's tile ops in numpy, so the shapes here are
small (the whole file takes well under a minute on a 2-core CPU).

Covers: the weight-only GEMM (nvfp4, mxfp4, int8_wo) against the reference decode (formats.dequantize_weight,
then an fp64 GEMM) within the bound of the module docstring there, and against its own exact rule (bf16 operands)
within fp32 summation order; every decoded weight bit for bit (an identity input); the activation quantisation
kernels bit for bit against the eager int8 and fp8 rules (zero rows, huge and tiny values, every rounding tie);
a QuantLinear on `wo_triton` (no decoded copy, <= 0.35x the bf16 weight's bytes, a delta load); the fallback;
`torch.compile` over the custom op; and the kernels compiled ahead of time for sm_80 and sm_90 (no GPU needed).
"""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.quant import apply_delta, load_published, make_delta, publish, quantize_model
from asyncrl.quant import triton_kernels as T
from asyncrl.quant.formats import dequantize_weight, quantize_weight
from asyncrl.quant.fp8 import quantize_act_fp8_codes
from asyncrl.quant.int8 import quantize_act_int8
from asyncrl.quant.linear import LINEAR_CLASSES, DecodedLinear
from tests.unit.quant.conftest import make_tiny_qwen2

needs_triton = pytest.mark.skipif(not T.triton_importable(), reason="the triton package is not installed")
U_BF16 = 2.0**-8  # unit roundoff of bf16 (8 significant bits)


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert T.interpreting() and T.runs_triton(torch.empty(1))  # CPU tensors now reach the kernels


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g))  # rows of different scales
    w[1, :16] = 0.0  # an all-zero block (nvfp4; half an mxfp4 block)
    w[2, :32] = 0.0  # an all-zero mxfp4 block: scale byte 0 (2**-127)
    w[3, 16:32] *= 1e-6  # tiny blocks beside large ones: subnormal E4M3 block scales
    return w


def _bound(x: torch.Tensor, w: torch.Tensor, fmt: str) -> torch.Tensor:
    """|y - x @ W^T| per element: bf16 rounding of x and (but for mxfp4, exact in bf16) of W, then fp32 sums
    of K products (+ the bias add)."""
    k = x.shape[1]
    rel = U_BF16 + (0.0 if fmt == "mxfp4" else U_BF16) + U_BF16**2 + (k + 2) * 2.0**-24 * 1.02
    return (x.double().abs() @ w.double().abs().t()) * rel


@needs_triton
@pytest.mark.parametrize(("fmt", "k"), [("nvfp4", 64), ("mxfp4", 64), ("int8_wo", 48), ("mxfp4", 40), ("nvfp4", 24)])
def test_triton_wo_gemm_matches_the_reference_decode(fmt, k, interpret):
    n = 40  # not a multiple of the 32/64-column tile
    tensors = quantize_weight(_weight(n, k, seed=1), fmt)
    w = dequantize_weight(tensors, fmt, k)  # the reference decode, fp32
    wb = w.to(torch.bfloat16).double()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(3)
    for m in (1, 2, 7, 16, 33):
        x = torch.randn(m, k, generator=g) * 3
        y = T.wo_linear(x, fmt, tensors, k, bias)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        ref = x.double() @ w.double().t() + bias.double()
        assert ((y.double() - ref).abs() <= _bound(x, w, fmt) + 1e-30).all(), (fmt, m)
        # its own rule (bf16 operands, exact products): only the fp32 summation order is free
        xb = x.to(torch.bfloat16).double()
        exact = xb @ wb.t() + bias.double()
        order = (xb.abs() @ wb.abs().t() + bias.double().abs()) * (k + 2) * 2.0**-24
        assert ((y.double() - exact).abs() <= order).all(), (fmt, m)
    xh = torch.randn(5, k, generator=g).to(torch.bfloat16)  # a bf16 input gives a bf16 output
    yh = T.wo_linear(xh, fmt, tensors, k)
    assert yh.dtype == torch.bfloat16
    ref = xh.double() @ w.double().t()
    assert ((yh.double() - ref).abs() <= _bound(xh.float(), w, fmt) + ref.abs() * U_BF16).all()


@needs_triton
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "int8_wo"])
def test_triton_wo_gemm_decodes_every_weight_exactly(fmt, interpret):
    """An identity input reads each weight out alone (one non-zero product per sum): the kernel's decode is
    bf16_rne of the reference decode, bit for bit, zero blocks and subnormal block scales included."""
    n, k = 40, 64
    w = _weight(n, k, seed=4)
    w[5] *= 1e30  # huge rows
    w[6] *= 1e-30  # tiny rows (subnormal products of code and scale)
    tensors = quantize_weight(w, fmt)
    ref = dequantize_weight(tensors, fmt, k)
    y = T.wo_linear(torch.eye(k), fmt, tensors, k)
    assert torch.equal(y.t(), ref.to(torch.bfloat16).float())
    if fmt == "mxfp4":  # two significant bits times a power of two: exact in bf16
        assert torch.equal(y.t(), ref)
    if fmt == "nvfp4":
        assert (tensors["weight_scale"].view(torch.uint8) < 8).any()  # a subnormal E4M3 block scale was read


def _act_rows(k: int, qmax: float, seed: int) -> torch.Tensor:
    """Rows of every kind the eager rules must agree on: random scales, zeros, -0, huge, tiny (subnormal),
    and rows whose amax is ``qmax`` (scale 1) holding every rounding tie and its fp32 neighbours."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(k, generator=g) * 10.0 ** float(e) for e in (-3, 0, 3)]
    rows += [torch.zeros(k), -torch.zeros(k), torch.randn(k, generator=g) * 1e37,
             torch.randn(k, generator=g) * 1e-39, torch.randn(k, generator=g) * 1e-44]
    mixed = torch.randn(k, generator=g)
    mixed[::3] = 0.0
    mixed[0] = 3e38 if k > 1 else mixed[0]
    rows.append(mixed)
    if qmax == 127.0:
        ties = torch.arange(-127, 127, dtype=torch.float32) + 0.5
    else:  # E4M3: midpoints between neighbouring codes (subnormal and normal), and the codes themselves
        grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        mids = (grid[1:] + grid[:-1]) / 2
        ties = torch.cat([grid, mids, -mids, torch.tensor([2.0**-10, 2.0**-11, 3 * 2.0**-10])])
    ties = torch.cat([ties, torch.nextafter(ties, torch.full_like(ties, 1e9)),
                      torch.nextafter(ties, torch.full_like(ties, -1e9))])
    for start in range(0, ties.numel() if k >= 64 else 0, max(1, k - 1)):  # the ties, in rows of 64 or more
        r = torch.zeros(k)
        part = ties[start:start + k - 1]
        r[: part.numel()] = part
        r[-1] = -qmax  # amax = qmax: the scale is exactly 1, so x / s = x lands on the ties
        rows.append(r)
    return torch.stack(rows)


@needs_triton
@pytest.mark.parametrize("k", [1, 7, 64, 300, 2500])  # 2500: more than one pass of ACT_BLOCK per row
def test_triton_act_quant_int8_is_bit_equal_to_the_eager_rule(k, interpret):
    x = _act_rows(k, 127.0, seed=k)
    q, s = T.act_quant_int8(x)
    q0, s0 = quantize_act_int8(x)
    assert q.dtype == torch.int8 and s.shape == (x.shape[0], 1)
    assert torch.equal(q, q0) and torch.equal(s.view(torch.int32), s0.view(torch.int32))
    strided = torch.cat([x, x], dim=1)[:, :k]  # a row stride other than K
    q1, s1 = T.act_quant_int8(strided)
    assert torch.equal(q1, q0) and torch.equal(s1, s0)


@needs_triton
@pytest.mark.parametrize("k", [1, 7, 64, 300, 2500])
def test_triton_act_quant_fp8_is_bit_equal_to_the_eager_rule(k, interpret):
    x = _act_rows(k, 448.0, seed=k + 1)
    q, s = T.act_quant_fp8(x)
    q0, s0 = quantize_act_fp8_codes(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (x.shape[0], 1)
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8))  # the sign of zero too
    assert torch.equal(s.view(torch.int32), s0.view(torch.int32))


def _linear(fmt: str, n: int = 40, k: int = 64, seed: int = 5):
    lin = torch.nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(_weight(n, k, seed))
    return LINEAR_CLASSES[fmt].from_linear(lin)


def _weight_bytes(m: torch.nn.Module) -> int:
    """Bytes of every buffer but the bias: the weight's tensors and any compute cache."""
    return sum(t.nbytes for name, t in m.named_buffers() if name != "bias")


@needs_triton
@pytest.mark.parametrize(("fmt", "limit"), [("nvfp4", 0.35), ("mxfp4", 0.35), ("int8_wo", 0.55)])
def test_triton_quant_linear_holds_no_decoded_weight_and_matches_wo_fp32(fmt, limit, interpret):
    ref = _linear(fmt)
    assert ref.kernel == "wo_fp32"  # the CPU default, the reference
    mod = copy.deepcopy(ref)
    mod.use_kernel("wo_triton")
    bf16_bytes = mod.out_features * mod.in_features * 2
    assert mod._w_decoded is None and "_w_decoded" not in dict(mod.named_buffers())
    assert _weight_bytes(mod) <= limit * bf16_bytes
    assert _weight_bytes(ref) > 2 * bf16_bytes  # wo_fp32 holds its fp32 copy besides the codes
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(6))
    y, want = mod(x), ref(x)
    assert y.shape == want.shape == (3, 5, 40)
    w = dequantize_weight(ref.weight_tensors(), fmt, 64)
    bound = _bound(x.reshape(-1, 64), w, fmt).reshape(3, 5, 40) + 2.0**-22 * want.double().abs()
    assert ((y.double() - want.double()).abs() <= bound).all()
    mod.use_kernel("wo_bf16")  # back to a decoded copy, which the switch rebuilds
    assert mod._w_decoded is not None and mod._w_decoded.dtype == torch.bfloat16


@needs_triton
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_triton_linears_take_delta_loads(fmt, interpret, probe_ids):
    """A worker on wo_triton follows deltas (QuantLinear.refresh(changed): nothing to rebuild) to the bytes and
    logits of a worker that loaded each version whole."""
    sds = []
    model = make_tiny_qwen2(seed=30)
    g = torch.Generator().manual_seed(31)
    for _ in range(2):
        sds.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 2e-5)
    pubs = [publish(sd, fmt, version=v) for v, sd in enumerate(sds)]

    def on_triton():
        w = quantize_model(make_tiny_qwen2(seed=99), fmt)
        mods = [m for m in w.modules() if isinstance(m, DecodedLinear)]
        for m in mods:
            m.use_kernel("wo_triton")
        assert mods and all(m._w_decoded is None and m._group is None for m in mods)
        return w

    worker = on_triton()
    load_published(worker, pubs[0])
    delta = make_delta(pubs[0], pubs[1])
    assert any(p.kind == "sparse" for p in delta.parts)  # element writes: refresh(changed) with indices
    apply_delta(worker, delta)
    full = on_triton()
    load_published(full, pubs[1])
    got, want = worker.state_dict(), full.state_dict()
    assert got.keys() == want.keys() and all(
        torch.equal(got[n].reshape(-1).view(torch.uint8), want[n].reshape(-1).view(torch.uint8)) for n in want)
    ref = quantize_model(make_tiny_qwen2(seed=99), fmt)  # wo_fp32, the reference kernel, on the same version
    load_published(ref, pubs[1])
    with torch.no_grad():
        y, y_full, y_ref = worker(probe_ids).logits, full(probe_ids).logits, ref(probe_ids).logits
    assert torch.equal(y, y_full)
    torch.testing.assert_close(y, y_ref, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "int8_wo"])
def test_triton_fallback_runs_without_the_interpreter_on_cpu(fmt, monkeypatch):
    """No TRITON_INTERPRET: a CPU tensor never reaches a Triton kernel (building one fails here) and the torch
    fallback computes the same rule; under the interpreter the kernel agrees with it up to summation order."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(T, "_kernels", lambda: pytest.fail("a Triton kernel was launched for a CPU tensor"))
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(8))
    assert not T.runs_triton(x)
    tensors = quantize_weight(_weight(40, 64, seed=9), fmt)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(10))
    y = T.wo_linear(x, fmt, tensors, 64, bias)
    assert torch.equal(y, T.wo_linear_torch(x, fmt, tensors, 64, bias))
    mod = _linear(fmt)
    mod.use_kernel("wo_triton")
    assert mod._w_decoded is None and torch.equal(mod(x), T.wo_linear_torch(x, fmt, mod.weight_tensors(), 64,
                                                                                  mod.bias))
    for quant, eager in ((T.act_quant_int8, quantize_act_int8), (T.act_quant_fp8, quantize_act_fp8_codes)):
        (q, s), (q0, s0) = quant(x), eager(x)
        assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s, s0)
    if not T.triton_importable():
        return
    monkeypatch.undo()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yk = T.wo_linear(x, fmt, tensors, 64, bias)
    xb, wb = x.to(torch.bfloat16).double(), dequantize_weight(tensors, fmt, 64).to(torch.bfloat16).double()
    order = (xb.abs() @ wb.abs().t() + bias.double().abs()) * 66 * 2.0**-24
    assert ((yk.double() - y.double()).abs() <= 2 * order).all()


def test_triton_wo_linear_is_one_op_under_torch_compile(monkeypatch):
    """The GEMM is a custom op: `torch.compile(fullgraph=True)` takes a wo_triton linear without a graph break."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    mod = _linear("nvfp4")
    mod.use_kernel("wo_triton")
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(11))
    compiled = torch.compile(mod, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), mod(x))


@needs_triton
@pytest.mark.skipif(T.interpreting(), reason="TRITON_INTERPRET is set for the whole run: nothing compiles")
def test_triton_kernels_compile_for_sm80_and_sm90_without_a_gpu():
    """The compiled (GPU) path, built ahead of time on this CPU: bf16 tensor-core GEMMs, correctly rounded
    divisions (`div.rn`, never the approximate `div.full`) and no flush to zero in the activation kernels."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from asyncrl.quant import triton_src

    gemm, act = triton.jit(triton_src.wo_gemm_kernel), triton.jit(triton_src.act_quant_kernel)
    i32 = "i32"
    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "gs_ptr": "*fp32", "b_ptr": "*fp32", "y_ptr": "*bf16",
           **dict.fromkeys(("M", "N", "K", "KS", "stride_xm", "stride_xk", "stride_wn", "stride_sn", "stride_ym"), i32)}
    for cap, fmt in ((90, 1), (80, 2)):
        consts = {"FMT": fmt, "BLOCK": 16 if fmt == 1 else 32, "HAS_BIAS": True, "BF16_DOT": True, "OUT_BF16": True,
                  "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64}
        src = ASTSource(fn=gemm, signature=sig | dict.fromkeys(consts, "constexpr"), constexprs=consts)
        out = triton.compile(src, target=GPUTarget("cuda", cap, 32), options={"enable_fp_fusion": False})
        assert out.asm["cubin"] and "mma" in out.asm["ptx"], cap
    for fp8 in (False, True):
        consts = {"QMAX": 448.0 if fp8 else 127.0, "FP8": fp8, "BLOCK": 1024}
        sig = {"x_ptr": "*fp32", "q_ptr": "*u8" if fp8 else "*i8", "s_ptr": "*fp32", "K": i32, "stride_xm": i32}
        src = ASTSource(fn=act, signature=sig | dict.fromkeys(consts, "constexpr"), constexprs=consts)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm["ptx"]
        assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx and ".ftz" not in ptx
