"""The ``configs/model/`` presets of published checkpoints (Qwen3-0.6B ... 8B, Llama-3.2-1B): they compose
with GPU defaults, need ``model.path`` (never a download), refuse a missing folder naming the fix, and the
architectures ``asyncrl.models.families.preset_config`` builds for benchmarks have the published sizes."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config.loader import load_train_config
from asyncrl.models.families import PRESETS, preset_config
from asyncrl.models.prepare import prepare_model

YAML = {"qwen3-0.6b": "qwen3_0_6b", "qwen3-1.7b": "qwen3_1_7b", "qwen3-4b": "qwen3_4b", "qwen3-8b": "qwen3_8b",
        "llama-3.2-1b": "llama3_2_1b"}
PUBLISHED_PARAMS = {"qwen3-0.6b": 0.596e9, "qwen3-1.7b": 1.72e9, "qwen3-4b": 4.02e9, "qwen3-8b": 8.19e9,
                    "llama-3.2-1b": 1.24e9}
"""Total parameters as reported for each checkpoint (model cards / safetensors metadata)."""


@pytest.mark.parametrize("preset", sorted(YAML.values()))
def test_preset_composes_with_gpu_defaults_and_needs_a_path(preset, tmp_path):
    with pytest.raises(ValueError, match=r"model.name=path needs model.path=DIR"):
        load_train_config([f"model={preset}"])
    cfg = load_train_config([f"model={preset}", f"model.path={tmp_path / 'absent'}"])
    assert (cfg.model.name, cfg.learner.device, cfg.learner.autocast, cfg.rollout.device) == ("path", "cuda", "bf16",
                                                                                              "cuda")
    assert cfg.task.prompt_format == "chat" and cfg.learner.max_tokens_per_micro_batch > 0
    with pytest.raises(ValueError, match="does not exist; download or copy the checkpoint there first"):
        prepare_model(cfg)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_architectures_have_the_published_sizes(name):
    from transformers import AutoModelForCausalLM

    assert set(YAML) == set(PRESETS)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config(name))
    total = sum(p.numel() for p in model.parameters())
    assert abs(total / PUBLISHED_PARAMS[name] - 1) < 0.01, total


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="qwen3-0.6b"):
        preset_config("qwen3-0.5b")
