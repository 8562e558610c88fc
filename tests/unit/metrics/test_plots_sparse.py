"""Sparse series are drawn as points or broken lines, never as a line through steps that lack them.

A synthetic run of 400 steps in which staleness 1 is logged only at steps 1 and 380, staleness 2 on
every step but a hole at 100-199, and eval every 50 steps: the lines each plot hands to matplotlib
(``panel_lines``: steps, values and style, exactly what ``ax.plot`` receives) must join only points of
adjacent run steps, and carry markers where they are broken; the PNGs are then written for real.
"""

from __future__ import annotations

import math

import numpy as np

from asyncrl.metrics.plots import PLOTS, gapped, make_plots, panel_lines

STEPS = 400


def sparse_run() -> list[dict]:
    records = [{"step": 0, "eval/accuracy": 0.5, "eval/baseline": 1.0}]
    for s in range(1, STEPS + 1):
        rec = {"step": s, "train/reward_mean": 0.3 + s / 1000, "mismatch/kl_k3": 0.01}
        if s in (1, 380):
            rec["mismatch/by_staleness/eta=1/kl_k3"] = 0.002
        if not 100 <= s < 200:
            rec["mismatch/by_staleness/eta=2/kl_k3"] = 0.02
        if s % 50 == 0:
            rec["eval/accuracy"] = 0.5 + s / 1000
        records.append(rec)
    return records


def segments(xs) -> list[list[float]]:
    """The runs of consecutive finite x values: what matplotlib joins with a line."""
    out: list[list[float]] = [[]]
    for x in xs:
        if math.isnan(x):
            out.append([])
        else:
            out[-1].append(x)
    return [s for s in out if s]


def test_gapped_breaks_between_points_that_skip_a_step_of_the_run():
    steps = [0, 1, 2, 3, 5, 8]  # the run's steps; 4, 6 and 7 never happened
    xs, ys, gap = gapped([1, 2, 3, 5, 8], [1.0, 2.0, 3.0, 4.0, 5.0], steps)
    assert segments(xs) == [[1, 2, 3, 5, 8]] and not gap  # 3 -> 5 -> 8 are adjacent steps of this run
    xs, ys, gap = gapped([1, 3, 8], [1.0, 2.0, 3.0], steps)
    assert segments(xs) == [[1], [3], [8]] and gap
    assert [y for y in ys if not math.isnan(y)] == [1.0, 2.0, 3.0]


def drawn_lines(filename: str, records: list[dict]) -> dict[str, tuple[np.ndarray, str | None]]:
    spec = next(s for s in PLOTS if s.filename == filename)
    keys = {k for rec in records for k in rec}
    return {line.label: (np.asarray(xs, dtype=float), line.style.get("marker"))
            for panel in spec.panels(keys) for line, xs, _ in panel_lines(panel, records, keys)}


def test_a_staleness_bucket_seen_twice_is_two_points_not_a_line_across_the_run():
    lines = drawn_lines("kl_by_staleness.png", sparse_run())
    xs, marker = lines["staleness 1"]
    assert segments(xs) == [[1.0], [380.0]] and marker == "o"
    xs, marker = lines["staleness 2"]
    assert [(s[0], s[-1]) for s in segments(xs)] == [(1.0, 99.0), (200.0, 400.0)] and marker == "o"
    xs, _ = lines["all tokens"]
    assert segments(xs) == [list(map(float, range(1, STEPS + 1)))]  # a dense series stays one line


def test_eval_every_fifty_steps_is_drawn_as_points_and_the_baseline_stays_a_reference_line():
    lines = drawn_lines("reward.png", sparse_run())
    xs, marker = lines["eval accuracy (greedy)"]
    assert segments(xs) == [[float(s)] for s in range(0, STEPS + 1, 50)] and marker == "o"
    xs, _ = lines["eval accuracy at step 0 (baseline)"]
    assert segments(xs) == [[0.0, float(STEPS)]]


def test_the_png_of_a_sparse_run_is_written(tmp_path):
    written = {p.name for p in make_plots(tmp_path, sparse_run())}
    assert {"kl_by_staleness.png", "reward.png", "eval_accuracy.png"} <= written
    assert (tmp_path / "plots" / "kl_by_staleness.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
