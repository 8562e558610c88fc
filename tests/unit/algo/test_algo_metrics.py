"""Reducible metrics: Stat/MetricDict/merge_metrics, the §7 mismatch block, and the glossary."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from asyncrl.algo import (
    OBJECTIVES,
    MetricDict,
    ObjectiveConfig,
    Stat,
    merge_metrics,
    policy_loss,
)
from asyncrl.algo.stats import StatsBuilder
from tests.unit.algo.algo_helpers import mismatch_block, random_batch

GLOSSARY = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"


def test_stats_merge_by_their_op_and_undefined_values_are_left_out():
    a = MetricDict(
        {
            "m": Stat("mean", 3.0, 2.0),
            "s": Stat("sum", 1.0),
            "x": Stat("max", 2.0),
            "n": Stat("min", -1.0),
            "e": Stat("ess", 2.0, 2.0, 2.0),
            "z": Stat("mean", 0.0, 0.0),
        }
    )
    b = {
        "m": Stat("mean", 1.0, 2.0),
        "s": Stat("sum", 2.0),
        "x": Stat("max", 5.0),
        "n": Stat("min", 0.0),
        "e": Stat("ess", 1.0, 1.0, 1.0),
    }
    assert "z" not in a and a.stats["z"].op == "mean"
    m = merge_metrics([a, b])
    assert m == {"m": 1.0, "s": 3.0, "x": 5.0, "n": -1.0, "e": pytest.approx(9.0 / (3.0 * 3.0))}
    with pytest.raises(ValueError, match="cannot merge"):
        merge_metrics([{"m": Stat("mean", 1.0, 1.0)}, {"m": Stat("sum", 1.0)}])


def test_stats_builder_uses_one_transfer_and_float64_sums():
    b = StatsBuilder()
    x = torch.tensor([1e8, 1.0, -1e8], dtype=torch.float32)
    b.mean("m", x, torch.ones(3, dtype=torch.bool))
    b.maximum("mx", x, torch.tensor([False, True, True]))
    b.minimum("mn", x, torch.zeros(3, dtype=torch.bool))
    out = b.build()
    assert out["m"] == pytest.approx(1.0 / 3) and out["mx"] == 1.0 and "mn" not in out


def test_mismatch_block_on_a_two_response_example():
    # response 0: mu = [ln 2, ln 2]; response 1: mu = [0] (padded); staleness 0 and 1
    prox = torch.tensor([[math.log(2), math.log(2)], [0.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    versions = torch.tensor([[4, 3], [4, -1]])
    m = mismatch_block(prox, torch.zeros(2, 2), mask, is_cap=1.5, versions=versions, learner_version=4)
    assert m["mismatch/chi2_seq"] == pytest.approx(((4.0**2 - 1) + 0.0) / 2)
    assert m["mismatch/log_ppl_diff"] == pytest.approx(-math.log(2) / 2)
    assert m["mismatch/log_ppl_diff_min"] == pytest.approx(-math.log(2))
    assert m["mismatch/r_max"] == pytest.approx(2.0) and m["mismatch/r_min"] == pytest.approx(1.0)
    k3_ln2 = 2 - 1 - math.log(2)
    assert m["mismatch/by_staleness/eta=0/kl_k3"] == pytest.approx(k3_ln2 / 2)  # tokens (0,0), (1,0)
    assert m["mismatch/by_staleness/eta=1/kl_k3"] == pytest.approx(k3_ln2)
    assert m["mismatch/by_staleness/eta=1/tokens"] == 1.0
    assert m["is/trunc_frac"] == pytest.approx(2 / 3)
    seq = mismatch_block(prox, torch.zeros(2, 2), mask, is_cap=1.5, is_level="sequence")
    assert seq["is/trunc_frac"] == 0.5  # sum mu = ln 4 > ln 1.5 for response 0 only


def test_the_mismatch_block_counts_nonfinite_tokens_and_ignores_them():
    prox = torch.tensor([[0.5, math.nan, 0.0]])
    behav = torch.tensor([[0.0, 0.0, -math.inf]])
    m = mismatch_block(prox, behav, torch.ones(1, 3))
    assert m["mismatch/nonfinite_tokens"] == 2.0
    assert m["mismatch/kl_k1"] == pytest.approx(-0.5)


def test_the_mismatch_block_of_parts_merges_to_the_whole():
    b = random_batch(12, B=9, T=5, dtype=torch.float32)
    kw = {"versions": b["versions"], "learner_version": 6, "is_cap": 1.4}
    whole = mismatch_block(b["prox"], b["behav"], b["mask"], **kw)
    parts = [
        mismatch_block(
            b["prox"][s],
            b["behav"][s],
            b["mask"][s],
            versions=b["versions"][s],
            learner_version=6,
            is_cap=1.4,
        )
        for s in (slice(0, 4), slice(4, 9))
    ]
    merged = merge_metrics(parts)
    for k, v in whole.items():
        if k == "mismatch/log_r_p99":
            assert merged[k] >= v - 1e-6
        else:
            assert merged[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


def _all_emitted_names() -> set[str]:
    names: set[str] = set()
    b = random_batch(13, dtype=torch.float32, nonfinite=True)
    ref = b["prox"] + 0.1
    ent = torch.rand_like(b["prox"])
    extra = {"tis": {"rs_modes": ("token_k2",), "rs_thresholds": ("1.0",)}}
    for kind in OBJECTIVES:
        cfg = ObjectiveConfig(objective=kind, kl_coef=0.1, entropy_coef=0.01, eta_max=1, **extra.get(kind, {}))
        _, m = policy_loss(
            b["logp"],
            b["prox"],
            b["behav"],
            b["adv"],
            b["mask"],
            cfg,
            ref_logp=ref,
            entropy=ent,
            versions=b["versions"],
            learner_version=6,
        )
        names |= set(m.stats)
        if kind == "tbpo":  # the paper-literal w_mode logs the dropped fraction by advantage sign
            drop = ObjectiveConfig(objective=kind, tbpo_w_mode="drop")
            names |= set(policy_loss(b["logp"], b["prox"], b["behav"], b["adv"], b["mask"], drop)[1].stats)
    return {re.sub(r"eta=\d+", "eta=j", n) for n in names}


def test_every_emitted_metric_is_in_the_glossary():
    text = GLOSSARY.read_text()
    documented = set(re.findall(r"`([a-z0-9_]+/[a-z0-9_/=]+)`", text))
    missing = sorted(_all_emitted_names() - documented)
    assert not missing, f"add these metrics to docs/metrics.md: {missing}"
