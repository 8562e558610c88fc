"""E2M1 rounding, nibble packing, NVFP4 and MXFP4 against float64 references, padding rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.quant import (
    NonFiniteWeightError,
    dequantize_mxfp4,
    dequantize_nvfp4,
    e2m1_encode,
    quantize_mxfp4,
    quantize_nvfp4,
    unpack_fp4,
)
from asyncrl.quant.e2m1 import E2M1_VALUES, pack_codes
from tests.unit.quant.quant_refs import ref_e2m1, ref_mxfp4, ref_nvfp4


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 -> their fp32 values (the code layout, read off the value table)."""
    return E2M1_VALUES[codes.long()]


def test_e2m1_ties_go_to_the_even_code_and_large_values_saturate():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e30, float("inf")])
    assert e2m1_decode(e2m1_encode(v)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 6.0]


def test_e2m1_just_off_a_tie_rounds_to_the_nearest():
    v = torch.tensor([0.25, 0.75, 1.75, 3.5, 5.0])
    up = torch.nextafter(v, torch.full_like(v, 10.0))
    down = torch.nextafter(v, torch.zeros_like(v))
    assert e2m1_decode(e2m1_encode(up)).tolist() == [0.5, 1.0, 2.0, 4.0, 6.0]
    assert e2m1_decode(e2m1_encode(down)).tolist() == [0.0, 0.5, 1.5, 3.0, 4.0]


def test_e2m1_sign_is_kept_including_negative_zero():
    codes = e2m1_encode(torch.tensor([-6.0, -0.1, -0.0, 0.0, 0.5]))
    assert codes.tolist() == [0xF, 0x8, 0x8, 0x0, 0x1]
    assert e2m1_decode(codes).tolist() == [-6.0, -0.0, -0.0, 0.0, 0.5]


def test_e2m1_random_matches_float64_reference():
    g = torch.Generator().manual_seed(0)
    v = (torch.randn(5000, generator=g) * 3).float()
    v[:16] = torch.tensor(
        [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, 8]
    )
    np.testing.assert_array_equal(e2m1_encode(v).numpy(), ref_e2m1(v.numpy()))


def test_pack_puts_even_element_in_low_nibble_and_unpack_inverts():
    codes = torch.tensor([[0x1, 0xF, 0x8, 0x3]], dtype=torch.uint8)
    packed = pack_codes(codes, torch.empty(1, 2, dtype=torch.uint8))
    assert packed.tolist() == [[0xF1, 0x38]]
    assert torch.equal(unpack_fp4(packed), codes)


def test_nvfp4_hand_computed_block():
    # One block of 16; amax 6 -> global scale 6/2688, block scale e4m3(448) = 448, S = 1.
    w = torch.tensor([[6.0, -6.0, 0.25, 0.75, 1.3, -2.6, 5.0, 0.0] + [0.5] * 8])
    packed, sb, gs = quantize_nvfp4(w)
    assert gs.item() == pytest.approx(6 / 2688, rel=1e-7)
    assert sb.float().tolist() == [[448.0]]
    vals = e2m1_decode(unpack_fp4(packed))[0, :8].tolist()
    assert vals == [6.0, -6.0, 0.0, 1.0, 1.5, -3.0, 4.0, 0.0]
    deq = dequantize_nvfp4(packed, sb, gs, 16)
    assert deq[0, :8].tolist() == pytest.approx([6.0, -6.0, 0.0, 1.0, 1.5, -3.0, 4.0, 0.0], rel=1e-6)


