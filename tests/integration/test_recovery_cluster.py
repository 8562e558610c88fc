"""Cluster recoveries with every role its own process (marker ``slow``): a learner stopped and started again
under a running controller (also at another world size), a controller killed and resumed under a live
learner and live workers, a worker that follows a learner's new weight server, and a second worker that
asks for a live worker's id. Each run ends with every batch logged once, and a replay of its log
reproduces the final weights bit for bit.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from asyncrl.log import BatchRecord, SampleRecord, read_log
from asyncrl.metrics import read_metrics
from tests.integration.runs import POLL_S, asyncrl

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]

STEPS = 24
"""Long enough that every stop, kill and restart below lands mid-run, also on a fast machine (the tiny model
trains a step in a fraction of a second; with 9 steps a run could end between a check and a kill)."""
RUN = [f"learner.total_steps={STEPS}", "learner.ckpt_every=3", "learner.eval_every=0", "rollout.eta=1",
       "rollout.groups_per_step=2", "rollout.num_workers=0", "rollout.dead_after_s=120"]


class Role:
    """One process of the cluster, its output in a file of the test's folder."""

    def __init__(self, procs, tmp_path: Path, name: str, *args: str) -> None:
        self.log = tmp_path / f"{name}.log"
        with open(self.log, "wb") as out:
            self.proc = procs.python(*args, stdout=out, stderr=subprocess.STDOUT)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout:.0f} s; its output ends:\n"
                                 + self.text()[-6000:]) from None


def controller(procs, tmp_path: Path, name: str, *overrides: str) -> tuple[Role, str, Path]:
    role = Role(procs, tmp_path, name, "-m", "asyncrl", "controller", *overrides)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for line in role.text().splitlines():
            if line.startswith('{"control"'):
                info = json.loads(line)
                return role, info["control"], Path(info["run_dir"])
        assert role.proc.poll() is None, role.text()[-3000:]
        time.sleep(0.5)
    raise AssertionError("the controller never printed its address:\n" + role.text()[-3000:])


def learner(procs, tmp_path: Path, name: str, address: str, ranks: int = 1) -> Role:
    if ranks == 1:
        return Role(procs, tmp_path, name, "-m", "asyncrl", "learner", f"controller={address}")
    return Role(procs, tmp_path, name, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                "--max-restarts=0", "-m", "asyncrl", "learner", f"controller={address}")


def worker(procs, tmp_path: Path, name: str, address: str, worker_id: str = "w0") -> Role:
    return Role(procs, tmp_path, name, "-m", "asyncrl", "worker", f"controller={address}", f"worker_id={worker_id}",
                "rollout.device=cpu")


def steps_done(run_dir: Path) -> int:
    """The newest version the learner reported (metrics.jsonl rows with a loss)."""
    return max((r["step"] for r in read_metrics(run_dir) if "actor/pg_loss" in r), default=0)


