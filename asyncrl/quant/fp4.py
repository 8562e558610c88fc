"""FP4 (E2M1) block formats: NVFP4 and MXFP4, with two codes packed per byte.

Owns: the E2M1 grid and its rounding, nibble packing, and the two block-scaled weight formats.

E2M1 code (4 bits): bit 3 = sign, bits 0..2 index the magnitudes
    0, 0.5, 1, 1.5, 2, 3, 4, 6
Rounding `e2m1_rne(v)` (v an fp32 value): nearest grid magnitude, ties to the even index (0.25->0,
0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4), |v| > 6 saturates to 6, the sign bit is the sign
of v (so small negatives encode as -0 = 0b1000, as a hardware convert does).

Packing: element 2j goes to the low nibble and element 2j+1 to the high nibble of byte j.

Blocking and padding rule: blocks run along the input dimension (the last dim of an [N, K] weight).
When K is not a multiple of the block size B, the weight is zero-padded on the right to
Kp = ceil(K / B) * B before quantising (zeros never change a block's amax), codes are stored for all
Kp columns ([N, Kp/2] bytes, padding codes are +0) and dequantisation drops the padded columns. So
every non-empty 2-D shape is blockable; the logical K is the module's `in_features`.

NVFP4 (B = 16), as in NVIDIA's recipe:
    gs      = fp32(amax(|W|) / 2688)        2688 = 6 * 448;  gs = 1 if that is 0
    sb_j    = e4m3_rne(min(fp32(fp32(amax_j / 6) / gs), 448))   per block, float8_e4m3fn
    S_j     = fp32(fp32(sb_j) * gs)
    code    = e2m1_rne(fp32(w / S_j)),  S_j == 0 -> all codes of the block are (signed) zero
    dequant = fp32(e2m1(code) * S_j)
MXFP4 (B = 32), OCP MX v1.0 (floor exponent, saturate):
    E_j     = floor(log2(amax_j)) - 2, clamped to [-127, 127]; E_j = -127 for an all-zero block
    scale   = 2**E_j, stored as E8M0 (biased byte E_j + 127, `torch.float8_e8m0fnu`; 255 = NaN is
              never produced and rejected on load)
    code    = e2m1_rne(w / 2**E_j)       (exact division by a power of two)
    dequant = e2m1(code) * 2**E_j

Must never: round with anything but the rules above (publication and direct quantisation share
these functions, which is what makes a published copy bit-identical to a locally quantised one).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .fp8 import E4M3_MAX, FP8_DTYPE
from .int8 import check_finite_amax, check_matrix, row_chunks

E2M1_MAX = 6.0
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
NVFP4_GLOBAL_DIV = E2M1_MAX * E4M3_MAX  # 2688.0
E8M0_DTYPE = torch.float8_e8m0fnu
E8M0_NAN = 255

_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Decision boundaries between neighbouring magnitudes: index i -> i+1 when |v| > b_i. Midpoints whose
# tie goes up (to an even index) are replaced by the fp32 number just below, turning ">=" into ">".
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
_TIE_UP = torch.tensor([False, True, False, True, False, True, False])
_BOUNDARIES = torch.where(_TIE_UP, torch.nextafter(_MIDPOINTS, torch.zeros(7)), _MIDPOINTS)
_BOUNDARY_VALUES = tuple(float(b) for b in _BOUNDARIES)  # exact: fp32 values are exact Python floats
E2M1_VALUES = torch.tensor(_MAGNITUDES + tuple(-m for m in _MAGNITUDES), dtype=torch.float32)


def e2m1_encode(v: Tensor) -> Tensor:
    """v: fp32 (already divided by its scale) -> uint8 codes 0..15, same shape. NaN is not allowed
    (the callers validate weights first)."""
    # The magnitude index is the number of boundaries |v| exceeds: exactly what
    # torch.bucketize(|v|, _BOUNDARIES, right=False) returns, at a few ns per element instead of
    # ~100 (seven vectorised compares into one reused bool buffer, accumulated in uint8).
    a = v.abs()
    mag = torch.gt(a, _BOUNDARY_VALUES[0]).to(torch.uint8)
    above = torch.empty_like(a, dtype=torch.bool)
    for b in _BOUNDARY_VALUES[1:]:
        mag.add_(torch.gt(a, b, out=above))
    return mag.bitwise_or_(torch.signbit(v).to(torch.uint8).bitwise_left_shift_(3))


def e2m1_decode(codes: Tensor) -> Tensor:
    """codes: uint8 0..15 -> fp32 values."""
    return E2M1_VALUES.to(codes.device)[codes.long()]


def pack_fp4(codes: Tensor) -> Tensor:
    """codes [..., K] uint8 (0..15, K even) -> [..., K/2] uint8, element 2j in the low nibble."""
    assert codes.shape[-1] % 2 == 0, "fp4 packing needs an even number of codes"
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """packed [..., K/2] uint8 -> codes [..., K] uint8."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def _pad_blocks(w: Tensor, block: int) -> Tensor:
    """[N, K] fp32 -> [N, Kp/block, block], zero-padded on the right (the padding rule)."""
    n, k = w.shape
    kp = -(-k // block) * block
    if kp != k:
        w = F.pad(w, (0, kp - k))
    return w.reshape(n, kp // block, block)


def quantize_nvfp4(w: Tensor, *, name: str | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """w: [N, K] float -> (packed [N, Kp/2] uint8, block scales [N, Kp/16] float8_e4m3fn,
    global scale [] fp32); Kp = ceil(K/16)*16. Rule in the module docstring."""
    check_matrix(w, name, finite=False)
    blocks = _pad_blocks(w.float(), NVFP4_BLOCK)
    lo, hi = torch.aminmax(blocks, dim=2)  # max |w| per block, without an |w| temporary
    amax = torch.maximum(lo.neg_(), hi).abs_()  # [N, nb]; abs_: max(+0, -0) may be -0
    check_finite_amax(w, amax, name)
    gs = amax.amax() / NVFP4_GLOBAL_DIV
    gs = torch.where(gs == 0, torch.ones_like(gs), gs)
    sb = (amax / E2M1_MAX / gs).clamp_(max=E4M3_MAX).to(FP8_DTYPE)
    s_eff = sb.float() * gs
    denom = torch.where(s_eff == 0, torch.full_like(s_eff, math.inf), s_eff)
    return _encode_blocks(blocks, denom), sb, gs.reshape(())


def _encode_blocks(blocks: Tensor, denom: Tensor) -> Tensor:
    """Packed codes of e2m1_rne(blocks / denom) ([N, nb, B] / [N, nb] -> [N, nb*B/2] uint8), a chunk of
    rows at a time through one scratch buffer (int8.row_chunks: no full-size temporaries)."""
    n, nb, block = blocks.shape
    packed = torch.empty((n, nb * block // 2), dtype=torch.uint8, device=blocks.device)
    flat = blocks.reshape(n, nb * block)
    for r0, r1, buf in row_chunks(flat):
        q = torch.div(blocks[r0:r1], denom[r0:r1, :, None], out=buf.view(r1 - r0, nb, block))
        packed[r0:r1] = pack_fp4(e2m1_encode(q).reshape(r1 - r0, -1))
    return packed


def dequantize_nvfp4(packed: Tensor, block_scale: Tensor, global_scale: Tensor, k: int) -> Tensor:
    """-> [N, k] fp32 (padding columns dropped)."""
    n, nb = block_scale.shape
    vals = e2m1_decode(unpack_fp4(packed)).reshape(n, nb, NVFP4_BLOCK)
    s_eff = block_scale.float() * global_scale.float()
    return (vals * s_eff[:, :, None]).reshape(n, -1)[:, :k]


def _e8m0_to_fp32(biased: Tensor) -> Tensor:
    """E8M0 biased exponent bytes (uint8, 0..254) -> exact fp32 powers of two 2**(b-127)."""
    b = biased.to(torch.int32)
    bits = torch.where(b > 0, b << 23, torch.full_like(b, 1 << 22))  # b == 0 -> 2**-127 (subnormal)
    return bits.view(torch.float32)


def quantize_mxfp4(w: Tensor, *, name: str | None = None) -> tuple[Tensor, Tensor]:
    """w: [N, K] float -> (packed [N, Kp/2] uint8, scales [N, Kp/32] float8_e8m0fnu);
    Kp = ceil(K/32)*32. Rule in the module docstring."""
    check_matrix(w, name, finite=False)
    blocks = _pad_blocks(w.float(), MXFP4_BLOCK)
    lo, hi = torch.aminmax(blocks, dim=2)
    amax = torch.maximum(lo.neg_(), hi).abs_()  # abs_: an all-zero row or block has amax +0, never -0
    check_finite_amax(w, amax, name)
    _, e = torch.frexp(amax)  # amax = m * 2**e, m in [0.5, 1): floor(log2(amax)) = e - 1
    exp = torch.where(amax > 0, e - 1 - 2, torch.full_like(e, -127)).clamp_(-127, 127)
    biased = (exp + 127).to(torch.uint8)
    scale = _e8m0_to_fp32(biased)
    return _encode_blocks(blocks, scale), biased.view(E8M0_DTYPE)


def dequantize_mxfp4(packed: Tensor, scale: Tensor, k: int) -> Tensor:
    """packed [N, Kp/2] uint8, scale [N, Kp/32] float8_e8m0fnu -> [N, k] fp32."""
    n, nb = scale.shape
    vals = e2m1_decode(unpack_fp4(packed)).reshape(n, nb, MXFP4_BLOCK)
    s = _e8m0_to_fp32(scale.view(torch.uint8))
    return (vals * s[:, :, None]).reshape(n, -1)[:, :k]
