"""Float64 (numpy) reference implementations of the documented rounding rules, written from the
rule text and not from the library code: grids are built from bit layouts, rounding is a nearest
search with ties to the even code, and every fp32 operation of a rule is an exact float64 operation
rounded once to fp32 (correct for +, *, / of fp32 operands: double rounding is innocuous there)."""

from __future__ import annotations

import numpy as np
import torch


def f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64).astype(np.float32)


def div32(a, b) -> np.ndarray:
    """fp32(a / b) for fp32 operands, via exact-enough float64."""
    return f32(np.asarray(a, np.float64) / np.asarray(b, np.float64))


def mul32(a, b) -> np.ndarray:
    return f32(np.asarray(a, np.float64) * np.asarray(b, np.float64))


def e4m3_grid() -> tuple[np.ndarray, np.ndarray]:
    """(positive finite values ascending, their codes) of float8_e4m3fn, from the bit layout."""
    vals, codes = [], []
    for c in range(0x7F):  # 0x7F is NaN
        e, m = (c >> 3) & 0xF, c & 0x7
        v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        vals.append(v)
        codes.append(c)
    return np.array(vals), np.array(codes)


def e2m1_grid() -> tuple[np.ndarray, np.ndarray]:
    vals, codes = [], []
    for c in range(8):
        e, m = (c >> 1) & 0x3, c & 0x1
        v = (m / 2) if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
        vals.append(v)
        codes.append(c)
    return np.array(vals), np.array(codes)


def round_to_grid(x: np.ndarray, vals: np.ndarray, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nearest grid magnitude, ties to the even code, saturating; sign kept. Returns (values, codes
    with bit (nbits-1) as sign is NOT added: returns magnitude codes and a sign array separately)."""
    x = np.asarray(x, np.float64)
    a = np.minimum(np.abs(x), vals[-1])
    idx = np.clip(np.searchsorted(vals, a), 1, len(vals) - 1)
    lo, hi = idx - 1, idx
    dlo, dhi = a - vals[lo], vals[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (codes[hi] % 2 == 0))
    pick = np.where(pick_hi, hi, lo)
    pick = np.where(a <= vals[0], 0, pick)
    return np.copysign(vals[pick], x), codes[pick]


def ref_int8_rows(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    x = w.double().numpy().astype(np.float32)
    amax = np.abs(x).max(axis=1)
    s = np.maximum(div32(amax, 127.0), np.float32(2.0**-126))
    q = np.clip(np.rint(div32(x, s[:, None])), -127, 127).astype(np.int8)
    return q, s


def ref_fp8_rows(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (decoded code values fp64, e4m3 bytes, scale fp32)."""
    x = w.double().numpy().astype(np.float32)
    amax = np.abs(x).max(axis=1)
    s = np.maximum(div32(amax, 448.0), np.float32(2.0**-126))
    v = np.clip(div32(x, s[:, None]), -448, 448)
    vals, codes = e4m3_grid()
    q, c = round_to_grid(v, vals, codes)
    byte = c.astype(np.uint8) | (np.signbit(v).astype(np.uint8) << 7)
    return q, byte, s


def ref_e2m1(v: np.ndarray) -> np.ndarray:
    """fp32 values -> 4-bit codes (sign bit 3)."""
    vals, codes = e2m1_grid()
    _, c = round_to_grid(v, vals, codes)
    return (c.astype(np.uint8) | (np.signbit(v).astype(np.uint8) << 3)).astype(np.uint8)


def ref_e4m3_value(x: np.ndarray) -> np.ndarray:
    vals, codes = e4m3_grid()
    q, _ = round_to_grid(x, vals, codes)
    return q


def _blocks(w: torch.Tensor, b: int) -> np.ndarray:
    x = w.double().numpy().astype(np.float32)
    n, k = x.shape
    kp = -(-k // b) * b
    return np.pad(x, ((0, 0), (0, kp - k))).reshape(n, kp // b, b)


def ref_nvfp4(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """-> (codes [N, Kp] uint8 unpacked, block scale values [N, nb] fp64, global scale fp32)."""
    blk = _blocks(w, 16)
    gs = div32(np.abs(blk).max(), 2688.0)
    gs = np.float32(1.0) if gs == 0 else gs
    amax = np.abs(blk).max(axis=2)
    ratio = np.minimum(div32(div32(amax, 6.0), gs), 448.0)
    sb = ref_e4m3_value(ratio)
    s_eff = mul32(sb, gs)
    safe = np.where(s_eff == 0, np.float32(1.0), s_eff)
    v = div32(blk, safe[:, :, None])
    v = np.where(s_eff[:, :, None] == 0, np.copysign(0.0, blk), v)
    codes = ref_e2m1(v)
    return codes.reshape(blk.shape[0], -1), sb, gs


def ref_mxfp4(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """-> (codes [N, Kp] uint8 unpacked, biased E8M0 exponent bytes [N, nb])."""
    blk = _blocks(w, 32)
    amax = np.abs(blk).max(axis=2).astype(np.float64)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, -127)
    e = np.clip(e, -127, 127)
    v = blk.astype(np.float64) / np.exp2(e)[:, :, None]
    codes = ref_e2m1(v)
    return codes.reshape(blk.shape[0], -1), (e + 127).astype(np.uint8)
