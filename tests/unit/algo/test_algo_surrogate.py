"""psi of §4 against its closed forms, for any advantage and ratios (hypothesis), per token kind."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from asyncrl.algo import ObjectiveConfig
from tests.unit.algo.algo_helpers import one_token, ref_psi

ratios = st.floats(min_value=0.05, max_value=8.0, allow_nan=False)
advs = st.floats(min_value=-3.0, max_value=3.0, allow_nan=False).filter(lambda a: abs(a) > 1e-3)


def _expected(cfg: ObjectiveConfig, A: float, R: float, r: float) -> tuple[float, float]:
    """(lambda, d lambda / d l_theta) from the §4 table and closed forms, in float64."""
    lo, hi, c = 1 - cfg.clip_low, 1 + cfg.clip_high, cfg.dual_clip
    omega = 1.0
    if cfg.objective == "decoupled":
        omega = r if cfg.behav_cap is None or r <= cfg.behav_cap else 0.0
    elif cfg.objective in ("tis", "acr"):
        omega = min(r, cfg.is_cap)
    if cfg.objective == "acr":
        hi = (1 + cfg.clip_high) / r
    for bound in (lo, hi) + ((c,) if c is not None else ()):
        assume(abs(math.log(R) - math.log(bound)) > 1e-6)  # stay off the kinks
    loss = omega * ref_psi(A, R, lo, hi, c)
    clip = min(max(R, lo), hi)
    unclipped = -A * R >= -A * clip
    dual_active = A < 0 and c is not None and max(-A * R, -A * clip) > -A * c
    grad = -omega * A * R if unclipped and not dual_active else 0.0
    return loss, grad


@pytest.mark.parametrize(
    "cfg",
    [
        ObjectiveConfig(objective="ppo"),
        ObjectiveConfig(objective="ppo", dual_clip=None, eps_high=0.28),
        ObjectiveConfig(objective="decoupled", behav_cap=3.0),
        ObjectiveConfig(objective="tis", is_cap=2.0),
        ObjectiveConfig(objective="acr", is_cap=2.0),
        ObjectiveConfig(objective="acr", is_cap=8.0, eps_high=0.28, dual_clip=None),
    ],
    ids=["ppo", "ppo-clip-higher-no-dual", "decoupled-cap3", "tis", "acr", "acr-dapo-no-dual"],
)
@settings(max_examples=60, deadline=None)
@given(A=advs, R=ratios, r=ratios)
def test_token_loss_and_gradient_match_the_closed_forms(cfg, A, R, r):
    loss, grad = _expected(cfg, A, R, r)
    got_loss, got_grad, _ = one_token(cfg, A, R, r)
    assert got_loss == pytest.approx(loss, rel=1e-9, abs=1e-9)
    assert got_grad == pytest.approx(grad, rel=1e-9, abs=1e-9)
