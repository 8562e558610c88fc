"""``asyncrl train rollout.engine=sglang`` end to end on the tiny model (marker ``sglang``).

The launcher starts the controller, the learner and one worker whose engine is a real SGLang 0.5.23
server that the worker starts itself (on this CPU: asyncrl's CPU setup, docs/sglang.md). Every learner
version reaches the server as a weight update in the published fp32 format. The run must train (the
sampled reward rises) and keep the trajectory log's promises: each sample logged once, consumed at most
once, no consumed token older than ``eta`` versions, and every sample made by the SGLang engine.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from asyncrl.log import EventRecord, read_log
from tests.sglang.runs import check_trajectory_log, rewards

pytestmark = [pytest.mark.sglang, pytest.mark.integration, pytest.mark.timeout(3000)]

# The default learning-rate schedule over 100 steps of 64 samples: with the native engine (same settings,
# fp32) the sampled reward went from 0.33 (mean of the first 20 steps) to 0.48 (last 20) on this machine.
ETA, STEPS, WINDOW = 1, 100, 20
RUN = [f"learner.total_steps={STEPS}", "learner.eval_every=0", "learner.ckpt_every=0", f"rollout.eta={ETA}",
       "rollout.heartbeat_s=0.05"]  # the default rollout.dead_after_s (30 s) is shorter than a CPU server's start


def test_train_with_an_sglang_worker_raises_the_reward_and_keeps_the_log_promises(procs, tmp_path,
                                                                                   sglang_python_path):
    runs = tmp_path / "runs"
    proc = procs.python("-m", "asyncrl", "train", f"runs_dir={runs}", "run_name=sgl", "rollout.engine=sglang",
                        "quant.fmt=fp32", "rollout.num_workers=1", "sglang.device=cpu",
                        f"sglang.python={sglang_python_path}", "sglang.startup_timeout_s=1500", *RUN,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=2700)
    text = out.decode(errors="replace")
    run_dir = runs / "sgl"
    assert proc.returncode == 0, text[-4000:] + _worker_logs(run_dir)
    by_id = check_trajectory_log(run_dir, eta=ETA, steps=STEPS)
    # the worker heartbeats while its server starts: it joins once and is never declared dead
    events = [r for r in read_log(run_dir / "trajectories").records if isinstance(r, EventRecord)]
    assert [e.data["worker"] for e in events if e.event == "worker_joined"] == ["worker-0"], events
    assert {r.sample.engine for r in by_id.values()} == {"sglang"}
    assert {r.sample.quant_format for r in by_id.values()} == {"fp32"}
    # no token came from the server's own start-up weights (version -1): each carries a learner version
    assert all((r.sample.versions.to_numpy() >= 0).all() for r in by_id.values())
    r = rewards(run_dir)
    assert len(r) == STEPS
    first, last = sum(r[:WINDOW]) / WINDOW, sum(r[-WINDOW:]) / WINDOW
    assert last > first, (first, last, r)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["learner_steps"] == STEPS and summary["max_consumed_staleness"] <= ETA
    assert list((run_dir / "logs").glob("sglang-*.log")), "the worker's SGLang server wrote no log"


def _worker_logs(run_dir: Path) -> str:
    return "".join(f"\n--- {p.name}\n" + p.read_text(errors="replace")[-3000:]
                   for p in sorted((run_dir / "logs").glob("*.log")))
