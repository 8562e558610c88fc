"""INT8 rows (weights and per-token activations) and the W8A8 integer matmul."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl import machine
from asyncrl.quant import (
    BlockShapeError,
    NonFiniteWeightError,
    dequantize_int8,
    int8_linear,
    quantize_act_int8,
    quantize_int8_rows,
)
from asyncrl.quant.int8 import INT8_MAX_K
from asyncrl.quant.linear import Int8Linear
from tests.unit.quant.quant_refs import ref_int8_rows


def test_int8_hand_computed_matches_uaq_vector_13_9():
    w = torch.tensor([[0.5, -1.0], [2.0, 0.25]])
    q, s = quantize_int8_rows(w)
    assert q.tolist() == [[64, -127], [127, 16]]
    assert s.tolist() == pytest.approx([1 / 127, 2 / 127], rel=1e-7)
    deq = dequantize_int8(q, s)
    torch.testing.assert_close(deq, torch.tensor([[0.503937, -1.0], [2.0, 0.251969]]), atol=1e-6, rtol=0)


def test_int8_rounds_half_to_even():
    # amax 127 -> scale exactly 1, so x / s is x itself and the ties are visible.
    w = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.0]])
    q, s = quantize_int8_rows(w)
    assert s.item() == 1.0
    assert q.tolist() == [[0, 2, 2, 0, -2, -2, 126, 127]]


def test_int8_zero_row_gets_the_floor_scale_and_zero_codes():
    q, s = quantize_int8_rows(torch.zeros(2, 5))
    assert s.tolist() == [2.0**-126] * 2 and int(q.abs().sum()) == 0


def test_int8_all_equal_row_maps_to_plus_minus_127():
    q, s = quantize_int8_rows(torch.tensor([[-0.3] * 6, [7.0] * 6]))
    assert q.tolist() == [[-127] * 6, [127] * 6]
    assert s[1].item() == pytest.approx(7.0 / 127, rel=1e-7)


def test_int8_never_produces_minus_128_and_saturates_at_amax():
    w = torch.tensor([[-3.0, 3.0, -2.9999999, 1e-30]])
    q, _ = quantize_int8_rows(w)
    assert q.min().item() == -127 and q.max().item() == 127


def test_int8_tiny_subnormal_row_uses_the_floor_scale():
    # amax / 127 below 2**-126 is floored there: the codes of tiny rows shrink instead of overflowing.
    w = torch.tensor([[2.0**-149, -(2.0**-149)], [1e-38, 3e-39], [2.0**-126 * 127, 2.0**-126 * 63.5]])
    q, s = quantize_int8_rows(w)
    qr, sr = ref_int8_rows(w)
    assert s.tolist() == [2.0**-126] * 3
    assert q.tolist() == [[0, 0], [1, 0], [127, 64]]
    np.testing.assert_array_equal(q.numpy(), qr)
    np.testing.assert_array_equal(s.numpy(), sr)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_int8_random_matches_float64_reference(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(33, 70, generator=g) * torch.exp(torch.randn(33, 1, generator=g) * 4)
    w[3] = 0.0
    w[5] = 1.25
    q, s = quantize_int8_rows(w)
    qr, sr = ref_int8_rows(w)
    np.testing.assert_array_equal(q.numpy(), qr)
    np.testing.assert_array_equal(s.numpy(), sr)


def test_int8_activation_fast_path_without_clamp_equals_row_rule():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4096, 64, generator=g) * torch.exp(torch.randn(4096, 1, generator=g) * 15)
    x[2] = 0.0
    x[3] = 1e-40
    x[4, :] = -7.0
    qa, sa = quantize_act_int8(x)
    qr, sr = quantize_int8_rows(x)
    assert torch.equal(qa, qr) and torch.equal(sa[:, 0], sr)


def test_int8_bf16_input_is_quantised_from_its_exact_fp32_value():
    w = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q, s = quantize_int8_rows(w)
    q2, s2 = quantize_int8_rows(w.float())
    assert torch.equal(q, q2) and torch.equal(s, s2)


@pytest.mark.parametrize("m", [1, 5, 16, 17, 64])
def test_int8_linear_equals_exact_integer_reference(m):
    g = torch.Generator().manual_seed(m)
    qx = torch.randint(-127, 128, (m, 96), generator=g, dtype=torch.int8)
    qw = torch.randint(-127, 128, (40, 96), generator=g, dtype=torch.int8)
    qx[0, :] = 127
    qw[0, :] = 127  # largest accumulation: 96 * 127**2
    sx = torch.rand(m, generator=g) + 0.01
    sw = torch.rand(40, generator=g) + 0.01
    bias = torch.randn(40, generator=g)
    acc = qx.long() @ qw.long().t()  # int64 reference
    assert acc.abs().max() < 2**31
    expected = (acc.numpy().astype(np.float32) * sx.numpy()[:, None]) * sw.numpy()[None, :]
    expected = expected + bias.numpy()[None, :]
    y = int8_linear(qx, sx, qw, sw, bias)
    np.testing.assert_array_equal(y.numpy(), expected.astype(np.float32))


def test_int8_module_on_a_cpu_with_an_int8_dot_product_uses_the_integer_matmul(monkeypatch):
    monkeypatch.setenv(machine.FLAGS_ENV, "avx2 avx512_vnni")  # without one: int_mm_fp32, the same sums
    calls = []
    real = torch._int_mm

    def spy(a, b):
        calls.append((a.dtype, b.dtype, tuple(a.shape), tuple(b.shape)))
        return real(a, b)

    monkeypatch.setattr(torch, "_int_mm", spy)
    lin = torch.nn.Linear(32, 24)
    mod = Int8Linear.from_linear(lin)
    x = torch.randn(3, 2, 32)
    y = mod(x)
    assert calls == [(torch.int8, torch.int8, (6, 32), (32, 24))]
    qx, sx = quantize_int8_rows(x.reshape(-1, 32))
    ref = int8_linear(qx, sx, mod.qweight, mod.weight_scale, lin.bias.detach())
    assert torch.equal(y, ref.reshape(3, 2, 24))
    torch.testing.assert_close(y, lin(x), atol=0.05, rtol=0.05)


def test_int8_rejects_non_finite_weight_naming_the_tensor():
    w = torch.ones(3, 4)
    w[1, 2] = float("nan")
    with pytest.raises(NonFiniteWeightError, match="layers.0.q_proj.weight"):
        quantize_int8_rows(w, name="layers.0.q_proj.weight")


@pytest.mark.parametrize("shape", [(4,), (0, 3), (2, 3, 4)])
def test_int8_rejects_non_matrix_shapes(shape):
    with pytest.raises(BlockShapeError, match="w"):
        quantize_int8_rows(torch.ones(shape), name="w")


def test_int8_rejects_width_that_would_overflow_int32_accumulation():
    from asyncrl.quant import quantize_weight

    with pytest.raises(BlockShapeError, match="int32"):
        quantize_weight(torch.ones(1, INT8_MAX_K + 1), "int8", name="wide")
    quantize_weight(torch.ones(1, INT8_MAX_K + 1), "int8_wo", name="wide")  # weight-only: no int32 sums
