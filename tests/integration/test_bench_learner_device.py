"""``scripts/bench_learner.py --device``: the learner benchmark's device path. On the CPU (default suite) a
``--quick`` smoke on tiny random-weight Qwen3 and Qwen3-MoE models built from their configs reports tokens
per second and MFU against the bf16 matmul rate it measured; on a GPU (marker ``gpu``) the Qwen3-0.6B
preset, built from its config, also reports peak GPU memory."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts",
                      "bench_learner.py")


def bench(procs, tmp_path, *args: str) -> tuple[int, str, dict]:
    out = tmp_path / "bench.json"
    proc = procs.python(SCRIPT, *args, "--json", str(out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    log, _ = proc.communicate(timeout=800)
    data = json.loads(out.read_text()) if out.is_file() else {}
    return proc.returncode, log.decode(errors="replace"), data


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_cpu_quick_smoke_reports_throughput_and_mfu(procs, tmp_path, family):
    rc, log, data = bench(procs, tmp_path, "--device", "cpu", "--quick", "--model", f"family:{family}",
                          "--rows", "full,lora-bf16", "--samples", "8", "--new-tokens", "8")
    assert rc == 0, log[-3000:]
    rows = data["tables"]["rows"]
    assert [r["row"] for r in rows] == ["full", "lora-bf16"] and data["device"] == "cpu"
    for r in rows:
        assert r["device"] == "cpu" and r["peak_gpu_gb"] == 0.0
        assert r["tokens_per_s"] > 0 and r["matmul_tflops"] > 0 and r["model_tflops_per_s"] > 0
        assert r["mfu"] == pytest.approx(r["model_tflops_per_s"] / r["matmul_tflops"])
    assert rows[1]["trainable_params"] < rows[0]["trainable_params"]


def test_cuda_without_a_gpu_is_refused_naming_the_fix(procs, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    rc, log, _ = bench(procs, tmp_path, "--device", "cuda", "--quick", "--model", "family:qwen3", "--rows", "full")
    assert rc != 0 and "torch sees no GPU here; run with --device cpu" in log


@pytest.mark.gpu
def test_gpu_qwen3_0_6b_reports_peak_memory_and_mfu(procs, tmp_path):
    rc, log, data = bench(procs, tmp_path, "--device", "cuda", "--model", "qwen3-0.6b", "--rows", "full-bf16",
                          "--samples", "16", "--prompt-len", "128", "--new-tokens", "256", "--token-budget", "8192",
                          "--steps", "2")
    assert rc == 0, log[-3000:]
    row = data["tables"]["rows"][0]
    assert row["device"] == "cuda" and row["peak_gpu_gb"] > 4  # fp32 weights + grads + AdamW: ~9.5 GB
    assert 0 < row["mfu"] < 1 and row["tokens_per_s"] > 0
