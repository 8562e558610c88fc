"""FP8 (E4M3, `torch.float8_e4m3fn`): row-wise scaled quantisation and the scaled-matmul rule.

Owns: the fp8 rounding rule (weights per output channel, activations optionally per token), its
inverse and `fp8_linear`, which computes what a real FP8 GEMM (`torch._scaled_mm` with row-wise
scales) computes.

Rounding rule, exact (rows are last-dim vectors):
    s_r     = max(fp32(amax_r / 448), 2**-126)       (never subnormal or zero; zero row: 2**-126)
    q[r, k] = e4m3_rne(clamp(fp32(x[r, k] / s_r), -448, 448))     stored as float8_e4m3fn
`e4m3_rne` is IEEE-style round-to-nearest-even onto the E4M3 grid, subnormals included (smallest
2**-9; magnitudes <= 2**-10 become zero with the sign kept). 448 is the largest finite value.
    dequant = fp32(q) * s_r

Compute rule of a real FP8 kernel, and therefore of `fp8_linear` (x [M, K], codes [N, K]):
    acc = sum_k fp32(qx[m, k]) * fp32(qw[n, k])     products are exact in fp32 (4x4-bit significands)
    y   = fp32(fp32(acc * sx[m]) * sw[n]) (+ bias)
The CPU path runs this as an fp32 GEMM over the decoded codes (torch has no fast CPU FP8 GEMM;
`torch._scaled_mm` on CPU is a correct but many times slower reference, used in the tests; docs/benchmarks.md §5). Results equal a
real kernel up to fp32 summation order, which no two GEMM implementations share. On CUDA sm_89+ the
real kernel runs (kernels.py, `scaled_mm`) on the codes of `quantize_act_fp8_codes`, the same codes. Weight-only mode
(activations not quantised): acc = sum_k x[m, k] * fp32(qw[n, k]), y = acc * sw[n].

Must never: store the weights as anything but float8 codes plus fp32 scales.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .int8 import MIN_SCALE, check_matrix, row_amax

E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
E4M3_TO_FP32 = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()  # byte -> its exact value


def e4m3_to_fp32(t: Tensor) -> Tensor:
    """float8_e4m3fn -> fp32 (exactly `t.float()`: the table is made by that conversion), through a
    256-entry table: torch's elementwise float8 conversion costs ~3 ns per element on this CPU, a
    look-up ~0.4 (it was most of the NVFP4 block-scale work)."""
    idx = t.reshape(-1).view(torch.uint8).to(torch.int32)
    return torch.index_select(E4M3_TO_FP32.to(t.device), 0, idx).view(t.shape)


def quantize_fp8_rows(x: Tensor, *, name: str | None = None) -> tuple[Tensor, Tensor]:
    """x: [R, K] float -> codes [R, K] float8_e4m3fn, scale [R] fp32 (rule in the module docstring)."""
    check_matrix(x, name)
    xf = x.float()
    scale = (xf.abs().amax(dim=1) / E4M3_MAX).clamp_(min=MIN_SCALE)
    codes = (xf / scale[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return codes, scale


def dequantize_fp8(codes: Tensor, scale: Tensor) -> Tensor:
    """codes [R, K] float8_e4m3fn, scale [R] fp32 -> [R, K] fp32."""
    return codes.float() * scale[:, None]


def quantize_act_fp8_codes(x2: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token fp8 activation quantisation, the row rule above in 5-6 ops (the hot path: no validation).
    x2: [M, K] fp32 -> codes [M, K] float8_e4m3fn, scale [M, 1] fp32. The same codes on every device:
    amax is exact, the division and the clamp are correctly rounded, the cast rounds to nearest even."""
    scale = row_amax(x2).div_(E4M3_MAX).clamp_(min=MIN_SCALE)
    q = torch.div(x2, scale).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_act_fp8(x2: Tensor) -> tuple[Tensor, Tensor]:
    """`quantize_act_fp8_codes` with the codes decoded to fp32 (exact) for the emulated fp32 GEMM.
    x2: [M, K] fp32 -> codes [M, K] fp32, scale [M, 1] fp32."""
    q, scale = quantize_act_fp8_codes(x2)
    return q.float(), scale


def fp8_linear(
    x2: Tensor,
    w_codes_f32: Tensor,
    sw: Tensor,
    bias: Tensor | None = None,
    *,
    act_quant: bool = True,
) -> Tensor:
    """FP8 scaled linear (rule in the module docstring).

    x2: [M, K] fp32; w_codes_f32: [N, K] fp32 holding the decoded E4M3 weight codes (exact);
    sw: [N] fp32; bias: [N] or None. Returns [M, N] fp32.
    """
    if act_quant:
        qx, sx = quantize_act_fp8(x2)
        y = torch.mm(qx, w_codes_f32.t()).mul_(sx)
    else:
        y = torch.mm(x2, w_codes_f32.t())
    y.mul_(sw)
    if bias is not None:
        y.add_(bias)
    return y
