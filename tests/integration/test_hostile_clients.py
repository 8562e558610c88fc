"""Training under attack, with real processes: hostile clients must not stop training, and a killed
torchrun agent must not leave learner ranks behind.

The hostile-client test measures progress (learner steps completed while every attacker is running),
not only that the controller stays alive.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from asyncrl.log import SampleRecord, read_log
from asyncrl.log.inspect import summarize

REPO = Path(__file__).resolve().parents[2]
PEER = str(REPO / "tests" / "integration" / "hostile_peer.py")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return max([json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()] or [0])


@pytest.mark.slow
def test_training_keeps_progressing_while_hostile_clients_attack_the_controller(tmp_path, procs):
    """Also: started from another folder with a relative runs_dir, children find the run folder (item 12)."""
    total = 14
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    proc = procs.python("-m", "asyncrl", "train", "runs_dir=runs", "run_name=attacked",
                        f"model.cache_dir={REPO / '.cache' / 'models'}", f"learner.total_steps={total}",
                        "learner.ckpt_every=0", "learner.eval_every=0", "rollout.eta=1", "rollout.groups_per_step=4",
                        "rollout.assignment_timeout_s=5", "rollout.dead_after_s=60",
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd, env={"PYTHONPATH": str(REPO)})
    run_dir = cwd / "runs" / "attacked"
    # The attackers start with the run (they wait for its controller's address file), so they are up
    # before the learner's first steps however fast this machine trains.
    address_file = f"@{run_dir / 'controller.json'}"
    attackers = [procs.python(PEER, role, address_file, stdout=subprocess.PIPE, env={"PYTHONPATH": str(REPO)})
                 for role in ("flood", "hang", "poison")]
    for a in attackers:
        assert a.stdout.readline().strip() == b"ready", proc.poll()
    start = _steps(run_dir)
    out = proc.communicate(timeout=1000)[0].decode(errors="replace")  # read as it runs: a full pipe would stall it
    assert proc.returncode == 0, out[-4000:]
    # An attacker never restarts: alive now, it was alive through every step since `start` (counted after the
    # run ended, so the last step cannot fall between a poll and the run's exit).
    assert all(a.poll() is None for a in attackers), "an attacker stopped before training finished"
    during = _steps(run_dir) - start
    assert during == total - start and during >= total // 2  # every remaining step completed under attack
    final = json.loads((run_dir / "controller_final.json").read_text())
    assert final["controller/control/peers_dropped"] >= 1  # the flooder that never reads
    assert final["controller/samples/overdue_groups"] >= 1  # the worker that heartbeats but never returns
    assert final["controller/samples/invalid/token_ids"] >= 1  # the poisoner
    assert final["transport/weights/received"] >= 2  # the learner's weight-server counters reach the run files
    assert "transport/weights/rejected" in final
    assert summarize(run_dir / "trajectories")["exactly_once_problems"] == []
    workers = {r.sample.worker_id for r in read_log(run_dir / "trajectories").records if isinstance(r, SampleRecord)}
    assert not workers & {"flood", "hang", "poison"}


def test_learner_ranks_die_with_a_killed_torchrun_agent(tmp_path, procs):
    """SIGKILL of the agent (which cannot forward it): the rank must not live on holding ports."""
    import zmq

    from asyncrl.config.loader import load_train_config, save_config
    from asyncrl.models import ensure_tiny_model
    from asyncrl.transport import ZmqChannel
    from workers.learner.link import WELCOME_TIMEOUT_S

    model_dir = ensure_tiny_model(tmp_path / "tiny")
    save_config(load_train_config([]), tmp_path / "config.json")
    silent = ZmqChannel.bind(zmq.ROUTER, "tcp://127.0.0.1:0", name="silent-controller")  # takes Hello, never answers
    log = tmp_path / "agent.log"
    with open(log, "wb") as out:  # the rank writes here too (it inherits the agent's output)
        agent = procs.python("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                             "-m", "workers.learner", "--controller", silent.address, "--run-dir",
                             str(tmp_path), "--model-dir", str(model_dir), env={"PYTHONPATH": str(REPO)},
                             start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
    env = silent.recv(300.0)  # the rank is up and talking
    assert env is not None and env.msg.role == "learner"
    (rank,) = psutil.Process(agent.pid).children()
    agent.send_signal(signal.SIGKILL)
    agent.wait()
    # Which of the two ends it: the kernel's signal when its parent died (at once), or, were that not armed,
    # its own give-up on the silent controller after WELCOME_TIMEOUT_S, which it says. The wait below is only
    # a hang guard, past that give-up, so the outcome never depends on how fast this machine is.
    gone, alive = psutil.wait_procs([rank], timeout=WELCOME_TIMEOUT_S + 300)
    try:
        assert rank in gone, "the learner rank outlived its killed torchrun agent"
        text = log.read_text(errors="replace")
        assert "no answer from a controller" not in text, "the rank lived on until its own Welcome timeout:\n" + text[-3000:]
    finally:
        for p in alive:
            p.kill()
        silent.close()
