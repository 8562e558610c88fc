"""scripts/simulate_scale.py (the command line of asyncrl/sim) end to end on a real run folder: a short
``asyncrl train`` (tiny model, 2 workers, eta 2), then ``--quick`` with all three modes (calibrate from the run and predict, validate against the run
itself, extrapolate to cluster shapes at 1/32 size) and ``--json``. No figure is asserted, only that the
stage times were found in the run's files and every table is well formed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from asyncrl.bench.report import ROOT
from asyncrl.bench.runs import train_env

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1500)]  # above its two 600 s guards


def _wait(proc, log, what: str, timeout_s: float) -> None:
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} did not finish in {timeout_s}s:\n{log.read_text()[-3000:]}")
    assert rc == 0, f"{what} exited {rc}:\n{log.read_text()[-3000:]}"


def test_simulate_scale_quick_calibrates_from_a_real_run_predicts_validates_and_extrapolates(procs, tmp_path):
    runs = tmp_path / "runs"
    log = tmp_path / "train.log"
    with open(log, "wb") as f:
        train = procs.spawn([sys.executable, "-m", "asyncrl", "train", f"runs_dir={runs}", "run_name=w2-eta2",
                             "learner.total_steps=8", "rollout.num_workers=2", "rollout.eta=2", "learner.eval_every=0",
                             "learner.ckpt_every=0"], cwd=ROOT, env=train_env(), stdout=f,
                            stderr=subprocess.STDOUT)
        _wait(train, log, "asyncrl train", 600)
    out, slog = tmp_path / "simulate_scale.json", tmp_path / "simulate_scale.log"
    with open(slog, "wb") as f:
        sim = procs.spawn([sys.executable, os.path.join(ROOT, "scripts", "simulate_scale.py"), "--quick",
                           "--run", str(runs / "w2-eta2"), "--validate", "--reuse", str(runs), "--workers", "2",
                           "--etas", "2", "--calibrate-cell", "2,2", "--extrapolate", "--shrink", "32",
                           "--json", str(out)], cwd=ROOT, env=train_env(), stdout=f,
                          stderr=subprocess.STDOUT)
        _wait(sim, slog, "simulate_scale.py", 600)
    data = json.loads(out.read_text())
    assert data["benchmark"] == "simulate_scale" and data["quick"] is True
    cal = data["tables"]["run"]["calibration"]
    for key in ("train_s", "publish_s", "fetch_s", "step_a"):  # every stage time was found in the run's own files
        assert isinstance(cal[key], float) and cal[key] > 0 and math.isfinite(cal[key]), (key, cal[key])
    preds = data["tables"]["run"]["predictions"]
    assert [(r["workers"], r["eta"]) for r in preds] == [(2, 2)]  # the grid is the run itself: --validate reuses it
    assert all(r["predicted_samples_per_s"] > 0 for r in preds) and "error" in preds[0]
    (cell,) = data["tables"]["validation"]["cells"]
    assert cell["calibration"] is True and cell["measured_samples_per_s"] > 0
    assert 0.0 <= cell["staleness_tv"] <= 1.0
    rows = data["tables"]["extrapolation"]["rows"]
    assert {r["eta"] for r in rows} == {0, 4} and all(r["samples_per_s"] > 0 for r in rows)
    assert data["tables"]["extrapolation"]["limits"] and data["tables"]["extrapolation"]["fsync_s"] > 0
