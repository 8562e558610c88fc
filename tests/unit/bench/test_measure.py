"""asyncrl/bench/measure.py: the interleaving and ratio summary every ratio-headline benchmark uses, and the
Wilson interval of an accuracy (scripts/bench_real.py, bench_recipes.py, eval_greedy.py)."""

from __future__ import annotations

import itertools

import pytest

from asyncrl.bench.measure import interleaved, load_average_stats, ratio_stats, wilson


def test_interleaved_runs_every_path_once_per_round_in_shuffled_order_and_drops_warmup():
    calls: list[str] = []
    counters = {"a": itertools.count(), "b": itertools.count(100)}

    def path(name: str):
        def run() -> float:
            calls.append(name)
            return float(next(counters[name]))
        return run

    out = interleaved({"a": path("a"), "b": path("b")}, rounds=6, warmup=1)
    assert len(calls) == 14 and calls.count("a") == calls.count("b") == 7
    assert out["values"]["a"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # round 0 was the warm-up
    assert out["values"]["b"] == [101.0, 102.0, 103.0, 104.0, 105.0, 106.0]
    assert len(out["load"]) == 6 and all(load >= 0 for load in out["load"])
    assert {tuple(o) for o in out["order"]} == {("a", "b"), ("b", "a")}  # both orders occur (seeded)
    with pytest.raises(ValueError, match="rounds"):
        interleaved({"a": path("a")}, rounds=0)


def test_ratio_stats_takes_the_ratio_per_round_before_summarising():
    # path a is exactly half as fast as b in every round, although both drift by 10x across rounds
    num = [1.0, 2.0, 4.0, 8.0, 10.0]
    den = [2.0, 4.0, 8.0, 16.0, 20.0]
    s = ratio_stats(num, den)
    assert s["ratio_median"] == s["ratio_min"] == s["ratio_max"] == 0.5
    assert s["spread"] == 0.0 and s["rounds"] == 5
    s = ratio_stats([1.0, 1.0, 1.0, 1.0, 3.0], [1.0, 1.0, 1.0, 1.0, 1.0])
    assert s["ratio_median"] == 1.0 and s["ratio_max"] == 3.0
    with pytest.raises(ValueError, match="same"):
        ratio_stats([1.0], [1.0, 2.0])
    assert load_average_stats([1.0, 3.0, 2.0])["load_median"] == 2.0


def test_wilson_interval_matches_the_closed_form_values():
    lo, hi = wilson(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    lo, hi = wilson(0, 10)  # never below 0, and not degenerate at p = 0 (the normal approximation is)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson(200, 200)
    assert hi == pytest.approx(1.0) and lo == pytest.approx(0.9812, abs=1e-4)
    assert all(x != x for x in wilson(0, 0))  # no data: NaN, not a made-up interval