def wait_for_step(run_dir: Path, step: int, *roles: Role, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while steps_done(run_dir) < step:
        for r in roles:
            assert r.proc.poll() is None, f"{r.log.name} ended (rc {r.proc.returncode}):\n{r.text()[-3000:]}"
        assert time.monotonic() < deadline, f"no step {step} within {timeout} s: " + "\n".join(
            r.text()[-1500:] for r in roles)
        time.sleep(POLL_S)  # short: the stop or kill that follows must land while the run still has steps to go


def check_log_and_replay(procs, run_dir: Path, tmp_path: Path) -> None:
    """Every batch 0..STEPS-1 logged once over the run's segments, every sample once, and the replay of the log
    gives the final weights bit for bit."""
    scan = read_log(run_dir / "trajectories")
    assert not scan.corruptions
    samples = Counter(r.sample.sample_id for r in scan.records if isinstance(r, SampleRecord))
    assert samples and max(samples.values()) == 1
    assert [b.step for b in scan.records if isinstance(b, BatchRecord)] == list(range(STEPS))
    final = json.loads((run_dir / "learner_final.json").read_text())
    assert final["version"] == STEPS
    rep = asyncrl(procs, "replay", f"run={run_dir}", "run_name=replayed")
    assert rep.returncode == 0, rep.stdout[-3000:]
    replayed = json.loads((run_dir.parent / "replayed" / "learner_final.json").read_text())
    assert replayed["state_dict_sha256"] == final["state_dict_sha256"]


def test_a_learner_stopped_and_started_again_at_two_ranks_resumes_and_a_second_worker_id_is_refused(procs, tmp_path):
    ctl, address, run_dir = controller(procs, tmp_path, "controller", f"runs_dir={tmp_path / 'runs'}",
                                       "run_name=restart", *RUN)
    first = learner(procs, tmp_path, "learner1", address)
    w0 = worker(procs, tmp_path, "worker", address)
    wait_for_step(run_dir, 2, ctl, first, w0)
    first.proc.send_signal(signal.SIGTERM)  # it writes a checkpoint of the version it reached
    assert first.wait() == 0, first.text()[-3000:]
    stopped_at = int((run_dir / "checkpoints" / "latest").read_text().strip().rsplit("_", 1)[-1])
    assert 2 <= stopped_at < STEPS

    # a second process under the live worker's id: refused at once, by name
    dup = worker(procs, tmp_path, "duplicate", address)
    assert dup.wait(300) == 1
    assert "worker id 'w0' is already taken by a live worker" in dup.text() and "worker_id=NAME" in dup.text()

    # started again, without resume=, at another world size: it resumes from that checkpoint (DCP reshards)
    second = learner(procs, tmp_path, "learner2", address, ranks=2)
    assert second.wait(600) == 0, second.text()[-4000:]
    assert f"resumed learner at version {stopped_at}" in second.text()
    assert ctl.wait(120) == 0, ctl.text()[-3000:]
    assert w0.wait(120) == 0, w0.text()[-3000:]
    assert "the learner now serves weights at" in w0.text()  # the worker followed the new weight server
    scan = read_log(run_dir / "trajectories")
    assert [b.step for b in scan.records if isinstance(b, BatchRecord)] == list(range(STEPS))
    assert json.loads((run_dir / "learner_final.json").read_text())["version"] == STEPS


def test_a_worker_follows_the_weight_server_of_a_learner_started_again_under_a_resumed_controller(procs, tmp_path):
    ctl, address, run_dir = controller(procs, tmp_path, "controller1", f"runs_dir={tmp_path / 'runs'}",
                                       "run_name=follow", *RUN)
    lrn = learner(procs, tmp_path, "learner1", address)
    w0 = worker(procs, tmp_path, "worker", address)
    wait_for_step(run_dir, 1, ctl, lrn, w0)
    # The learner stopped (checkpoint), the controller killed and resumed, the learner started again: the
    # worker, live all along, joins the resumed controller and fetches from the new learner's weight server.
    lrn.proc.send_signal(signal.SIGTERM)
    assert lrn.wait() == 0, lrn.text()[-3000:]
    ctl.proc.kill()
    ctl.wait()
    ctl, again, _ = controller(procs, tmp_path, "controller2", f"resume={run_dir}")
    assert again == address  # the live roles find it where they left it
    lrn = learner(procs, tmp_path, "learner2", address)
    assert lrn.wait(600) == 0, lrn.text()[-3000:]
    assert ctl.wait(120) == 0, ctl.text()[-3000:]
    assert w0.wait(120) == 0, w0.text()[-3000:]  # never restarted
    assert "the learner now serves weights at" in w0.text()
    scan = read_log(run_dir / "trajectories")
    assert [b.step for b in scan.records if isinstance(b, BatchRecord)] == list(range(STEPS))


def test_a_controller_killed_under_a_live_learner_and_worker_is_rejoined_and_a_replay_stays_bit_identical(
        procs, tmp_path):
    overrides = (f"runs_dir={tmp_path / 'runs'}", "run_name=ctl", *RUN)
    ctl, address, run_dir = controller(procs, tmp_path, "controller1", *overrides)
    lrn = learner(procs, tmp_path, "learner1", address)
    wrk = worker(procs, tmp_path, "worker1", address)
    wait_for_step(run_dir, 4, ctl, lrn, wrk)
    assert lrn.proc.poll() is None, "the run ended before the controller was killed; raise STEPS"
    # The learner rejoins at its version, or, ahead of the resumed controller's checkpoint, stops at once
    # naming the command to start it again (which then resumes); a worker whose weights are newer than those
    # of the learner that came back leaves, saying so.
    ctl.proc.kill()
    ctl.wait()
    ctl, again, _ = controller(procs, tmp_path, "controller2", f"resume={run_dir}")
    assert again == address
    restarted: Counter = Counter()
    deadline = time.monotonic() + 600
    while lrn.proc.poll() != 0:
        assert time.monotonic() < deadline, lrn.text()[-3000:]
        if lrn.proc.poll() not in (None, 0):  # (status 0, reached since the loop's check, ends the loop)
            text = lrn.text()
            assert lrn.proc.returncode == 1 and "asyncrl learner controller=ADDR" in text, text[-3000:]
            assert "Traceback" not in text and not restarted["learner"]
            restarted["learner"] += 1
            lrn = learner(procs, tmp_path, "learner2", address)
        # Its weights are newer than the restarted learner's: it leaves (status 1), saying so. Status 0 is the
        # end of training: the controller stops the worker as the run finishes, which may come a moment before
        # the learner's own exit (checked after the loop).
        if wrk.proc.poll() not in (None, 0):
            text = wrk.text()
            assert wrk.proc.returncode == 1 and "start this worker again" in text, text[-3000:]
            assert "Traceback" not in text and not restarted["worker"]
            restarted["worker"] += 1
            wrk = worker(procs, tmp_path, "worker2", address)
        time.sleep(0.5)
    assert ctl.wait(120) == 0, ctl.text()[-3000:]
    assert wrk.wait(120) == 0, wrk.text()[-3000:]
    check_log_and_replay(procs, run_dir, tmp_path)
