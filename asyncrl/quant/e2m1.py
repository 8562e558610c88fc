"""E2M1 (fp4) codes at memory speed: encoding by a table over the fp32 bit pattern, packing by integer
views, decoding by a byte -> value-pair table. The rounding rule itself is fp4.py's (module docstring
there); this module only computes it faster, bit for bit (tests/unit/quant/test_e2m1_tables.py checks
every function here against the comparison rule and against the 3847746 implementation).

Why a table. Counting the boundaries |v| exceeds costs ~20 elementwise passes per element (seven
compares into bools, which torch does not vectorise, seven adds, abs, sign). But every E2M1 decision
boundary (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) has at most two mantissa bits, so it sits exactly on
the start of an interval of the 11-bit prefix ``bits >> 21`` (sign, 8 exponent bits, 2 mantissa bits)
of an fp32 number, and inside one such interval every value has the same code, except the interval's
first value when that value is a boundary whose tie goes down (0.25 -> 0, 1.25 -> 1, 2.5 -> 2, 5 -> 4).
Those four boundaries have a clear top mantissa bit (bit 22) and the three whose tie goes up
(0.75 -> 1, 1.75 -> 2, 3.5 -> 4) have it set. So

    index = ((bits + (bits >> 22 & 1) + 2**21 - 1) >> 21) & 0x7FF

moves exactly the interval starts with bit 22 clear (the tie-down boundaries, and non-boundary grid
points, whose neighbour interval has the same code) into the interval below, and the code is
``CODE_TABLE[index]``: six integer passes and one ``index_select`` (a vectorised gather) per element,
with the sign in the index. The table is built from the comparison rule on one value strictly inside
each interval, so it is that rule by construction; +0 and -0, the only patterns with index 0 and 1024
(below every interval), are set explicitly. Saturation (|v| > 6, inf) is in the table too.

Packing: codes of elements 2j and 2j+1 are the low and high byte of one little-endian int16 x, so the
packed byte ``c0 | c1 << 4`` is ``(x >> 4) | (x & 15)`` (c0 < 16), an exact value in 0..255.
Decoding: a byte is two codes, so a 256-entry table of fp32 value pairs (one int64 each) turns every
packed byte into its two values with one ``index_select``.

Work is done a chunk of rows at a time in reused scratch buffers (`Scratch`), sized to stay in cache:
full-size temporaries are fresh allocations the kernel must fault in, which costs more than the
arithmetic. NaN never reaches the encoder (callers validate first); its index is still in range.
"""

from __future__ import annotations

import torch
from torch import Tensor

MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = torch.tensor(MAGNITUDES + tuple(-m for m in MAGNITUDES), dtype=torch.float32)
# Decision boundaries between neighbouring magnitudes: index i -> i+1 when |v| > b_i. Midpoints whose
# tie goes up (to an even index) are replaced by the fp32 number just below, turning ">=" into ">".
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
_TIE_UP = torch.tensor([False, True, False, True, False, True, False])
BOUNDARIES = torch.where(_TIE_UP, torch.nextafter(_MIDPOINTS, torch.zeros(7)), _MIDPOINTS)
_BOUNDARY_VALUES = tuple(float(b) for b in BOUNDARIES)  # exact: fp32 values are exact Python floats

CHUNK_ELEMENTS = 1 << 18  # elements per chunk (2**14..2**19 on the 22M model: docs/benchmarks.md §5, kernel choices)


def e2m1_encode_compare(v: Tensor) -> Tensor:
    """The rule by comparisons (slow; builds `CODE_TABLE` and checks it): v fp32 -> uint8 codes 0..15.
    The magnitude index is the number of boundaries |v| exceeds, exactly what
    ``torch.bucketize(|v|, BOUNDARIES, right=False)`` returns; bit 3 is the sign of v."""
    a = v.abs()
    mag = torch.gt(a, _BOUNDARY_VALUES[0]).to(torch.uint8)
    above = torch.empty_like(a, dtype=torch.bool)
    for b in _BOUNDARY_VALUES[1:]:
        mag.add_(torch.gt(a, b, out=above))
    return mag.bitwise_or_(torch.signbit(v).to(torch.uint8).bitwise_left_shift_(3))


_TOP_BIT = 22  # highest mantissa bit: set for the tie-up boundaries, clear for the tie-down ones
_SHIFT = 21  # sign + exponent + 2 mantissa bits remain


