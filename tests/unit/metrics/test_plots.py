"""End-of-run plots: real PNGs for the metrics present, nothing for the absent ones.

matplotlib costs about a second to import, so these tests are few and share one synthetic run.
"""

from __future__ import annotations

import pytest

from asyncrl.metrics import MetricsWriter, make_plots
from asyncrl.metrics.plots import series

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _synthetic_run(run_dir) -> None:
    with MetricsWriter(run_dir, tensorboard=False) as w:
        for s in range(1, 13):
            m = {
                "train/reward_mean": s / 12,
                "mismatch/kl_k3": 1e-3 * s,
                "mismatch/by_staleness/eta=0/kl_k3": 1e-4 * s,
                "mismatch/by_staleness/eta=1/kl_k3": 5e-4 * s,
                "mismatch/by_staleness/η=2/kl_k3": 2e-3 * s,
                "actor/clipfrac_hi": 0.1,
                "actor/clipfrac_lo": 0.05,
                "acr/empty_band_frac": float("nan") if s == 3 else 0.02,
                "throughput/tokens_per_s": 1000.0 + s,
            }
            if s % 4 == 0:
                m["eval/accuracy"] = s / 12
            w.log(s, m, wall_time=float(s))


def test_series_takes_only_the_steps_that_have_a_finite_value():
    recs = [{"step": 1, "a": 1.0}, {"step": 2}, {"step": 3, "a": None}, {"step": 4, "a": 4}]
    assert series(recs, "a") == ([1, 4], [1.0, 4.0])


def test_make_plots_writes_readable_pngs_and_skips_plots_without_data(tmp_path):
    _synthetic_run(tmp_path)
    written = make_plots(tmp_path)
    names = [p.name for p in written]
    assert names == [
        "reward.png",
        "eval_accuracy.png",
        "kl_by_staleness.png",
        "clip_fractions.png",
        "throughput.png",
    ]
    import matplotlib.image as mpimg

    for path in written:
        assert path.parent == tmp_path / "plots"
        assert path.read_bytes()[:8] == PNG_MAGIC
        img = mpimg.imread(path)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
        assert img.std() > 0.01  # something was drawn
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(names)  # no temp files left

    # A run with no eval, no mismatch, no clip or throughput metrics gets only the reward plot.
    sparse = tmp_path / "sparse"
    with MetricsWriter(sparse, tensorboard=False) as w:
        for s in range(3):
            w.log(s, {"train/reward_mean": 0.5, "eval/accuracy": float("nan"), "other": 1.0})
    assert [p.name for p in make_plots(sparse)] == ["reward.png"]
    assert make_plots(tmp_path / "empty") == []
    assert not (tmp_path / "empty" / "plots").exists()


@pytest.mark.parametrize("key", ["mismatch/by_staleness/eta=7/kl_k3", "mismatch/by_staleness/η=7/kl_k3"])
def test_kl_by_staleness_plot_has_one_line_per_staleness_level(key):
    from asyncrl.metrics.plots import _kl_by_staleness

    (panel,) = _kl_by_staleness({key, "mismatch/by_staleness/eta=10/kl_k3", "mismatch/kl_k3_other"})
    assert [ln.label for ln in panel.lines] == ["staleness 7", "staleness 10", "all tokens"]


def test_smoothed_reward_baseline_and_the_final_report_left_out_of_throughput():
    from asyncrl.metrics.plots import BASELINE, SMOOTHED, derived_series, moving_average

    assert moving_average([0.0, 1.0, 2.0, 3.0], 2) == [0.0, 0.5, 1.5, 2.5]
    recs = [{"step": 0, "eval/accuracy": 0.25, "eval/baseline": 1.0, "throughput/samples_per_s": 0.0}] + [
        {"step": s, "train/reward_mean": float(s), "throughput/samples_per_s": 10.0} for s in range(1, 6)]
    recs.append({"step": 5, "done": 1.0, "eval/accuracy": 0.5, "throughput/samples_per_s": 900.0})
    assert derived_series(recs, BASELINE + "eval/accuracy") == ([0, 5], [0.25, 0.25])
    xs, ys = derived_series(recs, SMOOTHED + "train/reward_mean")
    assert xs == [1, 2, 3, 4, 5] and ys[-1] == pytest.approx(3.0)  # mean of 1..5 (window 10)
    assert derived_series(recs, "throughput/samples_per_s", skip_final=True)[1] == [10.0] * 5
    assert 900.0 in derived_series(recs, "throughput/samples_per_s")[1]
    # no step-0 evaluation: no baseline line
    assert derived_series(recs[1:], BASELINE + "eval/accuracy") == ([], [])


def test_response_and_learner_panels_are_drawn_when_their_metrics_exist(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.log(0, {"eval/accuracy": 0.2, "eval/baseline": 1.0})
        for s in range(1, 6):
            w.log(s, {"train/reward_mean": 0.1 * s, "train/response_len_mean": 10.0 + s,
                      "train/zero_variance_groups": 0.5, "train/first_token_stop_frac": 0.0,
                      "learner/loss": 0.1, "learner/grad_norm": 1.0 + s, "learner/lr": 1e-5})
    names = [p.name for p in make_plots(tmp_path)]
    assert names == ["reward.png", "eval_accuracy.png", "responses.png", "learner.png"]
