"""summary.json validation and rendering; the progress display; following a metrics file."""

from __future__ import annotations

import io
import json

import pytest

from asyncrl.metrics import (
    REQUIRED_KEYS,
    MetricsWriter,
    Progress,
    format_summary,
    metrics_path,
    tail_metrics,
    write_summary,
)

SUMMARY = {
    "final_train_reward": 0.875,
    "eval_accuracy": 0.97,
    "learner_steps": 40,
    "wall_seconds": 312.25,
    "max_consumed_staleness": 2,
    "samples_logged": 1280,
    "state_dict_sha256": "0f" * 32,
}


def test_write_summary_is_pretty_sorted_strict_json_with_extra_keys(tmp_path):
    path = write_summary(tmp_path / "run", {**SUMMARY, "objective": "acr", "final_loss": float("nan")})
    assert path == tmp_path / "run" / "summary.json"
    text = path.read_text()
    data = json.loads(text)
    assert list(data) == sorted(data)
    assert data["final_loss"] is None and data["objective"] == "acr" and data["learner_steps"] == 40
    assert text.startswith("{\n  ")


def test_summary_missing_keys_raise_naming_every_missing_key(tmp_path):
    partial = {k: v for k, v in SUMMARY.items() if k not in ("eval_accuracy", "state_dict_sha256")}
    with pytest.raises(ValueError, match="eval_accuracy, state_dict_sha256"):
        write_summary(tmp_path, partial)
    with pytest.raises(ValueError, match="eval_accuracy"):
        format_summary(partial)
    assert not (tmp_path / "summary.json").exists()


def test_format_summary_shows_every_required_value_and_na_for_missing_eval():
    text = format_summary({**SUMMARY, "eval_accuracy": None, "objective": "acr"})
    assert "0.875" in text and "n/a" in text and "312.2 s" in text and "0f" * 32 in text
    assert "objective" in text and "acr" in text
    assert len(text.splitlines()) == 2 + len(REQUIRED_KEYS) + 1


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_progress_on_a_non_tty_prints_plain_lines_at_most_every_interval():
    out, clock = io.StringIO(), _Clock()
    p = Progress(10, stream=out, interval_s=5.0, clock=clock)
    assert p.plain
    for step in range(1, 10):
        clock.t = step * 1.0
        metrics = {"train/reward_mean": step / 10, "staleness/max": 2.0, "throughput/tokens_per_s": 1234.4}
        if step == 4:
            metrics["eval/accuracy"] = 0.5
        p.update(step, metrics)
    lines = out.getvalue().splitlines()
    assert [ln.split()[1] for ln in lines] == ["1/10", "6/10"]  # t=1 first, t=6 is 5 s later
    assert "eval=0.500" in lines[1]  # the last eval stays on display between evaluations
    assert "reward=0.600" in lines[1] and "staleness=2" in lines[1] and "tok/s=1234" in lines[1]
    clock.t = 9.5
    p.update(10, {"train/reward_mean": 1.0})  # the last step is always printed
    p.close()
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and lines[-1].startswith("step 10/10 (100%)") and "reward=1.000" in lines[-1]
    assert "\r" not in out.getvalue()


def test_progress_close_prints_the_last_state_once_when_it_was_not_shown():
    out, clock = io.StringIO(), _Clock()
    with Progress(100, stream=out, clock=clock) as p:
        p.update(1, {})
        p.update(2, {"train/reward_mean": 0.25})
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[-1].startswith("step 2/100") and "reward=0.250" in lines[-1]


def test_progress_on_a_tty_draws_a_tqdm_bar():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    with Progress(4, stream=out) as p:
        assert not p.plain
        p.update(3, {"train/reward_mean": 0.5})
    text = out.getvalue()
    assert "\r" in text and "3/4" in text and "reward=0.500" in text


def test_progress_rejects_an_empty_run():
    with pytest.raises(ValueError, match="total_steps"):
        Progress(0, stream=io.StringIO())


def test_tail_metrics_returns_only_complete_lines_and_resumes_from_the_offset(tmp_path):
    path = metrics_path(tmp_path)
    assert tail_metrics(path, 0) == ([], 0)  # not written yet
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.log(0, {"a": 0.0}, wall_time=1.0)
        w.log(1, {"a": 1.0}, wall_time=1.0)
    recs, off = tail_metrics(path, 0)
    assert [r["step"] for r in recs] == [0, 1] and off == path.stat().st_size
    assert tail_metrics(path, off) == ([], off)
    with open(path, "ab") as f:  # another process is half-way through a line
        f.write(b'{"step":2,"time":1.0,"a":2')
    recs, off2 = tail_metrics(path, off)
    assert recs == [] and off2 == off
    with open(path, "ab") as f:
        f.write(b'.0}\n{"step":3,"time":1.0,"a":3.0}\n{"step":4')
    recs, off3 = tail_metrics(path, off2)
    assert [(r["step"], r["a"]) for r in recs] == [(2, 2.0), (3, 3.0)]
    assert path.read_bytes()[off3:] == b'{"step":4'


def test_tail_metrics_rereads_a_file_rewritten_shorter_and_skips_corrupt_lines(tmp_path):
    path = metrics_path(tmp_path)
    path.write_bytes(b'{"step":0,"time":1}\ngarbage\n{"step":1,"time":1}\n')
    recs, off = tail_metrics(path, 0)
    assert [r["step"] for r in recs] == [0, 1] and off == path.stat().st_size
    path.write_bytes(b'{"step":0,"time":2}\n')  # purge on resume rewrote it
    recs, off = tail_metrics(path, off)
    assert [r["time"] for r in recs] == [2] and off == path.stat().st_size
    with pytest.raises(ValueError, match="offset"):
        tail_metrics(path, -1)
