"""``scripts/bench_engine.py`` builds every decode-step runner in its warm-up, never inside a timed round.

On a GPU a runner is a CUDA graph captured on a bucket's first step; here (no CUDA graphs on a CPU) it is the
step body compiled by ``torch.compile`` (``--compile-step eager``: dynamo traces one graph per bucket), counted
by the same ``StepGraphs`` bookkeeping. The run uses two batch sizes and a span that crosses a bucket and a
K/V-cache growth, so a warm-up that misses a bucket, or a cache growth after the warm-up (which drops every
runner), shows up as builds inside the rounds. No figure is asserted; the counts are.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from tests.integration.runs import run_script

pytestmark = [pytest.mark.integration]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "bench_engine.py")


@pytest.mark.timeout(600)
def test_bench_engine_compiles_every_bucket_in_warmup_and_nothing_inside_a_timed_round(procs, tmp_path):
    out, log = tmp_path / "bench_engine.json", tmp_path / "bench_engine.log"
    # prompt 8 + 20 new tokens: spans 16 and 28 (the cache's final capacity), batches 1 and 2: four buckets
    args = ["--device", "cpu", "--shapes", "smollm2-135m", "--layers", "1", "--batch-sizes", "1,2",
            "--prompt-len", "8", "--new-tokens", "20", "--rounds", "2", "--formats", "bf16", "--hf", "",
            "--compile-step", "eager", "--json", str(out)]
    rc = run_script(procs, SCRIPT, *args, log=log, timeout=540)
    assert rc == 0, log.read_text()[-3000:]
    data = json.loads(out.read_text())
    assert data["builds_in_timed_rounds"] == 0, data["tables"]["shapes"]
    rows = data["tables"]["shapes"]
    assert [(r["path"], r["batch"]) for r in rows] == [("native-bf16", 1), ("native-bf16", 2)]
    for r in rows:
        assert r["timed_builds"] == 0 and r["timed_kv_allocations"] == 0 and r["valid"] is True, r
    stats = data["step_stats"]["smollm2-135m"]["bf16"]
    assert stats["bucketed"] is True, "the compiled step runs buckets"
    assert stats["kv_capacity"] == 28, "the cache was sized to prompt + new tokens before the warm-up"
    # the four buckets the rounds use were compiled (the counter is live) and every timed step replayed one:
    # 2 rounds x (19 steps at batch 1 + 19 at batch 2)
    assert stats["builds"] >= 4 and stats["replays"] >= 2 * 2 * 19, stats


def _bench_engine_module():
    spec = importlib.util.spec_from_file_location("bench_engine_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_build_watch_counts_a_runner_built_inside_a_timed_run_and_fails_the_run(capsys):
    """The detector itself: a bucket first used inside a watched run is one build there, and the script's
    exit status says so; a run that only replays counts nothing."""
    from asyncrl.bench.models import build_shape
    from asyncrl.engine.native.engine import NativeEngine

    bench = _bench_engine_module()
    engine = NativeEngine(build_shape("smollm2-135m", "cpu", layers=1), max_batch_size=2, decode_step="static")
    engine._static.pad = True  # the bucket path of CUDA graphs and a compiled step, with eager runners
    prompt = list(range(3, 11))
    bench.size_kv_cache(engine, prompt, 6)
    assert engine.step_stats()["kv_capacity"] == 16  # 8 + 6 positions, at least 16

    def run(batch: int) -> float:
        return bench.native_rate(engine, _ids([prompt] * batch), 6, f"b{batch}", "cpu")

    watch = bench.BuildWatch()
    run(1)  # warm-up of batch 1 only
    watch.watch("batch 1", engine, lambda: run(1))()
    watch.watch("batch 2", engine, lambda: run(2))()  # batch 2's bucket was never warmed up
    assert watch.builds == {"batch 1": 0, "batch 2": 1}
    assert watch.row("batch 2") == {"timed_builds": 1, "timed_kv_allocations": 0, "valid": False}
    assert watch.report() == 1 and "built inside timed rounds" in capsys.readouterr().err
    engine.close()


def _ids(rows: list[list[int]]):
    import torch

    return torch.tensor(rows)
