"""What a resume accepts and refuses, with real processes (marker ``slow``): a run stopped with Ctrl-C whose
log is then damaged inside is refused with the fix (``log.salvage=true``) and no traceback, resumes when
given it, and finishes; ``asyncrl log show`` reads the run through its own configuration; resuming the
finished run says so and changes nothing in its folder."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from asyncrl.controller.state import read_state
from asyncrl.rundir import RunDir
from tests.integration.runs import asyncrl, wait_for_step

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1200)]

STEPS = 24  # far past the step the test interrupts at, so the Ctrl-C always lands mid-run
RUN = [f"learner.total_steps={STEPS}", "learner.ckpt_every=2", "learner.eval_every=0", "rollout.eta=1",
       "rollout.groups_per_step=2", "rollout.num_workers=1", "rollout.dead_after_s=60"]


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file of the run folder but its lock, by relative path."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def test_a_damaged_log_resumes_with_the_salvage_its_error_asks_for_and_a_finished_run_stays_as_it_is(tmp_path, procs):
    cache = f"model.cache_dir={tmp_path / 'cache'}"
    proc = procs.python("-m", "asyncrl", "train", f"runs_dir={tmp_path / 'runs'}", "run_name=r", cache, *RUN,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    run = tmp_path / "runs" / "r"
    wait_for_step(run, 3, proc)
    proc.send_signal(signal.SIGINT)  # a resumable stop: the learner checkpoints where it is
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out.decode(errors="replace")[-3000:]
    version = json.loads((RunDir(run).checkpoints / RunDir(run).latest.read_text().strip() / "learner.json")
                         .read_text())["version"]
    segment, position = read_state(RunDir(run).controller_checkpoint(version))["log_position"]
    log_file = RunDir(run).trajectories / f"traj-{segment:06d}.log"
    data = bytearray(log_file.read_bytes())
    data[position // 2] ^= 0xFF  # one damaged byte inside a record the resume keeps
    log_file.write_bytes(bytes(data))

    refused = asyncrl(procs, "train", f"resume={run}")
    assert refused.returncode != 0, refused.stdout[-3000:]
    assert "controller did not start" in refused.stdout and "log.salvage=true" in refused.stdout, refused.stdout
    assert "Traceback" not in refused.stdout and 'File "' not in refused.stdout, refused.stdout[-3000:]
    assert "resume with: asyncrl train" not in refused.stdout  # the advice is the salvage, not the same resume

    resumed = asyncrl(procs, "train", f"resume={run}", "log.salvage=true", "learner.lr=0.5")
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert "ignoring ['learner.lr=0.5']" in resumed.stdout
    stored = json.loads(RunDir(run).config.read_text())
    assert stored["log"]["salvage"] is True and stored["learner"]["lr"] != 0.5
    assert json.loads(RunDir(run).summary.read_text())["learner_steps"] == STEPS

    shown = asyncrl(procs, "log", "show", str(run), "--last", "2")  # the tokenizer of the run's own model folder
    assert shown.returncode == 0 and "--- g" in shown.stdout, shown.stdout[-2000:]

    before = snapshot(run)
    again = asyncrl(procs, "train", f"resume={run}")
    assert again.returncode == 0 and f"already finished (learner version {STEPS}" in again.stdout, again.stdout[-2000:]
    assert snapshot(run) == before  # no log cut, no re-export, no new summary
