"""The controller's per-batch view of what the model writes: response length, zero-variance groups,
samples that ended at their first token."""

from __future__ import annotations

import numpy as np
import pytest

import protocols as P
from asyncrl.controller.batches import response_metrics


def arr(ids):
    return P.Array.from_numpy(np.asarray(ids, np.int32))


def test_response_metrics_of_a_batch():
    m = response_metrics([True, False], [arr([2]), arr([5, 6, 2]), arr([7, 2]), arr([2])], stop_ids=[2])
    assert m["train/response_len_mean"] == pytest.approx(7 / 4) and m["train/response_len_max"] == 3.0
    assert m["train/zero_variance_groups"] == 0.5
    assert m["train/first_token_stop_frac"] == 0.5
    # a one-token response that is not a stop token did not "end at its first token"
    assert response_metrics([False], [arr([9]), arr([9])], stop_ids=[2])["train/first_token_stop_frac"] == 0.0
