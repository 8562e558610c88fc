"""Worker faults with real processes: a group the controller took back from a worker as overdue comes back
to that same worker while its samples still run there (slow: a whole run); a worker whose controller
restarted without a learner waits a bounded time for one, then leaves naming the role to restart."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

import protocols as P
from tests.integration.standin import worker_standin

pytestmark = pytest.mark.integration


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_overdue_group_that_comes_back_to_its_worker_keeps_running_there(procs, tmp_path):
    # every group is overdue at once (10 ms), and with one worker every reissued group comes back to it; its
    # samples (64 tokens at temperature 2, so rarely an early stop) still run when the controller's timer, every
    # 0.2 s, hands the group back (with 8 tokens they had finished by then on a quiet machine)
    run = procs.python("-m", "asyncrl", "train", f"runs_dir={tmp_path}", "run_name=overdue", "learner.total_steps=4",
                       "learner.eval_every=0", "rollout.num_workers=1", "rollout.assignment_timeout_s=0.01",
                       "rollout.max_new_tokens=64", "rollout.temperature=2.0",
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = run.communicate(timeout=800)[0].decode(errors="replace")
    assert run.returncode == 0, out[-4000:]
    assert "failed (exit" not in out and "already live in this engine" not in out, out[-4000:]
    final = json.loads((tmp_path / "overdue" / "controller_final.json").read_text())
    assert final["controller/samples/overdue_groups"] > 0
    worker_log = (tmp_path / "overdue" / "logs" / "worker-0.log").read_text()
    assert "came back to worker worker-0 while it still runs here" in worker_log
    assert json.loads((tmp_path / "overdue" / "learner_final.json").read_text())["version"] == 4


def test_a_worker_waits_a_bounded_time_for_a_restarted_controller_to_get_a_learner(procs, tmp_path):
    with worker_standin(tmp_path, worker_slots=8, group_size=4) as stand:
        worker = procs.python("-m", "workers.generator", f"controller={stand.ctl.address}", "worker_id=w",
                              "no_learner_s=2", stderr=subprocess.PIPE)
        welcomed = not_ready = 0
        deadline = time.monotonic() + 120
        while worker.poll() is None and time.monotonic() < deadline:
            env = stand.ctl.recv(0.05)
            if env is None:
                continue
            if isinstance(env.msg, P.Hello) and not welcomed:
                stand.welcome(env)
                welcomed += 1
            elif isinstance(env.msg, P.Hello):  # the restarted controller: no learner yet
                stand.ctl.send(P.Error(code="not_ready", message="the learner has not published weights yet; retry"),
                               to=env.peer)
                not_ready += 1
            elif isinstance(env.msg, (P.WorkRequest, P.Heartbeat)):  # it does not know this worker
                stand.ctl.send(P.Error(code="not_registered", message="send Hello first"), to=env.peer)
        _, err = worker.communicate(timeout=60)
        text = err.decode(errors="replace")
        assert worker.returncode == 1 and not_ready >= 2, text[-3000:]
        assert "has had no learner for 2 s" in text and "start the learner again (`asyncrl learner controller=" in text
        assert text.count("waiting up to 2 s") == 1 and "Traceback" not in text, text[-3000:]
