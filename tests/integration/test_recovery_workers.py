"""Worker faults with real processes (marker ``slow``): a group the controller took back from a worker as
overdue comes back to that same worker while its samples still run there."""

from __future__ import annotations

import json
import subprocess

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]


def test_an_overdue_group_that_comes_back_to_its_worker_keeps_running_there(procs, tmp_path):
    # every group is overdue at once (10 ms), and with one worker every reissued group comes back to it
    run = procs.python("-m", "asyncrl", "train", f"runs_dir={tmp_path}", "run_name=overdue", "learner.total_steps=4",
                       "learner.eval_every=0", "rollout.num_workers=1", "rollout.assignment_timeout_s=0.01",
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = run.communicate(timeout=800)[0].decode(errors="replace")
    assert run.returncode == 0, out[-4000:]
    assert "failed (exit" not in out and "already live in this engine" not in out, out[-4000:]
    final = json.loads((tmp_path / "overdue" / "controller_final.json").read_text())
    assert final["controller/samples/overdue_groups"] > 0
    worker_log = (tmp_path / "overdue" / "logs" / "worker-0.log").read_text()
    assert "came back to worker worker-0 while it still runs here" in worker_log
    assert json.loads((tmp_path / "overdue" / "learner_final.json").read_text())["version"] == 4
