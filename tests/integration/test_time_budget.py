"""``learner.time_budget_s`` ends a real run early, and the run ends as a finished one (marker ``slow``).

The run fakes a CPU without an int8 dot product or bf16 matmul instructions (``ASYNCRL_CPU_FLAGS``): the
worker's int8 actor runs ``int_mm_avx2`` (``int_mm_fp32`` where the AVX2 kernel cannot be built) and
``learner.autocast=auto`` trains in fp32, and their start lines say
so and why. It also checks, on that real run, that the launcher and the controller never load torch and that
the learner at world size 1 runs without a torchrun agent. A budget of one microsecond is spent by the time the learner asks for its second batch (the clock
starts at the first request, and a training step takes far longer), and the first step, asked for inside
the budget, is served however long its batch takes (the learner's re-sent request for it is not checked
again), so the run trains exactly one step whatever the machine's speed; it must still write its final checkpoint, the exported model,
the final evaluation and the summary, like a run that reached ``learner.total_steps``.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from asyncrl.machine import FLAGS_ENV

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]


def test_a_spent_time_budget_ends_the_run_with_checkpoint_export_and_final_eval(procs, tmp_path):
    # on a CPU without an int8 dot product or bf16 matmul (flags faked): every role says what it picked
    proc = procs.python("-m", "asyncrl", "train", f"runs_dir={tmp_path}", "run_name=budget",
                        "learner.total_steps=50", "learner.time_budget_s=0.000001", "learner.eval_every=0",
                        "rollout.groups_per_step=2", "rollout.num_workers=1", "learner.autocast=auto",
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={FLAGS_ENV: "avx2 fma"})
    pids_file, launched = tmp_path / "budget" / "pids.json", {}
    deadline = time.monotonic() + 600
    while "learner" not in launched and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
        try:
            launched = json.loads(pids_file.read_text())
        except (OSError, ValueError):  # not written yet, or being written
            pass
    assert "learner" in launched, "the launcher never started a learner"
    # The supervisor of a run never loads torch (the checks that need it run in a child that ends),
    # and at world size 1 the learner is the one rank itself, with no torchrun agent above it.
    maps = Path(f"/proc/{proc.pid}/maps").read_text()
    assert "libtorch" not in maps, "the asyncrl train process loaded torch"
    learner = psutil.Process(launched["learner"])
    assert "torch.distributed.run" not in learner.cmdline()
    assert learner.cmdline()[2:4] == ["-m", "workers.learner"]
    # Nor does the controller: it tokenizes, scores and computes advantages without torch
    # (``load_tokenizer``, ``asyncrl.algo.outcome``); watched until it exits.
    controller_maps = Path(f"/proc/{launched['controller']}/maps")
    seen_maps = False
    while proc.poll() is None and time.monotonic() < deadline + 300:
        try:
            text = controller_maps.read_text()
        except OSError:  # the controller has exited
            break
        seen_maps = True
        assert "libtorch" not in text, "the controller process loaded torch"
        time.sleep(0.5)
    assert seen_maps
    out, _ = proc.communicate(timeout=800)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    run_dir = tmp_path / "budget"
    final = json.loads((run_dir / "learner_final.json").read_text())
    assert final["version"] == 1 and 0.0 <= final["eval/accuracy"] <= 1.0
    assert json.loads((run_dir / "summary.json").read_text())["learner_steps"] == 1
    assert (run_dir / "model" / "config.json").is_file()
    assert (run_dir / "checkpoints" / "controller-00000001.json").is_file()
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert "learner.time_budget_s=1e-06 spent before step 1" in learner_log
    assert "learner: forwards in fp32 (learner.autocast=auto: this CPU has none of avx512_bf16" in learner_log
    assert f"flags avx2 [{FLAGS_ENV}] (no int8 dot product, no bf16 matmul)" in learner_log
    from asyncrl.quant.cpu_int8 import kernel_status

    kernel = ("int_mm_avx2: exact int8 sums from an AVX2 kernel" if kernel_status() == ""
              else "int_mm_fp32: exact int8 sums from fp32 GEMMs")
    assert f"precision: int8 on {kernel}" in (run_dir / "logs" / "worker-0.log").read_text()
