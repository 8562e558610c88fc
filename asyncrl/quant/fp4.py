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

Speed: the rules are computed a chunk of rows at a time by e2m1.py (a code table over the fp32 bit
pattern, packing through int16 views, decoding through a byte -> value-pair table), bit for bit the
comparison rule; the block amax is an integer max over the fp32 patterns with the sign bit cleared.

Must never: round with anything but the rules above (publication and direct quantisation share
these functions, which is what makes a published copy bit-identical to a locally quantised one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .e2m1 import E2M1_VALUES, Scratch, decode_pairs, e2m1_encode, encode_packed
from .fp8 import E4M3_MAX, FP8_DTYPE, e4m3_to_fp32
from .int8 import Alloc, check_finite_amax, check_matrix, empty_on

__all__ = ["E2M1_VALUES", "e2m1_encode"]  # re-exported: the codes are part of this module's rule

E2M1_MAX = 6.0
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
NVFP4_GLOBAL_DIV = E2M1_MAX * E4M3_MAX  # 2688.0
E8M0_DTYPE = torch.float8_e8m0fnu
E8M0_NAN = 255  # the one E8M0 byte that is not a power of two: never produced, refused on load
_ABS_BITS = 0x7FFFFFFF  # an fp32 pattern without its sign bit


def unpack_fp4(packed: Tensor) -> Tensor:
    """packed [..., K/2] uint8 -> codes [..., K] uint8."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def _pad_blocks(w: Tensor, block: int) -> Tensor:
    """[N, K] fp32 -> [N, Kp/block, block] contiguous, zero-padded on the right (the padding rule)."""
    n, k = w.shape
    kp = -(-k // block) * block
    if kp != k:
        w = F.pad(w, (0, kp - k))
    return w.contiguous().view(n, kp // block, block)


def _scratch(blocks: Tensor) -> Scratch:
    return Scratch(blocks.shape[1] * blocks.shape[2], blocks.device)


def _block_amax(blocks: Tensor) -> Tensor:
    """max |w| per block ([N, nb, B] fp32 -> [N, nb] fp32), exact. For non-negative fp32 values the
    integer order of the bit patterns is the numeric order, so the max of the patterns with the sign
    bit cleared is the pattern of the max |w| (+0 for an all-zero block, never -0); a NaN pattern is
    larger than inf's and stays a NaN, so `check_finite_amax` still sees it. An integer max over
    16-element blocks is faster than `aminmax(dim=2)` of the floats (docs/benchmarks.md §5, kernel choices)."""
    n, nb, block = blocks.shape
    bits = blocks.view(torch.int32)
    out = torch.empty((n, nb), dtype=torch.int32, device=blocks.device)
    buf = _scratch(blocks)
    for r0 in range(0, n, buf.rows):
        r1 = min(n, r0 + buf.rows)
        a = torch.bitwise_and(bits[r0:r1], _ABS_BITS, out=buf.i32[: (r1 - r0) * nb * block].view(-1, nb, block))
        torch.amax(a, dim=2, out=out[r0:r1])
    return out.view(torch.float32)


def quantize_nvfp4(w: Tensor, *, name: str | None = None,
                   alloc: Alloc | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """w: [N, K] float -> (packed [N, Kp/2] uint8, block scales [N, Kp/16] float8_e4m3fn,
    global scale [] fp32); Kp = ceil(K/16)*16. Rule in the module docstring. ``alloc`` makes the
    packed codes tensor (as for `quantize_int8_rows`)."""
    check_matrix(w, name, finite=False)
    blocks = _pad_blocks(w.float(), NVFP4_BLOCK)
    amax = _block_amax(blocks)  # [N, nb]
    check_finite_amax(w, amax, name)
    gs = amax.amax() / NVFP4_GLOBAL_DIV
    gs = torch.where(gs == 0, torch.ones_like(gs), gs)
    sb = torch.div(amax, E2M1_MAX).div_(gs).clamp_(max=E4M3_MAX).to(FP8_DTYPE)
    s_eff = e4m3_to_fp32(sb).mul_(gs)
    return _encode_blocks(blocks, _zero_to_inf(s_eff), alloc), sb, gs.reshape(())


def _zero_to_inf(s: Tensor) -> Tensor:
    """In place: +0 -> +inf in a tensor of fp32 values >= +0 (a flushed block divides by inf, so its
    codes are signed zeros). On the bit patterns: p == 0 exactly when (p - 1) >> 31 is all ones, and
    then or-ing in inf's exponent makes +inf; four integer passes instead of a bool mask, which torch
    does not vectorise (docs/benchmarks.md §5, kernel choices)."""
    bits = s.view(torch.int32)
    bits.bitwise_or_(torch.sub(bits, 1).bitwise_right_shift_(31).bitwise_and_(0x7F800000))
    return s


def _encode_blocks(blocks: Tensor, denom: Tensor, alloc: Alloc | None = None) -> Tensor:
    """Packed codes of e2m1_rne(blocks / denom) ([N, nb, B] / [N, nb] -> [N, nb*B/2] uint8), a chunk of
    rows at a time through reused scratch buffers (e2m1.encode_packed: no full-size temporaries)."""
    n, nb, block = blocks.shape
    packed = (alloc or empty_on(blocks.device))((n, nb * block // 2), torch.uint8)
    buf = _scratch(blocks)
    for r0 in range(0, n, buf.rows):
        r1 = min(n, r0 + buf.rows)
        q = buf.f32[: (r1 - r0) * nb * block].view(r1 - r0, nb, block)
        torch.div(blocks[r0:r1], denom[r0:r1, :, None], out=q)
        encode_packed(q.view(r1 - r0, -1), packed[r0:r1], buf)
    return packed


def _decode_blocks(packed: Tensor, scale: Tensor, block: int, k: int, out: Tensor | None) -> Tensor:
    """fp32(e2m1(code) * scale of its block) -> [N, k] (into `out` when given: a contiguous [N, k]
    fp32 tensor), a chunk of rows at a time (e2m1.decode_pairs: one table look-up per byte)."""
    n, nb = scale.shape
    kp = nb * block
    packed = packed.contiguous()
    if out is None:
        out = torch.empty((n, k), dtype=torch.float32, device=packed.device)
    assert out.shape == (n, k) and out.dtype == torch.float32 and out.is_contiguous(), "bad decode target"
    buf = Scratch(kp, packed.device)
    for r0 in range(0, n, buf.rows):
        r1 = min(n, r0 + buf.rows)
        vals = decode_pairs(packed[r0:r1], buf).view(r1 - r0, nb, block)
        if k == kp:
            torch.mul(vals, scale[r0:r1, :, None], out=out[r0:r1].view(r1 - r0, nb, block))
        else:
            out[r0:r1] = vals.mul_(scale[r0:r1, :, None]).view(r1 - r0, kp)[:, :k]
    return out


def dequantize_nvfp4(packed: Tensor, block_scale: Tensor, global_scale: Tensor, k: int, *,
                     out: Tensor | None = None) -> Tensor:
    """-> [N, k] fp32 (padding columns dropped; written into `out` when given)."""
    s_eff = e4m3_to_fp32(block_scale).mul_(global_scale.float())
    return _decode_blocks(packed, s_eff, NVFP4_BLOCK, k, out)


def _element_codes(packed: Tensor, elements: Tensor, k: int, block: int) -> tuple[Tensor, Tensor]:
    """(e2m1(code), flat index of its block's scale) of the elements at flat ``elements`` (int64) of the [N, k]
    logical weight whose packed codes are ``packed`` [N, Kp/2]."""
    half = packed.shape[1]
    if 2 * half == k:  # no padding: element e is the nibble e % 2 of byte e // 2, in block e // block
        byte, odd, blk = elements // 2, elements & 1, elements // block
    else:
        rows = elements // k
        cols = elements - rows * k
        byte, odd, blk = rows * half + cols // 2, cols & 1, rows * (2 * half // block) + cols // block
    codes = torch.index_select(packed.reshape(-1), 0, byte).to(torch.int64)
    codes.bitwise_right_shift_(odd.mul_(4)).bitwise_and_(15)
    return torch.index_select(E2M1_VALUES.to(packed.device), 0, codes), blk


def nvfp4_elements(packed: Tensor, block_scale: Tensor, global_scale: Tensor, elements: Tensor, k: int) -> Tensor:
    """`dequantize_nvfp4(..., k).view(-1)[elements]` at those elements only, by its fp32 ops -> [n] fp32."""
    vals, blk = _element_codes(packed, elements, k, NVFP4_BLOCK)
    s_eff = e4m3_to_fp32(torch.index_select(block_scale.reshape(-1), 0, blk)).mul_(global_scale.float())
    return vals.mul_(s_eff)


def mxfp4_elements(packed: Tensor, scale: Tensor, elements: Tensor, k: int) -> Tensor:
    """`dequantize_mxfp4(..., k).view(-1)[elements]` at those elements only, by its fp32 ops -> [n] fp32."""
    vals, blk = _element_codes(packed, elements, k, MXFP4_BLOCK)
    return vals.mul_(_e8m0_to_fp32(torch.index_select(scale.reshape(-1).view(torch.uint8), 0, blk)))


def _e8m0_to_fp32(biased: Tensor) -> Tensor:
    """E8M0 biased exponent bytes (uint8, 0..254) -> exact fp32 powers of two 2**(b-127)."""
    b = biased.to(torch.int32)
    bits = torch.where(b > 0, b << 23, torch.full_like(b, 1 << 22))  # b == 0 -> 2**-127 (subnormal)
    return bits.view(torch.float32)


def quantize_mxfp4(w: Tensor, *, name: str | None = None, alloc: Alloc | None = None) -> tuple[Tensor, Tensor]:
    """w: [N, K] float -> (packed [N, Kp/2] uint8, scales [N, Kp/32] float8_e8m0fnu);
    Kp = ceil(K/32)*32. Rule in the module docstring. ``alloc``: as for `quantize_nvfp4`."""
    check_matrix(w, name, finite=False)
    blocks = _pad_blocks(w.float(), MXFP4_BLOCK)
    amax = _block_amax(blocks)  # +0 for an all-zero block
    check_finite_amax(w, amax, name)
    _, e = torch.frexp(amax)  # amax = m * 2**e, m in [0.5, 1): floor(log2(amax)) = e - 1
    exp = torch.where(amax > 0, e - 1 - 2, torch.full_like(e, -127)).clamp_(-127, 127)
    biased = (exp + 127).to(torch.uint8)
    scale = _e8m0_to_fp32(biased)
    return _encode_blocks(blocks, scale, alloc), biased.view(E8M0_DTYPE)


def dequantize_mxfp4(packed: Tensor, scale: Tensor, k: int, *, out: Tensor | None = None) -> Tensor:
    """packed [N, Kp/2] uint8, scale [N, Kp/32] float8_e8m0fnu -> [N, k] fp32 (into `out` if given)."""
    return _decode_blocks(packed, _e8m0_to_fp32(scale.view(torch.uint8)), MXFP4_BLOCK, k, out)
