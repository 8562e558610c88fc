"""FP8 E4M3: row rule against a float64 grid reference, and the scaled-GEMM compute rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.quant import NonFiniteWeightError, dequantize_fp8, fp8_linear, quantize_fp8_rows
from asyncrl.quant.linear import Fp8Linear
from tests.unit.quant.quant_refs import e4m3_grid, ref_fp8_rows


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()


def test_e4m3_grid_reference_agrees_with_torch_decoding():
    vals, codes = e4m3_grid()
    decoded = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(decoded, vals.astype(np.float32))
    assert vals[-1] == 448.0 and vals[1] == 2.0**-9


def test_fp8_hand_computed_row():
    # amax 448 -> scale 1: values are rounded straight onto the E4M3 grid.
    w = torch.tensor([[448.0, 17.0, 0.1, -3.3, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 0.0]])
    q, s = quantize_fp8_rows(w)
    assert s.item() == 1.0
    # 17 is a tie between 16 and 18 (spacing 2) -> even mantissa 16; 0.1 -> 0.1015625;
    # 2**-10 is a tie between 0 and 2**-9 -> 0; 3 * 2**-10 ties between 2**-9 and 2**-8 -> 2**-8.
    assert q[0].float().tolist() == [448.0, 16.0, 0.1015625, -3.25, 2.0**-9, 0.0, 2.0**-8, 0.0]


def test_fp8_keeps_largest_and_smallest_representable_and_flushes_below():
    w = torch.tensor([[1.0, -448.0, 2.0**-9, 0.49 * 2.0**-9, -0.0]])  # amax 448 -> scale 1
    q, s = quantize_fp8_rows(w)
    assert q[0].float().tolist() == [1.0, -448.0, 2.0**-9, 0.0, 0.0]
    _, br, _ = ref_fp8_rows(w)
    np.testing.assert_array_equal(_bytes(q), br)


def test_fp8_row_maximum_saturates_to_448_despite_fp32_rounding():
    g = torch.Generator().manual_seed(5)
    w = torch.rand(512, 9, generator=g) * torch.exp(torch.randn(512, 1, generator=g) * 10)
    q, _ = quantize_fp8_rows(w)
    assert q.float().amax(dim=1).eq(448.0).all()


def test_fp8_zero_and_all_equal_rows():
    q, s = quantize_fp8_rows(torch.tensor([[0.0, 0.0, 0.0], [-2.5, -2.5, -2.5]]))
    assert s[0].item() == 2.0**-126 and q[0].float().abs().sum().item() == 0.0
    assert q[1].float().tolist() == [-448.0] * 3
    assert dequantize_fp8(q, s)[1].tolist() == pytest.approx([-2.5] * 3, rel=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fp8_random_matches_float64_reference(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(40, 64, generator=g) * torch.exp(torch.randn(40, 64, generator=g) * 3)
    w[0] = 0.0
    w[1] = 0.7
    q, s = quantize_fp8_rows(w)
    qr, br, sr = ref_fp8_rows(w)
    np.testing.assert_array_equal(s.numpy(), sr)
    np.testing.assert_array_equal(_bytes(q), br)
    np.testing.assert_array_equal(q.float().numpy(), qr.astype(np.float32))


def test_fp8_linear_equals_a_real_fp8_kernel():
    """torch._scaled_mm on CPU is a real (slow) FP8 GEMM; the fp32 path over codes must agree
    to fp32 summation order, and both must agree with the exact float64 result."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=g) * 2
    w = torch.randn(24, 64, generator=g)
    qw, sw = quantize_fp8_rows(w)
    qx, sx = quantize_fp8_rows(x)
    y = fp8_linear(x, qw.float(), sw)
    real = torch._scaled_mm(qx, qw.t(), scale_a=sx[:, None], scale_b=sw[None, :], out_dtype=torch.float32)
    exact = (qx.double() @ qw.double().t()) * sx.double()[:, None] * sw.double()[None, :]
    bound = (qx.double().abs() @ qw.double().abs().t()) * sx.double()[:, None] * sw.double()[None, :]
    tol = (bound * 64 * 2.0**-23).max().item()
    assert (y.double() - exact).abs().max().item() <= tol
    assert (real.double() - exact).abs().max().item() <= tol
    torch.testing.assert_close(y, real, atol=tol, rtol=0)


def test_fp8_weight_only_mode_skips_activation_quantisation():
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(32, 8)
    x = torch.randn(3, 32, generator=g)
    mod = Fp8Linear.from_linear(lin, act_quant=False)
    expected = (x @ mod.qweight.float().t()) * mod.weight_scale + lin.bias.detach()
    torch.testing.assert_close(mod(x), expected, atol=1e-6, rtol=1e-6)
    w8a8 = Fp8Linear.from_linear(lin, act_quant=True)
    assert not torch.equal(w8a8(x), mod(x))


def test_fp8_rejects_inf_weight():
    with pytest.raises(NonFiniteWeightError, match="'o'"):
        quantize_fp8_rows(torch.tensor([[1.0, float("inf")]]), name="o")
