"""A trajectory log deleted while a real run trains (marker ``slow``): the run stops with a non-zero status and
a message that names the lost file and the ways on, writes no summary, refuses a plain resume while the log is
gone, and with ``log.salvage=true`` trains to the end, counting as logged only the samples its log holds."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from asyncrl.log import SampleRecord, read_log
from asyncrl.rundir import RunDir
from tests.integration.runs import asyncrl, wait_for_step

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1200)]

STEPS = 24  # far past the step the log is deleted at, so the deletion always lands mid-run
RUN = [f"learner.total_steps={STEPS}", "learner.ckpt_every=2", "learner.eval_every=0", "rollout.eta=1",
       "rollout.groups_per_step=2", "rollout.num_workers=1", "rollout.dead_after_s=60"]


def test_a_log_deleted_mid_run_stops_it_naming_the_loss_and_resume_checks_the_log(tmp_path, procs):
    cache = f"model.cache_dir={tmp_path / 'cache'}"
    proc = procs.python("-m", "asyncrl", "train", f"runs_dir={tmp_path / 'runs'}", "run_name=r", cache, *RUN,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    run = tmp_path / "runs" / "r"
    wait_for_step(run, 3, proc)
    shutil.rmtree(RunDir(run).trajectories)  # rm -rf RUN/trajectories while it trains
    out, _ = proc.communicate(timeout=300)
    text = out.decode(errors="replace")
    assert proc.returncode not in (0, 130), text[-3000:]
    assert f"{RunDir(run).trajectories / 'traj-000000.log'} was deleted or moved" in text, text[-3000:]
    assert f"asyncrl train resume={run}" in text and "log.salvage=true" in text, text[-3000:]
    assert not RunDir(run).summary.exists()  # no summary claims samples that are not on disk

    refused = asyncrl(procs, "train", f"resume={run}")
    assert refused.returncode != 0, refused.stdout[-3000:]
    assert "trajectory log lost" in refused.stdout and "log.salvage=true" in refused.stdout, refused.stdout[-3000:]
    assert "Traceback" not in refused.stdout, refused.stdout[-3000:]

    resumed = asyncrl(procs, "train", f"resume={run}", "log.salvage=true")
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    summary = json.loads(RunDir(run).summary.read_text())
    logged = sum(isinstance(r, SampleRecord) for r in read_log(run).records)
    assert summary["learner_steps"] == STEPS and summary["samples_logged"] == logged > 0
