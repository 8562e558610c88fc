"""The documented learner stop under torchrun (marker ``slow``): SIGTERM to the agent the user started
(``asyncrl torchrun ... -m asyncrl learner``, two ranks, a real controller and worker) ends it with exit
status 0 and one line that says the stop was asked for and where the checkpoint is; no traceback. Plain
torchrun ended the same stop with a ``SignalException`` traceback and status 1, like a crash."""

from __future__ import annotations

import re
import signal

import pytest

from asyncrl.rundir import RunDir
from asyncrl.rundir.checkpoints import verify_manifest
from tests.integration.test_recovery_cluster import RUN, Role, controller, wait_for_step, worker

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]


def test_sigterm_to_the_torchrun_agent_stops_the_learner_with_status_0_and_says_where_the_checkpoint_is(
        procs, tmp_path):
    ctl, address, run_dir = controller(procs, tmp_path, "controller", f"runs_dir={tmp_path / 'runs'}",
                                       "run_name=stop", *RUN)
    agent = Role(procs, tmp_path, "learner", "-m", "asyncrl", "torchrun", "--standalone", "--nproc-per-node=2",
                 "--max-restarts=0", "-m", "asyncrl", "learner", f"controller={address}")
    w0 = worker(procs, tmp_path, "worker", address)
    wait_for_step(run_dir, 2, ctl, agent, w0)
    agent.proc.send_signal(signal.SIGTERM)  # the process the user started: `kill PID`, as docs/cluster.md says
    rc = agent.wait()
    text = agent.text()
    assert rc == 0, text[-4000:]
    assert "Traceback" not in text and "SignalException" not in text, text[-4000:]
    lines = [ln for ln in text.splitlines() if "learner stopped as asked (SIGTERM)" in ln]
    assert len(lines) == 1, text[-4000:]  # rank 0 says it, once
    found = re.search(r"at version (\d+): checkpoint (\S+);", lines[0])
    assert found, lines[0]
    version, where = int(found.group(1)), found.group(2)
    assert where == str(RunDir(run_dir).learner_checkpoint(version))
    assert RunDir(run_dir).latest.read_text().strip() == RunDir(run_dir).learner_checkpoint(version).name
    assert verify_manifest(where) is None
    assert ctl.proc.poll() is None and w0.proc.poll() is None  # the run waits for a learner to come back
