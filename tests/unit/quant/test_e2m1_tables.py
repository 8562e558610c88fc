"""The table-driven fp4 paths (asyncrl/quant/e2m1.py) return the bytes of the 3847746 quantisers
(tests/unit/quant/legacy_quant.py): every interval start of the code table and its neighbours, the
exact E2M1 ties, zeros, tiny, huge and odd shapes, chunk edges, decoding into a reused buffer."""

from __future__ import annotations

import pytest
import torch

from asyncrl.quant import e2m1 as E
from asyncrl.quant import fp4, load_published, publish, quantize_model
from asyncrl.quant.linear import DecodedLinear
from tests.unit.quant import legacy_quant as L
from tests.unit.quant.conftest import make_tiny_qwen2

TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (so -0 vs +0 and NaN payloads count)."""
    return (a.dtype == b.dtype and a.shape == b.shape and
            torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)))


def _every_interval_edge() -> torch.Tensor:
    """For each 11-bit prefix p of a non-NaN fp32 pattern: the patterns p<<21 + {-1, 0, 1, 2**20, 2**21-1}."""
    p = torch.arange(2048, dtype=torch.int64)
    p = p[(p & 0x3FF) <= 0x3FC]  # exponent 255 with mantissa prefix > 0 is NaN only
    starts = torch.where(p < 1024, p, p - 2048) << 21
    offs = torch.tensor([-1, 0, 1, 1 << 20, (1 << 21) - 1])
    bits = (starts[:, None] + offs[None, :]).reshape(-1)
    bits = bits[(bits >= -(2**31)) & (bits < 2**31)].to(torch.int32)
    v = bits.view(torch.float32)
    return v[~torch.isnan(v)]


def test_code_table_matches_the_comparison_rule_at_every_interval_edge_tie_and_special():
    ties = torch.tensor(TIES)
    specials = torch.tensor([0.0, -0.0, 6.0, 7.0, 8.0, 1e30, 3.4e38, float("inf"), 1e-45, 1e-38, 0.5, 1.0, 4.0])
    v = torch.cat([_every_interval_edge(), ties, torch.nextafter(ties, torch.full_like(ties, 10.0)),
                   torch.nextafter(ties, torch.zeros_like(ties)), specials,
                   torch.randn(50_000, generator=torch.Generator().manual_seed(3)) * 4])
    v = torch.cat([v, -v])
    got = fp4.e2m1_encode(v)
    assert torch.equal(got, E.e2m1_encode_compare(v))
    assert torch.equal(got, L.e2m1_encode(v))
    # round half to even at the seven ties: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    assert L.VALUES[fp4.e2m1_encode(ties).long()].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert L.VALUES[fp4.e2m1_encode(-ties).long()].tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]


def test_pack_and_pair_decode_match_the_nibble_rule():
    codes = torch.randint(0, 16, (37, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    out = torch.empty(37, 32, dtype=torch.uint8)
    assert torch.equal(E.pack_codes(codes, out), L.pack(codes))
    vals = E.decode_pairs(out, E.Scratch(64, out.device))
    assert _same(vals, L.VALUES[codes.long()])


def _weights():
    g = torch.Generator().manual_seed(5)
    rows_per_chunk = E.chunk_rows(64)
    for shape in [(1, 1), (3, 17), (5, 33), (2, 2), (13, 200), (rows_per_chunk + 3, 64), (2, E.CHUNK_ELEMENTS + 32)]:
        w = torch.randn(shape, generator=g)
        yield w
        yield w * 1e-30  # tiny: e4m3 block scales flush to 0 (nvfp4), E8M0 at its floor (mxfp4)
        yield w * 1e-42  # subnormal
        yield w * 1e30
        yield torch.full(shape, 3.0e38) * torch.sign(w)  # huge, at the fp32 edge
        yield torch.zeros(shape)
        yield -torch.zeros(shape)
        yield w.half()
        yield w.bfloat16()
        yield w.t().contiguous().t()  # non-contiguous
        spike = w.clone()
        spike.view(-1)[0] = 1e7  # every other NVFP4 block scale flushes to 0: codes are signed zeros
        yield spike
    # exact E2M1 ties after scaling: an MXFP4 block with amax 4 has scale 2**0, so w / scale = w
    tie_row = torch.tensor([*TIES, *(-t for t in TIES), 4.0, -0.0] * 2)
    yield tie_row[None, :].repeat(3, 1)
    yield (tie_row * 2.0**-70)[None, :]  # the same ties at a tiny power-of-two scale


WEIGHTS = list(_weights())


@pytest.mark.parametrize("w", WEIGHTS, ids=[f"{i}-{tuple(w.shape)}-{w.dtype}" for i, w in enumerate(WEIGHTS)])
def test_fp4_quantisers_and_decoders_return_the_3847746_bytes(w):
    k = w.shape[1]
    got, ref = fp4.quantize_nvfp4(w), L.quantize_nvfp4(w)
    assert all(_same(a, b) for a, b in zip(got, ref, strict=True))
    assert _same(fp4.dequantize_nvfp4(*got, k), L.dequantize_nvfp4(*ref, k).contiguous())
    got, ref = fp4.quantize_mxfp4(w), L.quantize_mxfp4(w)
    assert all(_same(a, b) for a, b in zip(got, ref, strict=True))
    out = torch.full((w.shape[0], k), float("nan"))
    assert fp4.dequantize_mxfp4(*got, k, out=out) is out
    assert _same(out, L.dequantize_mxfp4(*ref, k).contiguous())


def test_a_spike_flushes_the_other_nvfp4_blocks_to_signed_zero_codes():
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(9))
    w[0, 0] = 1e7
    packed, sb, _ = fp4.quantize_nvfp4(w)
    assert (sb.view(torch.uint8)[1:] == 0).all()  # flushed scales
    codes = fp4.unpack_fp4(packed)[1:]
    assert torch.equal(codes, torch.signbit(w[1:]).to(torch.uint8) << 3)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_load_decodes_into_the_existing_cache_with_the_3847746_values(fmt):
    actor = quantize_model(make_tiny_qwen2(seed=1), fmt)
    mods = [m for m in actor.modules() if isinstance(m, DecodedLinear)]
    before = [m._w_decoded.data_ptr() for m in mods]
    load_published(actor, publish(make_tiny_qwen2(seed=2).state_dict(), fmt, version=1))
    assert [m._w_decoded.data_ptr() for m in mods] == before  # decoded in place
    for m in mods:
        t = m.weight_tensors()
        if fmt == "nvfp4":
            ref = L.dequantize_nvfp4(t["qweight"], t["weight_scale"], t["weight_global_scale"], m.in_features)
        else:
            ref = L.dequantize_mxfp4(t["qweight"], t["weight_scale"], m.in_features)
        assert _same(m._w_decoded, ref.contiguous())
