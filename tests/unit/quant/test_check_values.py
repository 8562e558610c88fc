"""The value checks every loader runs on a published tensor (asyncrl/quant/published.py, ``check_values``): one
reduction answers finiteness and, for a scale that must be positive, positivity."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.quant import NonFiniteWeightError
from asyncrl.quant.formats import ROLE_FULL, ROLE_GLOBAL_SCALE, ROLE_SCALE
from asyncrl.quant.published import check_values
from asyncrl.quant.wire import manifest_entry


def check(t: torch.Tensor, fmt: str, role: str) -> None:
    check_values(manifest_entry("m.x", t, fmt, role), t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_value_anywhere_is_refused_in_any_role(dtype, bad):
    for role, fmt in ((ROLE_FULL, "int8"), (ROLE_SCALE, "int8"), (ROLE_SCALE, "nvfp4"), (ROLE_GLOBAL_SCALE, "nvfp4")):
        t = torch.full((7,), 0.5, dtype=dtype)
        check(t, fmt, role)
        for i in (0, 3, 6):
            u = t.clone()
            u[i] = bad
            with pytest.raises(NonFiniteWeightError, match="non-finite"):
                check(u, fmt, role)


@pytest.mark.parametrize(("fmt", "role", "must_be_positive"), [
    ("int8", ROLE_SCALE, True), ("fp8", ROLE_SCALE, True), ("int8_wo", ROLE_SCALE, True),
    ("nvfp4", ROLE_GLOBAL_SCALE, True), ("nvfp4", ROLE_SCALE, False), ("int8", ROLE_FULL, False)])
@pytest.mark.parametrize("value", [0.0, -0.0, -1e-30])
def test_a_scale_that_must_be_positive_is_refused_at_zero_or_below_and_others_are_not(fmt, role, must_be_positive,
                                                                                     value):
    t = torch.full((5,), 0.25)
    t[2] = value
    if must_be_positive:
        with pytest.raises(NonFiniteWeightError, match="> 0"):
            check(t, fmt, role)
    else:
        check(t, fmt, role)


def test_empty_tensors_pass():
    check(torch.empty(0), "int8", ROLE_SCALE)
    check(torch.empty(0, dtype=torch.bfloat16), "int8", ROLE_FULL)
