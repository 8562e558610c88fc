"""The quantisers of commit 3847746, one-shot (no chunks, no tables, no bit tricks), kept as oracles:
the fast paths must return the same bytes. E2M1 rounds by `torch.bucketize` over the boundaries
(3847746 counted the same comparisons), block amax by float `aminmax`, decoding by a gather over the
16 values, int8 codes by `round()` and a float -> int8 cast."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
_TIE_UP = torch.tensor([False, True, False, True, False, True, False])
BOUNDARIES = torch.where(_TIE_UP, torch.nextafter(_MIDPOINTS, torch.zeros(7)), _MIDPOINTS)
_MAG = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
VALUES = torch.tensor(_MAG + tuple(-m for m in _MAG), dtype=torch.float32)


def e2m1_encode(v: Tensor) -> Tensor:
    mag = torch.bucketize(v.abs().contiguous(), BOUNDARIES, right=False).to(torch.uint8)
    return mag | (torch.signbit(v).to(torch.uint8) << 3)


def pack(codes: Tensor) -> Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: Tensor) -> Tensor:
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def _blocks(w: Tensor, block: int) -> Tensor:
    n, k = w.shape
    kp = -(-k // block) * block
    return F.pad(w.float(), (0, kp - k)).reshape(n, kp // block, block)


def _amax(blocks: Tensor) -> Tensor:
    lo, hi = torch.aminmax(blocks, dim=2)
    return torch.maximum(lo.neg_(), hi).abs_()


def quantize_nvfp4(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    blocks = _blocks(w, 16)
    amax = _amax(blocks)
    gs = amax.amax() / 2688.0
    gs = torch.where(gs == 0, torch.ones_like(gs), gs)
    sb = (amax / 6.0 / gs).clamp_(max=448.0).to(torch.float8_e4m3fn)
    s_eff = sb.float() * gs
    denom = torch.where(s_eff == 0, torch.full_like(s_eff, math.inf), s_eff)
    codes = e2m1_encode(blocks / denom[:, :, None]).reshape(w.shape[0], -1)
    return pack(codes), sb, gs.reshape(())


def e8m0_to_fp32(biased: Tensor) -> Tensor:
    b = biased.to(torch.int32)
    return torch.where(b > 0, b << 23, torch.full_like(b, 1 << 22)).view(torch.float32)


def quantize_mxfp4(w: Tensor) -> tuple[Tensor, Tensor]:
    blocks = _blocks(w, 32)
    amax = _amax(blocks)
    _, e = torch.frexp(amax)
    exp = torch.where(amax > 0, e - 1 - 2, torch.full_like(e, -127)).clamp_(-127, 127)
    biased = (exp + 127).to(torch.uint8)
    codes = e2m1_encode(blocks / e8m0_to_fp32(biased)[:, :, None]).reshape(w.shape[0], -1)
    return pack(codes), biased.view(torch.float8_e8m0fnu)


def dequantize(packed: Tensor, scale: Tensor, block: int, k: int) -> Tensor:
    n, nb = scale.shape
    vals = VALUES[unpack(packed).long()].reshape(n, nb, block)
    return (vals * scale[:, :, None]).reshape(n, -1)[:, :k]


def dequantize_nvfp4(packed: Tensor, sb: Tensor, gs: Tensor, k: int) -> Tensor:
    return dequantize(packed, sb.float() * gs.float(), 16, k)


def dequantize_mxfp4(packed: Tensor, sc: Tensor, k: int) -> Tensor:
    return dequantize(packed, e8m0_to_fp32(sc.view(torch.uint8)), 32, k)


def quantize_int8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    xf = x.float()
    amax = torch.maximum(xf.amax(dim=1), xf.amin(dim=1).neg_()).abs_()
    scale = (amax / 127).clamp_(min=2.0**-126)
    return (xf / scale[:, None]).round_().to(torch.int8), scale
