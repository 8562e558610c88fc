"""FSDP2 learner over gloo with real processes: world size 2 trains like world size 1.

The same file is the worker program: ``python test_fsdp_learner.py OUT [--resume CKPT]`` runs a
few training steps (ACR objective) of a tiny seeded Qwen2 on fixed batches, with torchrun-style env vars set by
the test (or none, for the one-process group), and writes ``OUT/result.json`` (loss curve,
hashes) and ``OUT/final.pt`` (the full state dict, rank 0).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.integration.fsdp_ranks import launch_ranks, wait_ranks

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_inherited_torchrun_env")]

STEPS = 5
SAVE_AT = 2  # version after which the run saves a DCP checkpoint
BATCH = 8
SHORT_STEP = 4  # this step gets 3 sequences in 2 minibatches: rank 1 runs a filler micro-batch


# ----------------------------------------------------------------------------- worker


def _batch(step: int):
    import numpy as np

    from asyncrl.learner import LearnerBatch

    rng = np.random.default_rng(1000 + step)
    prompts, responses, lps, vers, advs = [], [], [], [], []
    for i in range(3 if step == SHORT_STEP else BATCH):
        P, R = int(rng.integers(1, 5)), int(rng.integers(1, 8))
        prompts.append(rng.integers(1, 37, P).tolist())
        responses.append(rng.integers(1, 37, R).tolist())
        lps.append((-rng.random(R) * 3 - 0.1).astype(np.float32))
        vers.append(np.full(R, max(step - i % 2, 0), dtype=np.int32))
        advs.append(float(rng.normal()))
    return LearnerBatch.from_samples(prompts, responses, lps, vers, advs, temperature=0.9)


def worker_main(out: Path, resume: Path | None, max_grad_norm: float, lean: bool = False) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl.algo import ObjectiveConfig
    from asyncrl.learner import (
        LRSchedule,
        StepConfig,
        TrainState,
        broadcast_batch,
        build_optimizer,
        build_scheduler,
        close_distributed,
        full_state_dict,
        init_distributed,
        load_checkpoint,
        save_checkpoint,
        shard_model,
        state_dict_sha256,
        train_step,
    )

    torch.set_num_threads(1)
    info = init_distributed()
    # A resumed run must not depend on its init, except for a LoRA policy's frozen base, which a real
    # run reloads from the model folder (the checkpoint holds the adapters only): same seed here.
    torch.manual_seed(0 if resume is None or lean else 123)
    cfg = Qwen2Config(
        vocab_size=37,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    if lean:  # LoRA + activation checkpointing + token budget; FSDP2 only at world size > 1
        from asyncrl.learner.policy import LoraSpec, prepare_policy

        lora = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
        model = prepare_policy(Qwen2ForCausalLM(cfg), info, lora=lora, activation_checkpointing=True)
    else:
        model = shard_model(Qwen2ForCausalLM(cfg), info)
    opt = build_optimizer(model, lr=2e-2, weight_decay=0.01)
    sched = build_scheduler(
        opt, LRSchedule(kind="cosine", warmup_steps=1, total_steps=STEPS, min_lr_ratio=0.1)
    )
    state = TrainState(model=model, optimizer=opt, scheduler=sched)
    result: dict = {"world_size": info.world_size, "losses": [], "grad_norms": [], "tokens": []}
    if resume is not None:
        result["extra"] = load_checkpoint(resume, state, info)
        result["loaded_version"] = state.version
        result["loaded_sha"] = state_dict_sha256(model, info)
    while state.version < STEPS:
        micro = 1 if state.version == SHORT_STEP else 2
        step_cfg = StepConfig(n_minibatches=2, micro_batch_size=micro, grad_clip=max_grad_norm,
                              max_tokens_per_micro_batch=12 if lean else 0)
        batch = broadcast_batch(_batch(state.version) if info.is_main else None, info)
        m = train_step(state, batch, ObjectiveConfig(objective="acr"), step_cfg, info)
        result["losses"].append(m["learner/loss"])
        result["grad_norms"].append(m["learner/grad_norm"])
        result["tokens"].append(m["actor/tokens"])
        if state.version == SAVE_AT and resume is None:
            save_checkpoint(out / "ckpt", state, info, extra={"cursor": SAVE_AT})
            result["saved_sha"] = state_dict_sha256(model, info)
    result["final_sha"] = state_dict_sha256(model, info)
    result["final_version"] = state.version
    sd = full_state_dict(model)
    if info.is_main:
        torch.save(sd, out / "final.pt")
        (out / "result.json").write_text(json.dumps(result))
    close_distributed()


# ----------------------------------------------------------------------------- test side


def _max_weight_diff(a: Path, b: Path) -> float:
    import torch

    sa, sb = torch.load(a / "final.pt"), torch.load(b / "final.pt")
    assert sa.keys() == sb.keys()
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


@pytest.mark.timeout(900)  # four launches of real process groups (about 25 s on an idle 2-core machine)
def test_world_size_two_matches_world_size_one_bit_for_bit_and_its_checkpoint_resumes(procs, tmp_path):
    # Gradient clipping is active (norms ~0.2-0.5 > 0.05). Each micro-batch has the same rows and
    # shape on one rank and on two, gradients are the sum of the same two partials (or one
    # partial plus the zero of a filler micro-batch in SHORT_STEP), and the global norm is summed
    # in float64, so the two runs are expected to be bit-identical.
    clip = ("--max-grad-norm", "0.05")
    one = launch_ranks(procs, __file__, tmp_path / "ws1", 1, *clip)
    two = launch_ranks(procs, __file__, tmp_path / "ws2", 2, *clip)
    r1, r2 = wait_ranks(one, tmp_path / "ws1", 240), wait_ranks(two, tmp_path / "ws2", 240)
    assert r1["world_size"] == 1 and r2["world_size"] == 2
    assert len(r1["losses"]) == STEPS and r2["final_version"] == STEPS
    assert min(r1["grad_norms"]) > 0.05, "clipping must be active for this test to mean anything"
    assert r2["losses"] == pytest.approx(r1["losses"], rel=1e-6, abs=1e-8)
    assert r2["losses"] == r1["losses"]
    assert r2["tokens"] == r1["tokens"]  # objective metrics merged over both ranks
    assert r2["final_sha"] == r1["final_sha"], (
        f"weights differ by up to {_max_weight_diff(tmp_path / 'ws1', tmp_path / 'ws2'):.3g}"
    )

    # The DCP checkpoint written by two ranks loads back at two ranks and at one (resharded):
    # same weights as when saved, next version, extra state; finishing gives the same final weights.
    ckpt = str(tmp_path / "ws2" / "ckpt")
    runs = {
        "resume2": launch_ranks(procs, __file__, tmp_path / "resume2", 2, *clip, "--resume", ckpt),
        "resume1": launch_ranks(procs, __file__, tmp_path / "resume1", 1, *clip, "--resume", ckpt),
    }
    for name, children in runs.items():
        r = wait_ranks(children, tmp_path / name, 240)
        assert r["loaded_version"] == SAVE_AT and r["extra"] == {"cursor": SAVE_AT}
        assert r["loaded_sha"] == r2["saved_sha"]
        assert r["losses"] == r2["losses"][SAVE_AT:]
        assert r["final_version"] == STEPS and r["final_sha"] == r2["final_sha"]


@pytest.mark.timeout(1500)  # three launches of real process groups on a shared 2-core machine
def test_lora_with_activation_checkpointing_trains_alike_at_world_size_two_and_one(procs, tmp_path):
    """PEFT LoRA + per-layer checkpointing + a token budget: plain modules at world size 1, FSDP2 at 2."""
    one = launch_ranks(procs, __file__, tmp_path / "ws1", 1, "--lean")
    two = launch_ranks(procs, __file__, tmp_path / "ws2", 2, "--lean")
    r1, r2 = wait_ranks(one, tmp_path / "ws1", 600), wait_ranks(two, tmp_path / "ws2", 600)
    assert r1["world_size"] == 1 and r2["world_size"] == 2 and r2["final_version"] == STEPS
    assert r2["losses"] == pytest.approx(r1["losses"], rel=1e-5, abs=1e-7)
    assert r2["tokens"] == r1["tokens"]
    assert _max_weight_diff(tmp_path / "ws1", tmp_path / "ws2") < 1e-5
    ckpt = str(tmp_path / "ws2" / "ckpt")  # an adapter checkpoint of two ranks resumes at one
    resumed = launch_ranks(procs, __file__, tmp_path / "resume1", 1, "--lean", "--resume", ckpt)
    r = wait_ranks(resumed, tmp_path / "resume1", 600)
    assert r["loaded_version"] == SAVE_AT and r["final_version"] == STEPS
    assert r["losses"] == pytest.approx(r2["losses"][SAVE_AT:], rel=1e-5, abs=1e-7)


if __name__ == "__main__":
    import argparse

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--resume", type=Path, default=None)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--lean", action="store_true")
    a = ap.parse_args()
    worker_main(a.out, a.resume, a.max_grad_norm, a.lean)
