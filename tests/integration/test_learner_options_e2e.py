"""``asyncrl train`` with the learner's options, end to end (marker ``slow``): real controller,
workers and learner processes, then ``asyncrl replay`` of the trajectory log.

* ``algo.kl_coef > 0`` trains (a frozen reference policy, k3 term logged every step).
* LoRA (``learner.lora.rank``) with activation checkpointing and a token budget trains adapters
  only, publishes merged weights to int8 workers, exports a plain merged HF folder, and replays
  bit-exactly.
* ``learner.rollout_aligned`` (weight-only nvfp4, quantized head): the mismatch decomposition logged,
  plotted and shown, replayed bit-exactly.
* the same at world size 2 (FSDP2 over gloo).
* LoRA over a packed nvfp4 base (``learner.base_format``) with a rollout-aligned learner: resumed from
  a checkpoint, replayed bit-exactly.
* SmolLM2-135M-Instruct with LoRA and a rollout-aligned learner: a few steps with non-zero rewards,
  replayed bit-exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.runs import asyncrl

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1800)]

SHORT = ["learner.total_steps=3", "learner.ckpt_every=0", "learner.eval_every=0", "rollout.eta=1",
         "rollout.groups_per_step=4", "rollout.dead_after_s=60"]


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "learner/loss" in r]


def _sha(run_dir: Path) -> str:
    return json.loads((run_dir / "summary.json").read_text())["state_dict_sha256"]


def test_kl_to_a_frozen_reference_trains_end_to_end(tmp_path, procs):
    # one update per step, so the first step's KL is measured entirely at theta_0 (the algo group files
    # take two updates per step; the second would already see a moved policy)
    res = asyncrl(procs, "train", f"runs_dir={tmp_path}", "run_name=kl", *SHORT, "algo.kl_coef=0.001",
                  "learner.n_minibatches=1")
    assert res.returncode == 0, res.stdout[-4000:]
    steps = _metrics(tmp_path / "kl")
    assert [int(r["step"]) for r in steps] == [1, 2, 3]
    for r in steps:  # logged every step: the KL term, entropy, loss, gradient norm, learning rate
        for key in ("actor/kl_ref", "actor/kl_loss", "actor/entropy", "learner/loss", "learner/grad_norm",
                    "learner/lr"):
            assert key in r, key
    assert steps[0]["actor/kl_ref"] == pytest.approx(0.0, abs=1e-9)  # theta_0 is the reference
    assert steps[-1]["actor/kl_ref"] > 0


def test_lora_run_publishes_merged_weights_exports_a_plain_model_and_replays_bit_exactly(tmp_path, procs):
    lora = ["learner.lora.rank=4", "learner.lora.alpha=8", "learner.lr=5e-3", "learner.activation_checkpointing=true",
            "learner.max_tokens_per_micro_batch=200", "quant=int8"]
    res = asyncrl(procs, "train", f"runs_dir={tmp_path}", "run_name=lora", *SHORT, *lora)
    assert res.returncode == 0, res.stdout[-4000:]
    run = tmp_path / "lora"
    steps = _metrics(run)
    assert len(steps) == 3 and all("actor/entropy" in r for r in steps)
    assert any(r["learner/updates"] > 0 for r in steps)

    from safetensors.torch import load_file

    exported = load_file(str(run / "model" / "model.safetensors"))
    assert exported and not any("lora_" in k or "base_layer" in k for k in exported)
    assert json.loads((run / "model" / "config.json").read_text())["architectures"][0].endswith("ForCausalLM")

    res = asyncrl(procs, "replay", f"run={run}", "run_name=lora-replay")
    assert res.returncode == 0, res.stdout[-4000:]
    assert _sha(tmp_path / "lora-replay") == _sha(run)


def test_rollout_aligned_run_measures_its_mismatch_and_replays_bit_exactly(tmp_path, procs):
    """learner.rollout_aligned with weight-only 4-bit workers and a quantized head: the learner says what it
    aligns to, every step logs the gap taken apart, the lag-0 gap is far below the quantization gap it would
    have without alignment, the plots and `log show` carry it, and the replay gives the same weights."""
    res = asyncrl(procs, "train", f"runs_dir={tmp_path}", "run_name=qarl", *SHORT, "quant=nvfp4",
                  "quant.lm_head=true", "learner.rollout_aligned=true", "learner.mismatch_rows=8",
                  "learner.mismatch_every=1")
    assert res.returncode == 0, res.stdout[-4000:]
    run = tmp_path / "qarl"
    assert "forwards through the nvfp4 quantizer" in (run / "logs" / "learner.log").read_text()
    steps = _metrics(run)
    assert len(steps) == 3 and all({"mismatch/noise", "mismatch/quant"} <= set(r) for r in steps)
    first = steps[0]  # step 0: every token was sampled by version 0
    assert first["mismatch/lag0"] < first["mismatch/quant"] / 10, first
    assert (run / "plots" / "mismatch.png").is_file()
    shown = asyncrl(procs, "log", "show", str(run), "--step", "0", "--last", "1")
    assert shown.returncode == 0 and "log-prob gap at step 0" in shown.stdout, shown.stdout[-2000:]
    res = asyncrl(procs, "replay", f"run={run}", "run_name=qarl-replay")
    assert res.returncode == 0, res.stdout[-4000:]
    assert _sha(tmp_path / "qarl-replay") == _sha(run)


def test_rollout_aligned_learner_at_world_size_two(tmp_path, procs):
    """FSDP2 over two ranks: each rank's routed linears quantize the unsharded weights, so step 0's lag-0 gap
    is as far below the quantization gap as at world size 1."""
    res = asyncrl(procs, "train", f"runs_dir={tmp_path}", "run_name=qarl2", *SHORT, "quant=nvfp4",
                  "learner.rollout_aligned=true", "learner.world_size=2", "learner.mismatch_rows=8")
    assert res.returncode == 0, res.stdout[-4000:]
    steps = _metrics(tmp_path / "qarl2")
    assert len(steps) == 3 and any(r["learner/updates"] > 0 for r in steps)
    assert steps[0]["mismatch/lag0"] < steps[0]["mismatch/quant"] / 10, steps[0]


def test_lora_over_a_packed_nvfp4_base_resumes_and_replays_bit_exactly(tmp_path, procs):
    """learner.base_format=nvfp4 (QeRL's quantized base) with a rollout-aligned int8 learner: trains the
    adapters, exports a plain model, resumes from a checkpoint to the same weights as the replay of its log."""
    lora = ["learner.lora.rank=4", "learner.lora.alpha=8", "learner.lr=5e-3", "quant=int8",
            "learner.base_format=nvfp4", "learner.rollout_aligned=true"]
    res = asyncrl(procs, "train", f"runs_dir={tmp_path}", "run_name=packed", *SHORT, *lora,
                  "learner.total_steps=2", "learner.ckpt_every=1")
    assert res.returncode == 0, res.stdout[-4000:]
    run = tmp_path / "packed"
    assert "LoRA r=4, nvfp4 base" in (run / "logs" / "learner.log").read_text()
    assert any(r["learner/updates"] > 0 for r in _metrics(run))
    res = asyncrl(procs, "train", f"resume={run}", "learner.total_steps=3")
    assert res.returncode == 0, res.stdout[-4000:]
    res = asyncrl(procs, "replay", f"run={run}", "run_name=packed-replay")
    assert res.returncode == 0, res.stdout[-4000:]
    assert _sha(tmp_path / "packed-replay") == _sha(run)


def _has_chat_prompts() -> bool:
    from asyncrl.config.schema import TaskConfig

    return "prompt_format" in TaskConfig.__dataclass_fields__


@pytest.mark.skipif(not _has_chat_prompts(), reason="needs chat-templated prompts (task.prompt_format)")
def test_smollm2_lora_run_gets_rewards_and_replays_bit_exactly(tmp_path, procs):
    """SmolLM2-135M-Instruct, chat-templated prompts, LoRA on every projection, int8 workers and a
    rollout-aligned learner (W8A8 through the merged weights): a few steps, some responses rewarded, the
    lag-0 log-prob gap below the quantization gap, and the replay of its log gives the same merged weights."""
    data = tmp_path / "easy.jsonl"
    rows = [{"prompt": f"What is {a} + {b}? Reply with the number only.", "answer": str(a + b)}
            for a in range(1, 7) for b in range(1, 7)]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["model=smollm2", "task=jsonl_math", f"task.path={data}", "task.answer_format=last_number",
            "task.prompt_format=chat", "task.eval_size=4", "learner.total_steps=2", "learner.eval_every=0",
            "learner.ckpt_every=0", "rollout.groups_per_step=2", "algo.group_size=4", "rollout.max_new_tokens=16",
            "rollout.num_workers=1", "rollout.eta=1", "learner.lora.rank=8", "learner.lora.alpha=16",
            "learner.lr=1e-4", "learner.activation_checkpointing=true", "learner.max_tokens_per_micro_batch=1024",
            "quant=int8", "learner.rollout_aligned=true"]  # fmt: skip
    res = asyncrl(procs, "train", f"runs_dir={tmp_path}", "run_name=smol", *args, timeout=1500)
    assert res.returncode == 0, res.stdout[-4000:]
    run = tmp_path / "smol"

    from asyncrl.log import SampleRecord, read_log

    rewards = [r.reward for r in read_log(run / "trajectories").records if isinstance(r, SampleRecord)]
    assert rewards and sum(rewards) > 0, f"no reward in {len(rewards)} samples"
    steps = _metrics(run)
    assert len(steps) == 2
    assert steps[0]["mismatch/lag0"] < steps[0]["mismatch/quant"]  # step 0: every token sampled by version 0
    res = asyncrl(procs, "replay", f"run={run}", "run_name=smol-replay", timeout=1500)
    assert res.returncode == 0, res.stdout[-4000:]
    assert _sha(tmp_path / "smol-replay") == _sha(run)