@pytest.mark.parametrize("k", [16, 48, 37, 5])
def test_nvfp4_random_matches_float64_reference_with_padding(k):
    g = torch.Generator().manual_seed(k)
    w = torch.randn(12, k, generator=g) * torch.exp(torch.randn(12, k, generator=g) * 2)
    w[1] = 0.0  # zero row -> zero blocks
    w[2, :] = -0.3  # all-equal row
    w[3, 0] = 1e-9  # block whose e4m3 scale flushes to zero
    w[3, 1:] = 0.0
    packed, sb, gs = quantize_nvfp4(w)
    codes_ref, sb_ref, gs_ref = ref_nvfp4(w)
    kp = -(-k // 16) * 16
    assert packed.shape == (12, kp // 2) and sb.shape == (12, kp // 16) and gs.shape == ()
    assert gs.item() == gs_ref
    np.testing.assert_array_equal(sb.float().numpy(), sb_ref.astype(np.float32))
    np.testing.assert_array_equal(unpack_fp4(packed).numpy(), codes_ref)
    assert unpack_fp4(packed)[:, k:].eq(0).all()  # padding codes are +0
    deq = dequantize_nvfp4(packed, sb, gs, k)
    assert deq.shape == (12, k) and deq[1].eq(0).all() and deq[3].eq(0).all()


def test_nvfp4_all_zero_tensor_uses_global_scale_one():
    packed, sb, gs = quantize_nvfp4(torch.zeros(3, 16))
    assert gs.item() == 1.0 and sb.float().eq(0).all() and packed.eq(0).all()
    assert dequantize_nvfp4(packed, sb, gs, 16).eq(0).all()


def test_mxfp4_hand_computed_block():
    # amax 6 -> floor(log2 6) - 2 = 0 -> scale 1; amax 0.75 -> -3 -> scale 1/8.
    w = torch.zeros(2, 32)
    w[0, :4] = torch.tensor([6.0, -2.6, 0.74, 7.9])
    w[1, :3] = torch.tensor([0.75, 0.1, -0.03])
    w[0, 3] = 5.9  # amax stays in [4, 8) so the exponent is 0
    packed, sc = quantize_mxfp4(w)
    assert sc.view(torch.uint8).tolist() == [[127], [124]]
    vals = e2m1_decode(unpack_fp4(packed))
    assert vals[0, :4].tolist() == [6.0, -3.0, 0.5, 6.0]
    assert vals[1, :3].tolist() == [6.0, 1.0, -0.0]  # 0.75*8 = 6; 0.1*8 = 0.8 -> 1; -0.24 -> -0
    deq = dequantize_mxfp4(packed, sc, 32)
    assert deq[1, :3].tolist() == [0.75, 0.125, -0.0]


def test_mxfp4_values_above_six_times_scale_saturate():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 7.9, 7.0  # exponent floor(log2 7.9) - 2 = 0: 7.9 and 7.0 saturate to 6
    packed, sc = quantize_mxfp4(w)
    assert e2m1_decode(unpack_fp4(packed))[0, :2].tolist() == [6.0, 6.0]


@pytest.mark.parametrize("k", [32, 64, 45, 7])
def test_mxfp4_random_matches_float64_reference_with_padding(k):
    g = torch.Generator().manual_seed(100 + k)
    w = torch.randn(10, k, generator=g) * torch.exp(torch.randn(10, k, generator=g) * 3)
    w[0] = 0.0
    w[1] = 2.0**-140  # below the smallest E8M0 scale range: exponent clamps to -127
    w[2, :] = 3.0
    packed, sc = quantize_mxfp4(w)
    codes_ref, e_ref = ref_mxfp4(w)
    kp = -(-k // 32) * 32
    assert packed.shape == (10, kp // 2) and sc.shape == (10, kp // 32)
    assert sc.dtype == torch.float8_e8m0fnu
    np.testing.assert_array_equal(sc.view(torch.uint8).numpy(), e_ref)
    np.testing.assert_array_equal(unpack_fp4(packed).numpy(), codes_ref)
    assert sc.view(torch.uint8)[0].eq(0).all()  # all-zero block -> 2**-127
    deq = dequantize_mxfp4(packed, sc, k)
    np.testing.assert_array_equal(
        deq.numpy(),
        (
            e2m1_decode(unpack_fp4(packed)).double()
            * (2.0 ** (sc.view(torch.uint8).double() - 127)).repeat_interleave(32, 1)
        )
        .float()[:, :k]
        .numpy(),
    )


def test_mxfp4_largest_exponent_is_representable():
    w = torch.full((1, 32), 3.0e38)
    packed, sc = quantize_mxfp4(w)
    assert sc.view(torch.uint8).item() == 127 + 125
    assert dequantize_mxfp4(packed, sc, 32)[0, 0].item() == pytest.approx(3.0e38, rel=0.34)


def test_fp4_rejects_nan_naming_the_tensor():
    w = torch.ones(2, 16)
    w[0, 0] = float("nan")
    with pytest.raises(NonFiniteWeightError, match="mlp.up_proj.weight"):
        quantize_nvfp4(w, name="mlp.up_proj.weight")
    with pytest.raises(NonFiniteWeightError, match="mlp.up_proj.weight"):
        quantize_mxfp4(w, name="mlp.up_proj.weight")
