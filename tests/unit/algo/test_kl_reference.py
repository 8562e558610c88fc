"""The KL-to-reference term of docs/algorithms.md §6.8 (docs/algorithms.md): k3 = clamp(e^x - x - 1, -10, 10),
x = clamp(ref - theta, +-20), aggregated like the policy loss and weighted by kl_coef; float64."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algo import ObjectiveConfig, policy_loss

THETA = [-1.0, -2.0, -0.5, -30.0]
REF = [-1.0, -1.0, -2.0, -1.0]
# x = [0, 1, -1.5, 29 -> 20]; k3 = [0, e - 2, e^-1.5 + 0.5, e^20 - 21 -> 10]
K3 = [0.0, math.e - 2.0, math.exp(-1.5) + 0.5, 10.0]


def _loss(kl_coef: float, agg: str = "token-mean"):
    theta = torch.tensor([THETA], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([REF], dtype=torch.float64)
    same = theta.detach().clone()  # prox = behaviour = theta: ratio 1, weights 1
    zero_adv = torch.zeros(1, 4, dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    cfg = ObjectiveConfig(objective="tis", kl_coef=kl_coef, agg=agg)
    loss, metrics = policy_loss(theta, same, same, zero_adv, mask, cfg, ref_logp=ref, compute_dtype=torch.float64)
    loss.backward()
    return loss, metrics, theta.grad


def test_k3_vector_of_6_8_token_mean_loss_and_gradient():
    beta = 0.5
    loss, metrics, grad = _loss(beta)
    kl = sum(K3) / 4
    assert metrics["actor/kl_loss"] == pytest.approx(kl, abs=1e-12)
    assert float(loss) == pytest.approx(beta * kl, abs=1e-12)  # zero advantages: only the KL term
    assert metrics["actor/kl_ref"] == pytest.approx(kl, abs=1e-12)
    # d k3 / d theta = 1 - e^x where unclamped; 0 where the clamp of x or of k3 is active
    want = [beta * (1.0 - math.exp(x)) / 4 for x in (0.0, 1.0, -1.5)] + [0.0]
    torch.testing.assert_close(grad[0], torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)


def test_k3_follows_the_aggregation_and_is_off_at_kl_coef_zero():
    _, metrics, _ = _loss(1.0, agg="seq-mean-token-sum")
    assert metrics["actor/kl_loss"] == pytest.approx(sum(K3), abs=1e-12)  # one sequence: the token sum
    loss, metrics, grad = _loss(0.0)
    assert float(loss) == 0.0 and "actor/kl_loss" not in metrics and bool((grad == 0).all())