def _code_table() -> Tensor:
    """uint8 [2048]: the code of every fp32 value whose `table_index` is i (module docstring)."""
    i = torch.arange(2048, dtype=torch.int64)
    signed = torch.where(i < 1024, i, i - 2048)  # the index before `& 0x7FF`
    # index t holds the bit patterns p with (p - d) >> 21 == t - 1, d in {0, 1}; a pattern in the middle
    # of that interval is never a boundary or a grid point, so its code is the interval's code
    inside = (((signed - 1) << _SHIFT) + (1 << (_SHIFT - 1))).clamp(-(2**31), 2**31 - 1)
    values = inside.to(torch.int32).view(torch.float32)
    table = e2m1_encode_compare(torch.nan_to_num(values, nan=0.0))  # NaN patterns: never encoded
    table[0] = 0  # +0 (index 0: the only positive pattern moved below its interval)
    table[1024] = 8  # -0
    return table


CODE_TABLE = _code_table()


def table_index(v: Tensor, out: Tensor) -> Tensor:
    """fp32 `v` -> int32 `out` (same shape, may not alias v): the `CODE_TABLE` index of each value."""
    bits = v.view(torch.int32)
    torch.bitwise_right_shift(bits, _TOP_BIT, out=out).bitwise_and_(1).add_(bits)
    return out.add_((1 << _SHIFT) - 1).bitwise_right_shift_(_SHIFT).bitwise_and_(0x7FF)


def e2m1_encode(v: Tensor, scratch: Scratch | None = None) -> Tensor:
    """v: fp32 (already divided by its scale) -> uint8 codes 0..15, same shape. NaN is not allowed
    (the callers validate weights first). With ``scratch`` (v contiguous and at most its size) the
    indices and codes live in its buffers (the codes are a view of ``scratch.u8``)."""
    flat = v.reshape(-1)
    n = flat.numel()
    idx = table_index(flat, torch.empty(n, dtype=torch.int32, device=v.device) if scratch is None else scratch.i32[:n])
    codes = None if scratch is None else scratch.u8[:n]
    return torch.index_select(CODE_TABLE.to(v.device), 0, idx, out=codes).view(v.shape)


def pack_codes(codes: Tensor, out: Tensor) -> Tensor:
    """uint8 codes [..., K] (0..15, K even, contiguous) -> `out` uint8 [..., K/2], element 2j in the
    low nibble of byte j (through int16 pairs: one shift, one and, one or)."""
    x = codes.view(torch.int16)  # little-endian: element 2j is the low byte
    return out.copy_(torch.bitwise_right_shift(x, 4).bitwise_or_(x.bitwise_and(15)))


def _pair_table() -> Tensor:
    """int64 [256]: byte b -> the fp32 values of its low and high nibble, as one 8-byte word."""
    b = torch.arange(256)
    pairs = torch.stack([E2M1_VALUES[b & 15], E2M1_VALUES[b >> 4]], dim=1).contiguous()
    return pairs.view(torch.int64).reshape(256)


PAIR_TABLE = _pair_table()


class Scratch:
    """Reused chunk buffers of one quantisation or decoding call over rows of `k` elements (fp32
    values, int32 indices, uint8 codes, int64 value pairs), each viewed at the chunk's size."""

    def __init__(self, k: int, device: torch.device, elements: int = CHUNK_ELEMENTS) -> None:
        self.rows = chunk_rows(k, elements)
        elements = self.rows * k
        self.f32 = torch.empty(elements, dtype=torch.float32, device=device)
        self.i32 = torch.empty(elements, dtype=torch.int32, device=device)
        self.u8 = torch.empty(elements, dtype=torch.uint8, device=device)
        self.i64 = torch.empty(elements // 2 + 1, dtype=torch.int64, device=device)


def chunk_rows(k: int, elements: int = CHUNK_ELEMENTS) -> int:
    """Rows per chunk for rows of `k` elements (at least one)."""
    return max(1, elements // max(1, k))


def encode_packed(q: Tensor, out: Tensor, scratch: Scratch) -> Tensor:
    """fp32 q [r, K] (K even, contiguous; scratch-sized) -> packed codes written into `out` [r, K/2]."""
    return pack_codes(e2m1_encode(q, scratch), out)


def decode_pairs(packed: Tensor, scratch: Scratch) -> Tensor:
    """uint8 packed [r, Kp/2] (contiguous) -> fp32 values [r, Kp] (a view of the scratch buffer)."""
    n = packed.numel()
    idx = scratch.i32[:n].copy_(packed.view(-1))
    words = torch.index_select(PAIR_TABLE.to(packed.device), 0, idx, out=scratch.i64[:n])
    return words.view(torch.float32).view(packed.shape[0], -1)
