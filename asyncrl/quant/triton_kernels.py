"""Hand-written Triton kernels for the quantised formats, each with a torch fallback of the same rule.

Owns: three entry points, each running a Triton kernel (triton_src.py) where `runs_triton` says so and its
torch fallback elsewhere:

    wo_linear(x, fmt, tensors, k, bias)   weight-only GEMM (int8_wo, nvfp4, mxfp4): y = x @ W^T (+ bias)
                                          from the stored codes and scales, W decoded in registers
    act_quant_int8(x2)                    per-token int8 activation codes and scales (int8.quantize_act_int8)
    act_quant_fp8(x2)                     per-token E4M3 activation codes and scales (fp8.quantize_act_fp8_codes)

Weight-only rule (the `wo_bf16` rule of kernels.py, without its decoded copy of the weight):
    W[n, k] = the format's dequantised value, by the fp32 ops of formats.dequantize_weight (the same bits):
              int8_wo fp32(code * s[n]); nvfp4 fp32(e2m1(code) * fp32(e4m3(sb_j) * gs)); mxfp4 e2m1(code) * 2**E_j
    y[m, n] = sum_k bf16_rne(x[m, k]) * bf16_rne(W[n, k])   every product exact in fp32, fp32 accumulation
              (+ bias[n] in fp32), then cast to x's dtype (round to nearest even)
The kernel reads the packed E2M1 codes (two per byte, fp4.py's packing), the block scales as their bytes
(E4M3, E8M0) and nvfp4's global scale, and never writes a decoded weight to memory. Against the reference
decode (fp32 W, an fp32 or fp64 GEMM over x) the difference is the two bf16 roundings (|x| and |W| each within
2**-8 relative; none for mxfp4's W, whose values have at most two significant bits) plus fp32 summation order,
K * 2**-24 of sum_k |x| |W|: the bound tests/unit/quant/test_triton_kernels.py checks. Against the `wo_bf16`
rule only the summation order differs (and that rule rounds its output to bf16; this one keeps fp32).

Activation rules: exactly those of int8.py and fp8.py, the same bits (exact amax; IEEE division `div_rn`;
int8 codes rounded half to even by the 1.5 * 2**23 addition; E4M3 codes rounded to nearest even on the fp32
pattern, subnormals included, the sign of zero kept). Like the eager rules they do not validate: a non-finite
activation gives unspecified codes.

Where the Triton kernel runs (`runs_triton`): CUDA tensors when the ``triton`` package is importable, and any
tensor when ``TRITON_INTERPRET=1`` is set in the environment (Triton's interpreter runs the kernels on CPU
tensors with numpy: how the tests exercise them on a CPU). The kernels are decorated on first use, per mode,
so setting the variable at any time before a call is enough (no need to set it before importing triton).
Elsewhere the fallback runs: the eager activation rules, and for the GEMM the rule above in torch (a decode of
W per call, so it holds a temporary decoded copy: a CPU module runs `wo_fp32` instead).

Must never: write the weight buffers, or run a Triton kernel on a CPU tensor without the interpreter.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .formats import dequantize_weight
from .fp4 import MXFP4_BLOCK, NVFP4_BLOCK
from .fp8 import E4M3_MAX, FP8_DTYPE, quantize_act_fp8_codes
from .int8 import INT8_QMAX, quantize_act_int8

WO_FORMATS: dict[str, int] = {"int8_wo": 0, "nvfp4": 1, "mxfp4": 2}
"""Weight-only formats of `wo_linear` -> the kernel's FMT code."""
_BLOCKS = {"int8_wo": 1, "nvfp4": NVFP4_BLOCK, "mxfp4": MXFP4_BLOCK}
ACT_BLOCK = 1024
"""Elements of a row an activation kernel program reads at a time."""


