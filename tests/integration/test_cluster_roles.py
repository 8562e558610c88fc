"""Every role its own command, placed like on a cluster (marker ``slow``): ``asyncrl controller`` started
on its own, a learner of two "nodes" (two torchrun agents on localhost joined by c10d rendezvous,
``--nnodes=2``) that finds the run through the controller, and an ``asyncrl worker`` joined by address.

The two-node learner must train exactly like world size 2 under one agent: replaying the run's trajectory
log (the same batches in the same order) with ``learner.world_size=2`` gives the same loss curve.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from asyncrl.engine.sglang.server import free_port
from asyncrl.log import BatchRecord, SampleRecord, read_log

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1500)]

STEPS = 4
RUN = [f"learner.total_steps={STEPS}", "learner.ckpt_every=2", "learner.eval_every=0", "rollout.eta=1",
       "rollout.groups_per_step=2", "rollout.num_workers=0", "rollout.dead_after_s=120"]


def _controller_address(proc: subprocess.Popen, timeout_s: float = 600) -> tuple[str, str, list[str]]:
    """Read ``asyncrl controller``'s stdout until it prints its addresses (JSON line)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode(errors="replace")
        if not line:
            break
        lines.append(line)
        if line.startswith('{"control"'):
            info = json.loads(line)
            return info["control"], info["run_dir"], lines
    raise AssertionError("controller never printed its address:\n" + "".join(lines[-40:]))


def _loss_curve(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["actor/pg_loss"]) for r in rows if r.get("actor/pg_loss") is not None]


def test_two_node_torchrun_learner_joined_to_a_separate_controller_trains_like_world_size_two(procs, tmp_path):
    runs = tmp_path / "runs"
    ctl = procs.python("-m", "asyncrl", "controller", f"runs_dir={runs}", "run_name=cluster", *RUN,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    address, run_dir, _ = _controller_address(ctl)
    run_dir = Path(run_dir)
    port = free_port()
    agents = []
    for node, is_host in ((0, 1), (1, 0)):
        log = open(tmp_path / f"agent{node}.log", "wb")  # noqa: SIM115 - closed with the test's tmp_path
        agents.append(procs.python(
            "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=asyncrl-test", f"--rdzv-conf=is_host={is_host}",
            "--max-restarts=0", "-m", "asyncrl", "learner", f"controller={address}",
            stdout=log, stderr=subprocess.STDOUT))
    worker = procs.python("-m", "asyncrl", "worker", f"controller={address}", "worker_id=node2-w0", "rollout.device=cpu",
                          stdout=open(tmp_path / "worker.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    codes = [a.wait(timeout=1200) for a in agents]
    logs = [(tmp_path / f"agent{i}.log").read_text(errors="replace")[-3000:] for i in (0, 1)]
    assert codes == [0, 0], logs
    out, _ = ctl.communicate(timeout=120)  # the controller ends after the learner, once the worker left
    assert ctl.returncode == 0, out.decode(errors="replace")[-3000:]
    assert worker.wait(timeout=120) == 0, (tmp_path / "worker.log").read_text()[-3000:]

    # Both agents formed one group of two ranks: the checkpoint holds a shard of each rank.
    ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
    shards = {p.name for c in ckpts for p in c.glob("dcp/*.distcp")}
    assert {"__0_0.distcp", "__1_0.distcp"} <= shards, sorted(shards)
    final = json.loads((run_dir / "learner_final.json").read_text())
    assert final["version"] == STEPS
    scan = read_log(run_dir / "trajectories")
    samples = Counter(r.sample.sample_id for r in scan.records if isinstance(r, SampleRecord))
    assert samples and max(samples.values()) == 1
    assert [b.step for b in scan.records if isinstance(b, BatchRecord)] == list(range(STEPS))
    assert json.loads((run_dir / "config.json").read_text())["learner"]["world_size"] == 1  # W came from torchrun

    # The same batches under one agent with two ranks: the same loss curve (float tolerance).
    rep = procs.python("-m", "asyncrl", "replay", f"run={run_dir}", "run_name=one-agent-ws2",
                       "learner.world_size=2", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    rep_out, _ = rep.communicate(timeout=900)
    assert rep.returncode == 0, rep_out.decode(errors="replace")[-3000:]
    two_nodes, one_agent = _loss_curve(run_dir), _loss_curve(runs / "one-agent-ws2")
    assert len(two_nodes) == STEPS and [s for s, _ in two_nodes] == [s for s, _ in one_agent]
    for (_, a), (_, b) in zip(two_nodes, one_agent, strict=True):
        assert a == pytest.approx(b, abs=1e-6)
