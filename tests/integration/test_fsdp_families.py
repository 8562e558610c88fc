"""FSDP2 over gloo with real processes on a tiny Qwen3-MoE: two ranks, sharded by the model's own decoder
blocks (``Qwen3MoeDecoderLayer``, fused expert tensors included) with activation checkpointing, train like
one unsharded rank, and the gathered state dict exports in the checkpoint's per-expert names.

The same file is the worker program: ``python test_fsdp_families.py OUT`` runs three training steps with
torchrun-style env vars set by the test (none for world size 1) and writes ``OUT/result.json`` and
``OUT/final.pt`` (the full state dict, rank 0).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.integration.fsdp_ranks import launch_ranks, wait_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900), pytest.mark.usefixtures("no_inherited_torchrun_env")]

STEPS = 3


def _batch(step: int):
    import numpy as np

    from asyncrl.learner import LearnerBatch

    rng = np.random.default_rng(500 + step)
    prompts, responses, lps, vers, advs = [], [], [], [], []
    for _ in range(8):
        P, R = int(rng.integers(2, 6)), int(rng.integers(2, 8))
        prompts.append(rng.integers(4, 260, P).tolist())
        responses.append(rng.integers(4, 260, R).tolist())
        lps.append((-rng.random(R) * 3 - 0.1).astype(np.float32))
        vers.append(np.full(R, step, dtype=np.int32))
        advs.append(float(rng.normal()))
    return LearnerBatch.from_samples(prompts, responses, lps, vers, advs, temperature=1.0)


def worker_main(out: Path) -> None:
    import torch
    from torch.distributed.fsdp import FSDPModule

    from asyncrl.algo import ObjectiveConfig
    from asyncrl.learner import (
        LRSchedule,
        StepConfig,
        TrainState,
        broadcast_batch,
        build_optimizer,
        build_scheduler,
        close_distributed,
        export_hf,
        full_state_dict,
        init_distributed,
        train_step,
    )
    from asyncrl.learner.fsdp import decoder_layers
    from asyncrl.learner.policy import prepare_policy
    from asyncrl.models.families import build_family_model

    torch.set_num_threads(1)
    info = init_distributed()
    model = prepare_policy(build_family_model("qwen3_moe", seed=8), info, activation_checkpointing=True)
    sharded = [isinstance(layer, FSDPModule) for layer in decoder_layers(model)]
    opt = build_optimizer(model, lr=1e-2)
    state = TrainState(model=model, optimizer=opt, scheduler=build_scheduler(opt, LRSchedule()))
    result: dict = {"world_size": info.world_size, "sharded": sharded, "losses": []}
    while state.version < STEPS:
        batch = broadcast_batch(_batch(state.version) if info.is_main else None, info)
        m = train_step(state, batch, ObjectiveConfig(objective="acr"), StepConfig(micro_batch_size=2), info)
        result["losses"].append(m["learner/loss"])
    sd = full_state_dict(model) if info.world_size > 1 else {k: v.detach() for k, v in model.state_dict().items()}
    export_hf(model, None, out / "export", info)
    if info.is_main:
        torch.save(sd, out / "final.pt")
        (out / "result.json").write_text(json.dumps(result))
    close_distributed()


def _run(procs, out: Path, world_size: int) -> dict:
    return wait_ranks(launch_ranks(procs, __file__, out, world_size), out, timeout_s=600)


def test_moe_trains_alike_sharded_over_two_ranks_and_on_one(procs, tmp_path):
    import torch
    from safetensors.torch import load_file

    r1, r2 = _run(procs, tmp_path / "ws1", 1), _run(procs, tmp_path / "ws2", 2)
    assert r1["sharded"] == [False, False] and r2["sharded"] == [True, True]
    assert r2["losses"] == pytest.approx(r1["losses"], rel=1e-5, abs=1e-7)
    s1, s2 = torch.load(tmp_path / "ws1" / "final.pt"), torch.load(tmp_path / "ws2" / "final.pt")
    assert s1.keys() == s2.keys() and any(k.endswith("experts.gate_up_proj") for k in s1)
    assert max(float((s1[k] - s2[k]).abs().max()) for k in s1) < 1e-5
    exported = load_file(str(tmp_path / "ws2" / "export" / "model.safetensors"))
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in exported
    assert not any("gate_up_proj" in k for k in exported)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    worker_main(Path(sys.argv[1]))
