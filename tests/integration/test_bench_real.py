"""``scripts/bench_real.py --smoke`` runs every row end to end and writes the documented JSON (marker ``slow``).

Smoke mode trains the embedded tiny model for one step per row (a time budget of a microsecond: the
controller refuses the second batch), evaluates before and after, and measures memory, so the test
checks the plumbing (rows, keys, types, a plot), never a figure. The TRL row needs the TRL venv
(``make trl-venv``, built once at benchmark time and never a dependency of the package); without it
that test is skipped, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1500)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REQUIRED = ("name", "accuracy_before", "accuracy_after", "ci95_before", "ci95_after", "learner_peak_rss_gb",
            "seconds_per_step")


def run_smoke(procs, tmp_path, rows: str) -> dict:
    out, log = tmp_path / "bench_real.json", tmp_path / "bench_real.log"
    with open(log, "wb") as f:
        proc = procs.python(os.path.join(ROOT, "scripts", "bench_real.py"), "--smoke", "--rows", rows,
                            "--json", str(out), "--plots", str(tmp_path / "plots"), stdout=f,
                            stderr=subprocess.STDOUT)
        rc = proc.wait(timeout=1400)
    assert rc == 0, log.read_text()[-4000:]
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["rows"]] == rows.split(",")
    assert data["tables"]["rows"] == data["rows"] and data["smoke"] is True and data["complete"] is True
    for row in data["rows"]:
        for key in REQUIRED:
            assert key in row, (row["name"], key)
        assert row["steps"] == 1, row  # the budget ended training after the first step
        for key in ("accuracy_before", "accuracy_after"):
            assert 0.0 <= row[key] <= 1.0
        for key in ("ci95_before", "ci95_after"):
            lo, hi = row[key]
            assert 0.0 <= lo <= hi <= 1.0
        assert 0.0 < row["majority_answer_share"] <= 1.0  # the best constant answer's score, beside accuracy
        assert sum(n for _, n in row["answers_top_after"]) <= row["n_eval"]
        assert row["learner_peak_rss_gb"] > 0.05 and row["job_peak_rss_gb"] > 0.05
        if row["name"] != "trl-grpo":
            # several processes (controller, worker, learner) summed: above the learner alone. TRL's job is
            # its one process, whose RSS sampled every 0.5 s can miss the exact high-water mark (VmHWM)
            assert row["job_peak_rss_gb"] >= row["learner_peak_rss_gb"]
        assert row["seconds_per_step"] > 0  # one step: its own wall time from the start of training
    assert all(os.path.isfile(p) for p in data["plots"])
    return data


def test_bench_real_smoke_runs_the_asyncrl_rows(procs, tmp_path):
    run_smoke(procs, tmp_path, "asyncrl-lora,asyncrl-full")


def test_bench_real_smoke_runs_the_trl_row(procs, tmp_path):
    if not os.path.isfile(os.path.join(ROOT, ".cache", "trl-venv", ".installed")):
        pytest.skip("the TRL venv is not built (make trl-venv); bench_real builds it at benchmark time")
    run_smoke(procs, tmp_path, "trl-grpo")
