"""``asyncrl train model.name=path model.path=DIR`` on tiny random-weight Qwen3 and Qwen3-MoE folders (real
controller, learner and two int8 workers; 3 steps), and the launch-time refusal of an encoder folder.

The folders are written with ``save_pretrained`` plus the embedded byte tokenizer carrying a ChatML chat
template (``asyncrl.models.families.make_family_model``), so the run's chat prompts must come from that
template. The MoE has no native decoder: its workers announce the HF fallback path and still sample.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.log import SampleRecord, read_log
from asyncrl.models.families import make_family_model
from tests.integration.runs import asyncrl

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

RUN = ["learner.total_steps=3", "learner.ckpt_every=0", "learner.eval_every=0"]


def _train(procs, tmp_path: Path, family: str, *extra: str) -> tuple[Path, str]:
    folder = make_family_model(tmp_path / family, family, seed=0)
    res = asyncrl(procs, "train", "model.name=path", f"model.path={folder}", f"runs_dir={tmp_path / 'runs'}",
                  f"run_name={family}", *RUN, *extra)
    assert res.returncode == 0, res.stdout[-4000:]
    return tmp_path / "runs" / family, res.stdout


def _check_run(run: Path, model_type: str) -> None:
    assert json.loads((run / "summary.json").read_text())["learner_steps"] == 3
    assert json.loads((run / "model" / "config.json").read_text())["model_type"] == model_type
    samples = [r for r in read_log(run / "trajectories").records if isinstance(r, SampleRecord)]
    assert samples and all(len(r.sample.response_ids.to_numpy()) > 0 for r in samples)
    for r in samples:  # the tokenizer's own chat template: the ChatML user turn, then the assistant's
        text = bytes(t - 4 for t in r.sample.prompt_ids.to_numpy().tolist())
        assert text.startswith(b"<|im_start|>user\n") and text.endswith(b"<|im_end|>\n<|im_start|>assistant\n")


def test_qwen3_folder_trains_with_no_model_override(procs, tmp_path):
    run, out = _train(procs, tmp_path, "qwen3")
    assert "prompts in chat format" in out
    _check_run(run, "qwen3")


def test_qwen3_moe_folder_trains_with_lora_on_the_hf_fallback_path(procs, tmp_path):
    run, _ = _train(procs, tmp_path, "qwen3_moe", "learner.lora.rank=4")
    _check_run(run, "qwen3_moe")
    for worker in ("worker-0.log", "worker-1.log"):
        assert "model_type qwen3_moe runs on the HF fallback path" in (run / "logs" / worker).read_text()
    assert "adapting ['q_proj', 'k_proj', 'v_proj', 'o_proj']" in (run / "logs" / "learner.log").read_text()


def test_encoder_folder_is_refused_at_launch_naming_what_is_supported(procs, tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    folder = tmp_path / "bert"
    BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=32)).save_pretrained(folder)
    res = asyncrl(procs, "train", "model.name=path", f"model.path={folder}", f"runs_dir={tmp_path / 'runs'}", *RUN)
    assert res.returncode != 0
    assert "'bert' encoder" in res.stdout and "decoder-only causal language models" in res.stdout
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
