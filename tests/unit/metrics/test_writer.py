"""metrics.jsonl + TensorBoard writer: strict JSON, torn-tail recovery, resume, and the event files."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest

from asyncrl.metrics import MetricsWriter, metrics_path, read_metrics, scan_metrics


def _jsonl(run_dir) -> list[str]:
    return metrics_path(run_dir).read_text().splitlines()


def test_log_round_trip_keeps_step_time_first_and_writes_non_finite_as_null(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.log(1, {"train/reward_mean": 0.25, "loss": float("nan"), "kl": float("inf")}, wall_time=100.0)
        w.log(np.int64(2), {"train/reward_mean": np.float32(0.5), "count": 7, "flag": True, "neg": -math.inf})
    lines = _jsonl(tmp_path)
    assert len(lines) == 2
    for line in lines:  # strict JSON: no NaN/Infinity tokens
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    first = json.loads(lines[0])
    assert list(first) == ["step", "time", "train/reward_mean", "loss", "kl"]
    assert first == {"step": 1, "time": 100.0, "train/reward_mean": 0.25, "loss": None, "kl": None}
    recs = read_metrics(tmp_path)
    assert recs[0] == first
    assert recs[1]["step"] == 2 and recs[1]["train/reward_mean"] == 0.5
    assert recs[1]["count"] == 7 and recs[1]["flag"] == 1.0 and recs[1]["neg"] is None
    assert recs[1]["time"] > 1e9  # defaults to time.time()


@pytest.mark.parametrize(
    "step,metrics,match",
    [
        (1, {"step": 1.0}, "reserved"),
        (1, {"time": 1.0}, "reserved"),
        (1, {"": 1.0}, "non-empty"),
        (1, {"x": "high"}, "scalars"),
        (1, {"x": [1.0, 2.0]}, "scalars"),
        (1.5, {"x": 1.0}, "step must be an int"),
        (True, {"x": 1.0}, "step must be an int"),
    ],
)
def test_log_rejects_bad_records_and_writes_nothing(tmp_path, step, metrics, match):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        with pytest.raises(ValueError, match=match):
            w.log(step, metrics)
    assert metrics_path(tmp_path).read_bytes() == b""


def test_read_skips_a_torn_last_line_and_reports_it(tmp_path, caplog):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        for s in range(3):
            w.log(s, {"a": float(s)}, wall_time=1.0)
    with open(metrics_path(tmp_path), "ab") as f:
        f.write(b'{"step":3,"time":1.0,"a":')  # a crash mid-write
    with caplog.at_level(logging.WARNING, logger="asyncrl.metrics.writer"):
        scan = scan_metrics(tmp_path)
    assert [r["step"] for r in scan.records] == [0, 1, 2]
    assert scan.torn_tail and scan.skipped_lines == 0
    assert "torn last line" in caplog.text
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]


def test_read_counts_a_corrupt_middle_line_and_keeps_the_rest(tmp_path):
    metrics_path(tmp_path).write_bytes(b'{"step":0,"time":1}\nnot json\n{"no_step":1}\n{"step":1,"time":2}\n')
    scan = scan_metrics(tmp_path)
    assert [r["step"] for r in scan.records] == [0, 1]
    assert scan.skipped_lines == 2 and not scan.torn_tail


def test_read_of_a_run_without_metrics_is_empty(tmp_path):
    assert read_metrics(tmp_path / "nothing") == []


def test_reopening_repairs_a_torn_tail_and_appends(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.log(0, {"a": 0.0}, wall_time=1.0)
    with open(metrics_path(tmp_path), "ab") as f:
        f.write(b'{"step":1,"ti')
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        assert w.torn_bytes_removed == len(b'{"step":1,"ti')
        w.log(1, {"a": 1.0}, wall_time=2.0)
    scan = scan_metrics(tmp_path)
    assert [r["step"] for r in scan.records] == [0, 1]
    assert not scan.torn_tail and scan.skipped_lines == 0


def test_reopening_a_file_whose_only_line_is_torn_empties_it(tmp_path):
    metrics_path(tmp_path).write_bytes(b'{"step":0')
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.log(0, {"a": 1.0}, wall_time=1.0)
    assert [r["a"] for r in read_metrics(tmp_path)] == [1.0]


def test_purge_step_drops_records_the_resumed_run_will_log_again(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        for s in range(6):
            w.log(s, {"a": float(s)}, wall_time=1.0)
    with MetricsWriter(tmp_path, tensorboard=False, purge_step=4) as w:
        assert w.purged_records == 2
        w.log(4, {"a": 40.0}, wall_time=2.0)
    assert [(r["step"], r["a"]) for r in read_metrics(tmp_path)] == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 40)]


def test_log_after_close_is_an_error_and_close_is_idempotent(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=False)
    w.close()
    w.close()
    assert w.closed
    with pytest.raises(ValueError, match="closed"):
        w.log(0, {"a": 1.0})


def _scalars(tb_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_events_hold_the_logged_scalars_and_resume_purges_stale_steps(tmp_path):
    with MetricsWriter(tmp_path) as w:
        for s in range(4):
            w.log(
                s, {"train/reward_mean": 0.1 * s, "loss": float("nan") if s == 1 else 1.0}, wall_time=10.0 + s
            )
        w.log(2, {"eval/accuracy": 0.75}, wall_time=12.5)
    files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    got = _scalars(tmp_path / "tb")
    assert got["train/reward_mean"] == [(s, pytest.approx(0.1 * s)) for s in range(4)]
    assert got["eval/accuracy"] == [(2, 0.75)]
    assert math.isnan(got["loss"][1][1]) and got["loss"][0] == (0, 1.0)  # TensorBoard keeps NaN as NaN

    with MetricsWriter(tmp_path, purge_step=2) as w:  # resume from a checkpoint before step 2
        w.log(2, {"train/reward_mean": 9.0}, wall_time=20.0)
    got = _scalars(tmp_path / "tb")
    assert got["train/reward_mean"] == [(0, 0.0), (1, pytest.approx(0.1)), (2, 9.0)]
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
