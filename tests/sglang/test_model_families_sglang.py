"""A REAL SGLang 0.5.23 server (marker ``sglang``) serving tiny Qwen3 (tied head, q/k norms) and Qwen3-MoE
(fused experts in transformers 5, per-expert tensors in the checkpoint) folders: a learner-style update, a
state dict in transformers' runtime names, is pushed through ``SGLangEngine.update_weights`` and the served
log-probs are those of the HF model holding the updated weights.

One server per family, started from the family's folder on the CPU (asyncrl's CPU setup) and ended by PID.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from asyncrl.engine import GenRequest, SamplingParams
from asyncrl.engine.sglang.engine import SGLangEngine
from asyncrl.engine.sglang.server import SGLangServerProcess, cpu_env, free_port, server_command
from asyncrl.models.families import build_family_model, make_family_model

pytestmark = [pytest.mark.sglang, pytest.mark.integration, pytest.mark.timeout(1500)]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_runtime_named_update_is_served_exactly(family, sglang_python_path, tmp_path):
    folder = make_family_model(tmp_path / family, family, seed=0)
    argv = server_command(folder, python=sglang_python_path, port=free_port(), device="cpu", max_total_tokens=4096)
    server = SGLangServerProcess(argv, env=cpu_env(shim_dir=tmp_path / "shim"), log_path=tmp_path / "server.log")
    try:
        server.wait_ready(timeout_s=900)
        engine = SGLangEngine.attach(server.url, request_timeout_s=300, control_timeout_s=300, max_batch_size=4)
        model = build_family_model(family, seed=0)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        engine.update_weights(1, dict(model.state_dict()))  # runtime names: fused experts, tied lm_head
        engine.submit([GenRequest(f"r{i}", [1, 20 + i, 30, 40], SamplingParams(max_new_tokens=8, stop_token_ids=(),
                                                                                 seed=i)) for i in range(3)])
        results = []
        deadline = time.monotonic() + 600
        while len(results) < 3 and time.monotonic() < deadline:
            results += engine.poll(1.0)
        engine.close()
    finally:
        server.stop()
    assert len(results) == 3
    for res in results:
        assert res.versions.tolist() == [1] * 8
        full = torch.tensor([res.prompt_ids + res.response_ids])
        with torch.no_grad():
            logits = model(full).logits[0, len(res.prompt_ids) - 1 : -1].float()
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(res.response_ids)[:, None])[:, 0]
        assert float(np.abs(ref.numpy() - res.behav_logp).max()) <= 1e-4


@pytest.mark.timeout(3000)  # above the run's own guards: the server's start (1500 s) and the run (2700 s)
def test_train_on_a_qwen3_moe_folder_with_an_sglang_worker(procs, sglang_python_path, tmp_path):
    """``asyncrl train model.name=path`` on a Qwen3-MoE folder, one SGLang worker (CPU server it starts):
    every version the learner publishes reaches the server (tokens carry versions 1..3)."""
    import subprocess

    from tests.sglang.runs import check_trajectory_log

    folder = make_family_model(tmp_path / "qwen3_moe", "qwen3_moe", seed=0)
    proc = procs.python("-m", "asyncrl", "train", "model.name=path", f"model.path={folder}",
                        f"runs_dir={tmp_path / 'runs'}", "run_name=moe", "rollout.engine=sglang", "quant.fmt=fp32",
                        "rollout.num_workers=1", "sglang.device=cpu", f"sglang.python={sglang_python_path}",
                        "sglang.startup_timeout_s=1500", "learner.total_steps=3", "learner.eval_every=0",
                        "learner.ckpt_every=0", "rollout.eta=1", "rollout.heartbeat_s=0.05",
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=2700)  # a hang guard above sglang.startup_timeout_s
    assert proc.returncode == 0, out.decode(errors="replace")[-4000:]
    by_id = check_trajectory_log(tmp_path / "runs" / "moe", eta=1, steps=3)
    served = {int(v) for r in by_id.values() for v in r.sample.versions.to_numpy()}
    assert {1, 2} <= served
