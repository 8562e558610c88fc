"""INT8: symmetric row-wise quantisation and the W8A8 integer matmul.

Owns: the int8 rounding rule (shared by weights, per-output-channel, and activations, per-token),
its inverse, and `int8_linear`, the real integer matmul (`torch._int_mm`, int32 accumulation), with
`int_mm_fp32`, the same int32 sums from fp32 GEMMs over the codes (CPUs without an int8 dot product).

Rounding rule, exact (rows are the last-dim vectors of a 2-D tensor):
    amax_r  = max_k |x[r, k]|                         (exact)
    s_r     = max(fp32(amax_r / 127), 2**-126)        (IEEE fp32 division; the scale is never
                                                       subnormal or zero)
    q[r, k] = rne(fp32(x[r, k] / s_r))                as int8, in [-127, 127]; -128 is never produced
    dequant = fp32(q * s_r)
`rne` is round-half-to-even (`torch.round`). No clamp is needed: with a normal s_r,
amax_r / s_r <= 127 * (1 + 2**-24) rounds to at most 127 + 2**-17 in fp32, hence to 127 (so no
clamp pass is made). An all-zero row gets scale 2**-126 and all-zero codes; an
all-equal row maps to codes +-127 with s_r = |value| / 127.

Matmul rule (what `int8_linear` computes for x [M, K], weight codes [N, K]):
    acc = sum_k qx[m, k] * qw[n, k]      exact int32 (needs K <= 133143 = (2**31 - 1) // 127**2)
    y   = fp32(fp32(fp32(acc) * sx[m]) * sw[n]) (+ bias[n] in fp32)

Must never: dequantise the weight on the W8A8 path (that is the point of the integer matmul), or
touch modules and state dicts (see `linear.py`, `publish.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import BlockShapeError, NonFiniteWeightError

INT8_QMAX = 127
INT8_MAX_K = (2**31 - 1) // (INT8_QMAX * INT8_QMAX)  # 133143: largest K with exact int32 sums
MIN_SCALE = 2.0**-126  # smallest normal fp32: floor of every row scale

Alloc = Callable[[tuple[int, ...], torch.dtype], Tensor]
"""Makes an output tensor: (shape, dtype) -> a contiguous tensor on the input's device."""


def empty_on(device: torch.device) -> Alloc:
    return lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device)


def check_matrix(w: Tensor, name: str | None, *, max_k: int | None = None, finite: bool = True) -> None:
    """Raise a QuantError naming `name` unless `w` is a finite, non-empty floating 2-D tensor.
    ``finite=False`` leaves the finiteness pass to the caller, which then checks a reduction that
    NaN and inf propagate through (a row or block amax) with `check_finite_amax`."""
    if w.dim() != 2 or w.shape[0] == 0 or w.shape[1] == 0:
        raise BlockShapeError(
            f"expected a non-empty 2-D [out, in] weight, got shape {tuple(w.shape)}; only linear "
            "weights are quantised, keep other tensors full precision",
            tensor_name=name,
        )
    if not w.is_floating_point():
        raise BlockShapeError(f"expected a floating-point weight, got {w.dtype}", tensor_name=name)
    if max_k is not None and w.shape[1] > max_k:
        raise BlockShapeError(
            f"in_features {w.shape[1]} > {max_k}: int32 accumulation would overflow; keep this "
            "linear in full precision (keep_full_precision=...)",
            tensor_name=name,
        )
    if finite and not all_finite(w):
        _raise_non_finite(w, name)


AMINMAX_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
"""Float dtypes with an `aminmax` kernel (one pass gives min and max)."""


def all_finite(t: Tensor) -> bool:
    """Whether every element of a floating tensor is finite. Exact: NaN and inf propagate through
    min and max, and one vectorised `aminmax` reduction reads the tensor once without writing
    anything (`isfinite(t).all()` writes a bool per element and is many times slower on CPU; docs/benchmarks.md §5)."""
    if t.numel() == 0:
        return True
    if t.dtype == torch.float8_e4m3fn:  # codes and block scales: read the bytes (no aminmax kernel)
        return int(t.detach().reshape(-1).view(torch.uint8).bitwise_and(0x7F).amax()) != 0x7F
    if t.dtype not in AMINMAX_DTYPES:
        return bool(torch.isfinite(t.detach().float()).all())
    lo, hi = torch.aminmax(t.detach())
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def check_finite_amax(w: Tensor, amax: Tensor, name: str | None) -> None:
    """`amax` is a max of |w| over rows or blocks (NaN and inf propagate through it): if any entry is
    not finite, raise the error `check_matrix` raises for `w`. One pass over the reduction instead of
    one over the weight."""
    if not all_finite(amax):  # one aminmax reduction, no bool per element
        _raise_non_finite(w, name)


