"""A live ``asyncrl train`` run whose weights stream to the workers in buckets (``transport.bucket_mb``).

The tiny model's int8 version is ~1.1 MB: buckets of 1/8 MiB cut it in nine, and its deltas in several, so every
version reaches the workers bucket by bucket while the learner quantises it (docs/quantization.md §4.2).
"""

from __future__ import annotations

import pytest

from asyncrl.metrics import read_metrics
from tests.integration.runs import asyncrl

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1200)]


def test_bucketed_weights_reach_every_worker_bucket_by_bucket_in_a_live_run(tmp_path, procs):
    res = asyncrl(procs, "train", f"runs_dir={tmp_path}", "run_name=buckets", "transport.bucket_mb=0.125",
                  "learner.total_steps=5", "learner.ckpt_every=0", "learner.eval_every=0", "rollout.eta=1",
                  "rollout.groups_per_step=2", "rollout.dead_after_s=60")
    assert res.returncode == 0, res.stdout[-4000:]
    run_dir = tmp_path / "buckets"
    rows = [r for r in read_metrics(run_dir) if "transport/weights/buckets_served" in r]
    last = rows[-1]
    assert last["transport/weights/buckets_served"] > 2 * last["transport/weights/fetches_served"] > 0
    assert last["transport/weights/deltas_served"] > 0  # deltas stream in buckets too
    logs = {w: (run_dir / "logs" / f"{w}.log").read_text() for w in ("worker-0", "worker-1")}
    for w, text in logs.items():
        assert "could not load" not in text and " left: " in text, w
    assert any("as deltas" in line and "(0 as deltas)" not in line for text in logs.values()
               for line in text.splitlines() if " left: " in line)
