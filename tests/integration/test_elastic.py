"""Operating it for real: workers that die and join at run time, a controller that crashes and resumes.

Marker ``slow``: each test runs a short real job (controller, learner, workers) and injects faults by
PID (SIGKILL), the only way to make a process die without warning.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
from collections import Counter
from pathlib import Path

import psutil
import pytest

from asyncrl.log import BatchRecord, EventRecord, SampleRecord, read_log
from tests.integration.runs import asyncrl, wait_for_step

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1200)]

G = 8
STEPS = 48
"""Far past the last step a test acts at (10), so every kill lands mid-run and every replacement worker
(a few seconds to start) joins and every killed one is declared dead before the run ends (see
``tests.integration.runs``)."""
RUN = [f"learner.total_steps={STEPS}", "learner.ckpt_every=4", "learner.eval_every=0", "rollout.eta=2",
       "rollout.groups_per_step=4", "rollout.heartbeat_s=0.5",
       "rollout.dead_after_s=3"]


def _children(root: int, marker: str) -> list[psutil.Process]:
    out = []
    for p in psutil.Process(root).children(recursive=True):
        try:
            if marker in " ".join(p.cmdline()) and p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def _serving_workers(root: int, run_dir: Path) -> list[psutil.Process]:
    """The launcher's worker processes the controller counts as members: joined (its log says so) and not yet
    gone. A worker the launcher is still starting again is left out: killed before it joins, no heartbeat of
    it is ever missed."""
    text = (run_dir / "logs" / "controller.log").read_text()
    out = []
    for p in _children(root, "workers.generator"):
        try:
            worker_id = next(a.split("=", 1)[1] for a in p.cmdline() if a.startswith("worker_id="))
        except (psutil.NoSuchProcess, StopIteration):
            continue
        if f"worker {worker_id} joined" in text and f"worker {worker_id} missed" not in text:
            out.append(p)
    return out


def _check_log_exactly_once(run_dir: Path, steps: int) -> list:
    scan = read_log(run_dir / "trajectories")
    assert not scan.corruptions
    samples = [r for r in scan.records if isinstance(r, SampleRecord)]
    batches = [r for r in scan.records if isinstance(r, BatchRecord)]
    ids = Counter(r.sample.sample_id for r in samples)
    assert max(ids.values()) == 1, [k for k, v in ids.items() if v > 1][:5]
    assert [b.step for b in batches] == list(range(steps))
    for b in batches:  # no batch lost a group or a member of one
        groups = Counter(sid.split("/")[0] for sid in b.sample_ids)
        assert len(groups) == 4 and set(groups.values()) == {G}
        assert set(b.sample_ids) <= set(ids)
    return scan.records


def test_workers_killed_and_replaced_at_run_time_lose_and_duplicate_nothing(tmp_path, procs):
    rng = random.Random(0)
    proc = procs.python("-m", "asyncrl", "train", f"runs_dir={tmp_path}", "run_name=chaos", *RUN,
                        "rollout.num_workers=3", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    run_dir = tmp_path / "chaos"
    wait_for_step(run_dir, 2, proc)
    address = json.loads((run_dir / "controller.json").read_text())["control"]
    killed = 0
    for i in range(3):
        workers = _serving_workers(proc.pid, run_dir)
        assert workers, "no joined worker alive"
        victim = rng.choice(workers)
        victim.send_signal(signal.SIGKILL)  # dies mid-generation: no Goodbye, no heartbeat
        killed += 1
        procs.python("-m", "asyncrl", "worker", f"controller={address}", f"worker_id=replacement-{i}")
        wait_for_step(run_dir, 4 + 3 * i, proc)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out.decode(errors="replace")[-3000:]
    records = _check_log_exactly_once(run_dir, STEPS)
    left = [r for r in records if isinstance(r, EventRecord) and r.event == "worker_left"]
    assert sum("missed heartbeats" in r.data["reason"] for r in left) >= killed
    joined = {r.data["worker"] for r in records if isinstance(r, EventRecord) and r.event == "worker_joined"}
    assert {"replacement-0", "replacement-1", "replacement-2"} <= joined
    final = json.loads((run_dir / "controller_final.json").read_text())
    assert final["controller/workers/dead"] >= killed


def test_killed_controller_resumes_and_the_log_continues_without_loss_or_duplicates(tmp_path, procs):
    proc = procs.python("-m", "asyncrl", "train", f"runs_dir={tmp_path}", "run_name=ctlcrash", *RUN,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    run_dir = tmp_path / "ctlcrash"
    wait_for_step(run_dir, 6, proc)
    (controller,) = _children(proc.pid, "workers.controller")
    controller.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode != 0 and b"controller failed (exit -9): killed by SIGKILL  [log: " in out
    res = asyncrl(procs, "train", f"resume={run_dir}")
    assert res.returncode == 0, res.stdout[-4000:]
    records = _check_log_exactly_once(run_dir, STEPS)
    resumes = [r for r in records if isinstance(r, EventRecord) and r.event == "resume"]
    assert len(resumes) == 1 and int(resumes[0].data["version"]) in range(4, STEPS, 4)
    assert json.loads((run_dir / "summary.json").read_text())["learner_steps"] == STEPS