def _raise_non_finite(w: Tensor, name: str | None) -> None:
    bad = int((~torch.isfinite(w)).sum())
    raise NonFiniteWeightError(
        f"{bad} non-finite value(s) (NaN/inf); fix the learner update before publishing",
        tensor_name=name,
    )


def quantize_int8_rows(x: Tensor, *, name: str | None = None,
                       alloc: Alloc | None = None) -> tuple[Tensor, Tensor]:
    """Row-wise symmetric int8 quantisation (the module docstring gives the exact rule).

    x: [R, K] float (any float dtype; converted to fp32 first, exactly for fp16/bf16)
    returns codes [R, K] int8, scale [R] float32. ``alloc(shape, dtype)`` makes the codes tensor
    (contiguous, on x's device; default ``torch.empty``): publication passes its buffers, so the
    codes are written once, where they are sent from.
    """
    check_matrix(x, name, max_k=None, finite=False)
    xf = x.float()
    # max |x| per row without an |x| temporary: separate amax and amin row reductions are
    # vectorised along the row, faster than aminmax(dim=1) or abs().amax(dim=1) (docs/benchmarks.md §5)
    amax = torch.maximum(xf.amax(dim=1), xf.amin(dim=1).neg_()).abs_()  # abs_: +0 for a zero row
    check_finite_amax(x, amax, name)
    scale = (amax / INT8_QMAX).clamp_(min=MIN_SCALE)
    # |x| <= amax and scale >= fp32(amax / 127) make |x / scale| <= 127 * (1 + 2**-24), which rounds
    # to at most 127: the clamp to [-127, 127] of the rule never changes a code, so it is not a pass.
    codes = (alloc or empty_on(xf.device))(tuple(xf.shape), torch.int8)
    for r0, r1, buf in row_chunks(xf):
        torch.div(xf[r0:r1], scale[r0:r1, None], out=buf).round_()
        codes[r0:r1].copy_(buf)  # exact: the values are already integers in [-127, 127]
    return codes, scale


CHUNK_ELEMENTS = 1 << 18  # 1 MiB of fp32, few Python round trips (chunk sizes: docs/benchmarks.md §5, kernel choices)


