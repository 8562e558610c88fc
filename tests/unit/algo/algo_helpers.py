"""Helpers for the asyncrl.algo tests: build [B, T] inputs from probabilities, run policy_loss,
and a plain float64 per-token reference of §4 written from the closed forms (not from the code).
"""

from __future__ import annotations

import math

import torch

from asyncrl.algo import ObjectiveConfig, policy_loss


def run(
    cfg: ObjectiveConfig,
    delta: list[list[float]],
    adv: list[list[float]],
    mu: list[list[float]] | None = None,
    mask: list[list[bool]] | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    **kw,
):
    """policy_loss on explicit log-ratios: prox = 0, logp = delta, behav = -mu.

    Returns (loss: float, grad of loss w.r.t. logp: [B, T] tensor, metrics).
    """
    d = torch.tensor(delta, dtype=dtype)
    logp = d.clone().requires_grad_(True)
    prox = torch.zeros_like(d)
    behav = -torch.tensor(mu, dtype=dtype) if mu is not None else torch.zeros_like(d)
    a = torch.tensor(adv, dtype=dtype)
    m = torch.tensor(mask, dtype=torch.bool) if mask is not None else torch.ones_like(d, dtype=torch.bool)
    loss, metrics = policy_loss(logp, prox, behav, a, m, cfg, compute_dtype=dtype, **kw)
    loss.backward()
    return float(loss.detach()), logp.grad, metrics


def mismatch_block(prox, behav, mask, *, is_cap: float = 2.0, is_level: str = "token", **kw):
    """The §7 mismatch block (``mismatch/*``, ``is/*``) as ``policy_loss`` reports it, for a TIS objective with
    cap ``is_cap`` at ``is_level`` (the weights ``is/*`` describes); ``logp`` = ``prox``, advantages 0."""
    cfg = ObjectiveConfig(objective="tis", is_cap=is_cap, is_level=is_level)
    return policy_loss(prox.clone(), prox, behav, torch.zeros_like(prox), mask, cfg, **kw)[1]


def one_token(cfg: ObjectiveConfig, A: float, R: float, r: float = 1.0):
    """(lambda, d lambda / d l_theta, metrics) of a single token with ratios R and r."""
    loss, grad, metrics = run(cfg, [[math.log(R)]], [[A]], [[math.log(r)]])
    return loss, float(grad[0, 0]), metrics


def ref_psi(A: float, R: float, lo: float, hi: float, c: float | None) -> float:
    """§4 closed forms (float64)."""
    clip = min(max(R, lo), hi)
    pre = max(-A * R, -A * clip)
    if A < 0 and c is not None:
        return min(pre, -A * c)
    return pre


def random_batch(
    seed: int,
    B: int = 6,
    T: int = 5,
    *,
    dtype: torch.dtype = torch.float64,
    delta_scale: float = 0.3,
    mu_scale: float = 0.4,
    nonfinite: bool = False,
    per_sequence_adv: bool = False,
) -> dict[str, torch.Tensor]:
    """Random [B, T] inputs: varied lengths (one empty row), mixed-sign advantages, versions.

    ``nonfinite`` puts a NaN behaviour log-prob and an inf advantage on valid tokens.
    """
    g = torch.Generator().manual_seed(seed)
    prox = -torch.rand(B, T, generator=g, dtype=dtype) * 3 - 0.05
    logp = prox + torch.randn(B, T, generator=g, dtype=dtype) * delta_scale
    behav = prox - torch.randn(B, T, generator=g, dtype=dtype) * mu_scale
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[min(1, B - 1)] = 0
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    if per_sequence_adv:
        adv = torch.randn(B, 1, generator=g, dtype=dtype).expand(B, T).clone()
    else:
        adv = torch.randn(B, T, generator=g, dtype=dtype)
    versions = torch.randint(3, 6, (B, T), generator=g, dtype=torch.int32)
    versions = torch.where(mask, versions, torch.full_like(versions, -1))
    if nonfinite:
        behav[0, 0] = math.nan
        adv[min(2, B - 1), 0] = math.inf
        mask[0, 0] = True
        mask[min(2, B - 1), 0] = True
        versions[0, 0] = 5
        versions[min(2, B - 1), 0] = 5
    return {"logp": logp, "prox": prox, "behav": behav, "adv": adv, "mask": mask, "versions": versions}
