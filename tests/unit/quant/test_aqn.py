"""AQN (docs/algorithms.md §9, test vectors §13.10): schedule, folding example, per-publication noise."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from asyncrl.quant import (
    QuantError,
    add_aqn_noise,
    aqn_sigma,
    aqn_sigma_paper,
    aqn_trend,
    publication_seed,
    publish,
)
from tests.unit.quant.conftest import make_tiny_qwen2

TREND = [0.01, 0.0068766, 0.0047287, 0.0032517, 0.0022361, 0.0015376, 0.0010574, 0.0007271, 0.0005]


def test_13_10_trend_values():
    assert aqn_trend(1e-2, 5e-4, 10) == pytest.approx(TREND, abs=1e-7)


@pytest.mark.parametrize(
    "step,sigma",
    [
        (0, 0.0),
        (99, 0.0),
        (100, 0.01),
        (250, 0.0068766),
        (899, 0.0007271),
        (900, 0.0005),
        (999, 0.0005),
        (1000, 0.0005),
        (5000, 0.0005),
    ],
)
def test_13_10_released_schedule(step, sigma):
    assert aqn_sigma(step, 1000, 1e-2, 5e-4, 10) == pytest.approx(sigma, abs=1e-7)


def test_13_10_paper_indexing_differs_by_one_stage():
    paper = [
        0.01,
        0.0071687,
        0.005139,
        0.003684,
        0.002641,
        0.0018932,
        0.0013572,
        0.0009729,
        0.0006975,
        0.0005,
    ]
    assert [aqn_sigma_paper(k, 1e-2, 5e-4, 10) for k in range(1, 11)] == pytest.approx(paper, abs=1e-7)


def test_schedule_stage_boundaries_are_exact_when_steps_do_not_divide():
    # T/K = 33.33...: stage 1 starts at ceil(33.33) = 34, stage 2 at 67.
    assert aqn_sigma(33, 100, 1e-2, 1e-4, 3) == 0.0
    assert aqn_sigma(34, 100, 1e-2, 1e-4, 3) == 1e-2
    assert aqn_sigma(66, 100, 1e-2, 1e-4, 3) == 1e-2
    assert aqn_sigma(67, 100, 1e-2, 1e-4, 3) == pytest.approx(1e-4)
    assert aqn_sigma(10, 100, 1e-2, 1e-4, 2) == 0.0 and aqn_sigma(50, 100, 1e-2, 1e-4, 2) == 1e-2


@pytest.mark.parametrize(
    "args",
    [(0, 1000, 1e-2, 5e-4, 1), (0, 0, 1e-2, 5e-4, 10), (0, 10, 0.0, 5e-4, 10), (-1, 10, 1e-2, 5e-4, 10)],
)
def test_schedule_rejects_bad_arguments(args):
    with pytest.raises(QuantError):
        aqn_sigma(*args)


def test_13_10_noise_folds_into_the_following_linear():
    x = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
    g = torch.tensor([1.0, 2.0], dtype=torch.float64)
    z = torch.tensor([0.1, -0.2], dtype=torch.float64)
    plain = Qwen2RMSNorm(2, eps=0.0).double()
    plain.weight.data.fill_(1.0)
    noisy = Qwen2RMSNorm(2, eps=0.0).double()
    noisy.weight.data.copy_(g + z)
    normed = plain(x)[0]
    assert normed.tolist() == pytest.approx([0.848528, 1.131371], abs=1e-6)
    assert noisy(x)[0].tolist() == pytest.approx([0.933381, 2.036468], abs=1e-6)
    w = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    y = (w @ noisy(x)[0]).item()
    assert y == pytest.approx(2.969848, abs=1e-6)
    assert (w * torch.tensor([1.1, 1.8], dtype=torch.float64) @ normed).item() == pytest.approx(y, abs=1e-12)
    # multiplicative form on the clean norm: W diag(1 + z / g) n(x)
    assert (w * (1 + z / g) @ (g * normed)).item() == pytest.approx(y, abs=1e-12)


def test_noise_goes_on_copies_of_the_chosen_gains_only():
    sd = make_tiny_qwen2().state_dict()
    before = {k: v.clone() for k, v in sd.items()}
    noisy, rec = add_aqn_noise(sd, sigma=0.01, seed=11)
    changed = sorted(k for k in sd if not torch.equal(noisy[k], sd[k]))
    assert changed == sorted(
        f"model.layers.{i}.{n}.weight"
        for i in range(2)
        for n in ("input_layernorm", "post_attention_layernorm")
    )
    assert all(torch.equal(before[k], v) for k, v in sd.items())  # learner gains stay clean
    assert all(noisy[k] is sd[k] for k in sd if k not in changed)
    assert (rec.seed, rec.sigma) == (11, 0.01)
    z = torch.cat([(noisy[k] - sd[k]).flatten() for k in changed])
    assert 0.005 < z.std().item() < 0.02


def test_noise_is_reproducible_from_the_seed_and_fresh_for_a_new_seed():
    sd = make_tiny_qwen2().state_dict()
    a, _ = add_aqn_noise(sd, sigma=0.01, seed=1)
    b, _ = add_aqn_noise(sd, sigma=0.01, seed=1)
    c, _ = add_aqn_noise(sd, sigma=0.01, seed=publication_seed(1, version=2))
    k = "model.layers.1.input_layernorm.weight"
    assert torch.equal(a[k], b[k]) and not torch.equal(a[k], c[k])
    only, _ = add_aqn_noise(sd, sigma=0.01, seed=1, sites=("input_layernorm",))
    assert torch.equal(only[k], a[k])  # a tensor's noise depends only on (seed, name, sigma)


def test_uaq_folded_gains_get_sigma_times_s():
    sd = make_tiny_qwen2().state_dict()
    a, _ = add_aqn_noise(sd, sigma=0.01, seed=3)
    b, _ = add_aqn_noise(sd, sigma=0.01, seed=3, uaq_s=1.5, uaq_sites=("attn_qkv",))
    k_in, k_post = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"
    torch.testing.assert_close(b[k_in] - sd[k_in], 1.5 * (a[k_in] - sd[k_in]), rtol=1e-5, atol=1e-7)
    assert torch.equal(b[k_post], a[k_post])
    c, _ = add_aqn_noise(sd, sigma=0.01, seed=3, uaq_s=1.5, uaq_sites=("attn_qkv",), scale_with_uaq=False)
    assert torch.equal(c[k_in], a[k_in])


def test_publish_records_seed_and_sigma_and_noises_only_the_published_copy():
    model = make_tiny_qwen2()
    sd = model.state_dict()
    pub = publish(sd, "int8", version=7, aqn_sigma=0.005, aqn_seed=42)
    assert (pub.aqn_seed, pub.aqn_sigma) == (42, 0.005)
    assert pub.header()["aqn_seed"] == 42
    k = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(pub.tensors[k], sd[k])
    expected, _ = add_aqn_noise(sd, sigma=0.005, seed=42)
    assert torch.equal(pub.tensors[k], expected[k])
    assert pub.checksum != publish(sd, "int8", version=7, aqn_sigma=0.005, aqn_seed=43).checksum
    with pytest.raises(QuantError, match="aqn_seed"):
        publish(sd, "int8", version=7, aqn_sigma=0.005)


def test_aqn_rejects_negative_sigma_and_missing_sites():
    sd = make_tiny_qwen2().state_dict()
    with pytest.raises(QuantError, match="sigma"):
        add_aqn_noise(sd, sigma=-0.1, seed=0)
    with pytest.raises(QuantError, match="no RMSNorm gain"):
        add_aqn_noise(sd, sigma=0.1, seed=0, sites=("q_norm",))