def row_chunks(x: Tensor, elements: int = CHUNK_ELEMENTS):
    """(r0, r1, scratch) over the rows of a 2-D tensor, about ``elements`` at a time, with one
    reused fp32 scratch buffer of the chunk's shape. Large weights are quantised through it so the
    full-size temporaries of a one-shot expression (each a fresh allocation the kernel must fault in,
    which costs more than the arithmetic) are never made."""
    rows, k = x.shape
    step = max(1, elements // max(1, k))
    scratch = torch.empty((min(step, rows), k), dtype=torch.float32, device=x.device)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        yield r0, r1, scratch[: r1 - r0]


def dequantize_int8(codes: Tensor, scale: Tensor) -> Tensor:
    """codes [R, K] int8, scale [R] fp32 -> [R, K] fp32 = codes * scale (exact rounding of fp32 mul)."""
    return codes.float() * scale[:, None]


def row_amax(x2: Tensor) -> Tensor:
    """max_k |x2[m, k]| as [M, 1] fp32, exact on every device. CUDA: one reduction kernel (the inf-norm);
    CPU: abs then amax, many times faster there than torch's inf-norm (docs/benchmarks.md §5, kernel choices)."""
    if x2.is_cuda:
        return torch.linalg.vector_norm(x2, float("inf"), dim=1, keepdim=True)
    return x2.abs().amax(dim=1, keepdim=True)


def quantize_act_int8(x2: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token activation quantisation, same rule as `quantize_int8_rows`, in 6-7 ops (no clamp:
    see the module docstring). The decode hot path: no validation (a non-finite activation yields
    garbage codes, as any kernel would), fp32 input expected.
    x2: [M, K] fp32 -> codes [M, K] int8, scale [M, 1] fp32
    """
    codes, scale = quantize_act_int8_f32(x2)
    return codes.to(torch.int8), scale


def quantize_act_int8_f32(x2: Tensor) -> tuple[Tensor, Tensor]:
    """`quantize_act_int8` with the codes left in fp32 (the same integers in [-127, 127], exactly), for
    `int_mm_fp32`. x2: [M, K] fp32 -> codes [M, K] fp32, scale [M, 1] fp32."""
    scale = row_amax(x2).div_(INT8_QMAX).clamp_(min=MIN_SCALE)
    return torch.div(x2, scale).round_(), scale


FP32_EXACT_K = 1024
"""Longest K whose int8 code products sum exactly in fp32: 1024 * 127**2 = 16,516,096 < 2**24, so every
partial sum, in any order, is an integer fp32 holds exactly."""


def int_mm_fp32(a: Tensor, b_t: Tensor) -> Tensor:
    """The int32 sums of `int_mm`, computed by fp32 GEMMs over int8 codes held as fp32 (for CPUs without an
    int8 dot-product instruction, where `torch._int_mm` runs 10-75x slower than an fp32 GEMM).
    a: [M, K] fp32 codes, b_t: [K, N] fp32 codes (a transposed [N, K] weight view) -> [M, N].

    K is cut into `FP32_EXACT_K` slices: each slice's fp32 GEMM is exact (every partial sum an integer below
    2**24), and the slices add in int32. K <= 1024 returns the fp32 sums themselves (exact integers, the same
    values `fp32(acc)` takes in `int8_epilogue`); a longer K returns int32. Either way ``.to(torch.int32)``
    equals `int_mm` on the int8 codes bit for bit (tests/unit/quant/test_int8_fp32_kernel.py)."""
    k = a.shape[1]
    if k <= FP32_EXACT_K:
        return torch.mm(a, b_t)
    acc = torch.mm(a[:, :FP32_EXACT_K], b_t[:FP32_EXACT_K]).to(torch.int32)
    for k0 in range(FP32_EXACT_K, k, FP32_EXACT_K):
        k1 = min(k, k0 + FP32_EXACT_K)
        acc += torch.mm(a[:, k0:k1], b_t[k0:k1]).to(torch.int32)
    return acc


def int_mm(a: Tensor, b_t: Tensor) -> Tensor:
    """Exact int8 x int8 -> int32 matmul. a: [M, K] int8, b_t: [K, N] int8 (a transposed [N, K]
    weight view) -> [M, N] int32.

    CPU: `torch._int_mm` accepts any M, and M=1 with the transposed-view weight is the fastest layout
    (docs/benchmarks.md §5, the int8 batch-1 layout), so nothing is padded. CUDA kernels need M > 16 (and K, N multiples
    of 8): rows are zero-padded to 17 there and the extra rows dropped, which is exact.
    """
    if a.is_cuda and a.shape[0] <= 16:
        return torch._int_mm(F.pad(a, (0, 0, 0, 17 - a.shape[0])), b_t)[: a.shape[0]]
    return torch._int_mm(a, b_t)


def int8_linear(qx: Tensor, sx: Tensor, qw: Tensor, sw: Tensor, bias: Tensor | None = None) -> Tensor:
    """W8A8 linear with int32 accumulation.

    qx: [M, K] int8, sx: [M, 1] or [M] fp32, qw: [N, K] int8, sw: [N] fp32, bias: [N] fp32 or None
    returns y: [M, N] fp32 = fp32(fp32(acc * sx) * sw) + bias
    """
    return int8_epilogue(int_mm(qx, qw.t()), sx if sx.dim() == 2 else sx[:, None], sw, bias)


def int8_epilogue(acc: Tensor, sx: Tensor, sw: Tensor, bias: Tensor | None) -> Tensor:
    """acc [M, N] int32, or fp32 holding integers below 2**24 (`int_mm_fp32`; any strides), sx [M, 1],
    sw [N], bias [N] or None -> contiguous [M, N] fp32
    fp32(fp32(fp32(acc) * sx) * sw) + bias: three correctly rounded ops, never contracted into an FMA."""
    y = acc * sx
    y.mul_(sw)
    if bias is not None:
        y.add_(bias)
    return y
