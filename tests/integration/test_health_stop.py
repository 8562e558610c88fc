"""``learner.stop_on`` ends a real run at a training-health alarm, cleanly (marker ``slow``).

``health.learner_busy_min=1.0`` makes ``rollout_bound`` certain: the learner's busy fraction of a step
is its training time over the step's wall time, which also holds the wait for the batch, so it is always
below 1. With ``health.window=2`` the alarm fires at the first step whose two-step window is full, and
``learner.stop_on=[rollout_bound]`` must end the run there as ``learner.time_budget_s`` does: a final
checkpoint of that version (learner and controller), the exported model, the final evaluation, the
summary with the alarm, the alarm printed by the launcher, and ``asyncrl log show`` listing it.
"""

from __future__ import annotations

import json
import subprocess

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]


def test_stop_on_ends_the_run_at_the_alarm_with_checkpoint_export_and_summary(procs, tmp_path):
    proc = procs.python("-m", "asyncrl", "train", f"runs_dir={tmp_path}", "run_name=stop",
                        "learner.total_steps=40", "learner.eval_every=0", "learner.ckpt_every=0",
                        "rollout.groups_per_step=2", "rollout.num_workers=1",
                        "learner.stop_on=[rollout_bound]", "health.learner_busy_min=1.0", "health.window=2",
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=800)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    run_dir = tmp_path / "stop"
    alarms = [json.loads(line) for line in (run_dir / "health.jsonl").read_text().splitlines()]
    assert alarms and alarms[0]["alarm"] == "rollout_bound" and alarms[0]["stop"] is True
    step = alarms[0]["step"]
    assert 3 <= step < 40
    assert f"health alarm rollout_bound at step {step}:" in text and "-> stopping (learner.stop_on)" in text
    # finished at the alarm's version, as at learner.total_steps: checkpoint, export, final evaluation
    final = json.loads((run_dir / "learner_final.json").read_text())
    assert final["version"] == step and 0.0 <= final["eval/accuracy"] <= 1.0
    assert (run_dir / "checkpoints" / f"controller-{step:08d}.json").is_file()
    assert (run_dir / "checkpoints" / f"step_{step:08d}").is_dir()
    assert (run_dir / "model" / "config.json").is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["learner_steps"] == step and summary["health_alarms"] == len(alarms)
    assert summary["health_alarm_list"].startswith(f"rollout_bound@{step}")
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert f"controller ends training before step {step}: health alarm rollout_bound" in learner_log
    # asyncrl log show lists the alarm (step, name, message) before the samples
    show = procs.python("-m", "asyncrl", "log", "show", str(run_dir), "--last", "2", "--tokenizer",
                        str(run_dir / "model"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = show.communicate(timeout=300)
    assert show.returncode == 0, stderr[-3000:]
    lines = stdout.splitlines()
    assert lines[0] == f"health alarms: {len(alarms)} (health.jsonl)"
    assert lines[1].split()[:3] == ["step", str(step), "rollout_bound"] and lines[1].endswith("[stopped training]")
    assert "likely cause: generation is the bottleneck" in lines[2]
    assert any(line.startswith("=== group ") for line in lines)