def triton_importable() -> bool:
    """Whether the ``triton`` package is installed (it may still have no GPU to compile for)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's CPU interpreter (Triton's own reading of the variable)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def runs_triton(t: Tensor) -> bool:
    """Whether the entry points run the Triton kernel on tensors like ``t`` (module docstring)."""
    return (t.is_cuda or interpreting()) and triton_importable()


_BUILT: dict[bool, Any] = {}


def _kernels() -> Any:
    """The kernels of triton_src.py decorated with ``triton.jit`` in the current mode (interpreted or compiled),
    once per mode."""
    mode = interpreting()
    if mode not in _BUILT:
        import triton

        from . import triton_src

        _BUILT[mode] = {name: triton.jit(getattr(triton_src, name)) for name in ("wo_gemm_kernel", "act_quant_kernel")}
    return _BUILT[mode]


def _tiles(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): the M tile grows with the batch (16 is tl.dot's least on a GPU); BLOCK_K 64
    holds whole nvfp4 and mxfp4 blocks."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    return block_m, 64 if m > 16 else 32, 64


def wo_linear(x: Tensor, fmt: str, tensors: Mapping[str, Tensor], in_features: int,
              bias: Tensor | None = None) -> Tensor:
    """x [M, K] float (K = in_features) -> y [M, N] in x's dtype, by the weight-only rule of the module docstring
    over the format's stored tensors (formats.py names: qweight, weight_scale, and nvfp4's weight_global_scale).
    One custom op (``asyncrl::wo_linear``), so `torch.compile` and CUDA graphs take it whole."""
    if fmt not in WO_FORMATS:
        raise ValueError(f"wo_linear runs {sorted(WO_FORMATS)}, not {fmt!r}")
    return _wo_linear_op(x, tensors["qweight"], tensors["weight_scale"], tensors.get("weight_global_scale"), bias,
                         fmt, in_features)


@torch.library.custom_op("asyncrl::wo_linear", mutates_args=())
def _wo_linear_op(x: Tensor, qweight: Tensor, weight_scale: Tensor, global_scale: Tensor | None,
                  bias: Tensor | None, fmt: str, in_features: int) -> Tensor:
    tensors = {"qweight": qweight, "weight_scale": weight_scale}
    if global_scale is not None:
        tensors["weight_global_scale"] = global_scale
    assert x.dim() == 2 and x.shape[1] == in_features, (tuple(x.shape), in_features)
    if not runs_triton(x):
        return wo_linear_torch(x, fmt, tensors, in_features, bias)
    return _wo_linear_triton(x, fmt, qweight, weight_scale, global_scale, bias, in_features)


@_wo_linear_op.register_fake
def _(x: Tensor, qweight: Tensor, weight_scale: Tensor, global_scale: Tensor | None, bias: Tensor | None,
      fmt: str, in_features: int) -> Tensor:
    return x.new_empty((x.shape[0], qweight.shape[0]))


def _wo_linear_triton(x: Tensor, fmt: str, codes: Tensor, scale: Tensor, global_scale: Tensor | None,
                      bias: Tensor | None, in_features: int) -> Tensor:
    n, k = codes.shape[0], in_features
    stored = codes.shape[1] * (2 if fmt != "int8_wo" else 1)
    m = x.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    s = scale if fmt == "int8_wo" else scale.view(torch.uint8)
    block_m, block_n, block_k = _tiles(m)
    grid = (-(-m // block_m), -(-n // block_n))
    interp = interpreting()
    _kernels()["wo_gemm_kernel"][grid](
        x, codes, s, global_scale if global_scale is not None else y, bias if bias is not None else y, y,
        m, n, k, stored, x.stride(0), x.stride(1), codes.stride(0), s.stride(0), y.stride(0),
        FMT=WO_FORMATS[fmt], BLOCK=_BLOCKS[fmt], HAS_BIAS=bias is not None, BF16_DOT=not interp,
        OUT_BF16=x.dtype == torch.bfloat16, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        **_compile_options(interp))
    return y


def _compile_options(interp: bool) -> dict[str, Any]:
    """Launch options of a compiled (GPU) kernel: no FMA contraction (the rules round every product; the
    interpreter takes no such option)."""
    return {} if interp else {"enable_fp_fusion": False}


def wo_linear_torch(x: Tensor, fmt: str, tensors: Mapping[str, Tensor], in_features: int,
                    bias: Tensor | None = None) -> Tensor:
    """The fallback of `wo_linear`: the same rule in torch (the bf16-rounded operands held in fp32, whose fp32
    GEMM forms the same exact products), with a temporary decoded weight."""
    w = dequantize_weight(tensors, fmt, in_features).to(torch.bfloat16).float()
    y = torch.mm(x.to(torch.bfloat16).float(), w.t())
    if bias is not None:
        y.add_(bias)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _act_quant(x2: Tensor, fp8: bool) -> tuple[Tensor, Tensor]:
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m, k = x2.shape
    q = torch.empty((m, k), dtype=torch.uint8 if fp8 else torch.int8, device=x2.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x2.device)
    if m and k:
        block = min(ACT_BLOCK, max(16, 1 << (k - 1).bit_length()))
        _kernels()["act_quant_kernel"][(m,)](x2, q, s, k, x2.stride(0), QMAX=E4M3_MAX if fp8 else float(INT8_QMAX),
                                            FP8=fp8, BLOCK=block, **_compile_options(interpreting()))
    return (q.view(FP8_DTYPE) if fp8 else q), s


def act_quant_int8(x2: Tensor) -> tuple[Tensor, Tensor]:
    """x2 [M, K] fp32 -> (codes [M, K] int8, scale [M, 1] fp32): `int8.quantize_act_int8`, bit for bit, one kernel."""
    assert x2.dtype == torch.float32 and x2.dim() == 2, (x2.dtype, x2.dim())
    return _act_quant(x2, fp8=False) if runs_triton(x2) else quantize_act_int8(x2)


def act_quant_fp8(x2: Tensor) -> tuple[Tensor, Tensor]:
    """x2 [M, K] fp32 -> (codes [M, K] float8_e4m3fn, scale [M, 1] fp32): `fp8.quantize_act_fp8_codes`, bit for
    bit, one kernel."""
    assert x2.dtype == torch.float32 and x2.dim() == 2, (x2.dtype, x2.dim())
    return _act_quant(x2, fp8=True) if runs_triton(x2) else quantize_act_fp8_codes(x2)
