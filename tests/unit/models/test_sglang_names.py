"""Weight updates for SGLang servers travel in the names of the model's checkpoint files (what SGLang loads at
startup and what its ``load_weights`` maps): tiny Qwen3 (tied head, q/k norms), Qwen3-MoE and Mixtral (fused
expert tensors split per expert, untied heads). The reference is the safetensors file ``save_pretrained``
writes for the same model."""

from __future__ import annotations

import base64
import json
import pickle

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.engine.sglang.weights import (
    TensorUpdate,
    checkpoint_named_tensors,
    prepare_update,
    tensor_bodies,
)
from asyncrl.models.families import make_family_model


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe", "mixtral"])
def folder(request, tmp_path_factory):
    return make_family_model(tmp_path_factory.mktemp("sglang-names") / request.param, request.param, seed=2)


def _runtime_state(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()


def test_update_names_and_values_are_the_checkpoint_files(folder):
    config = json.loads((folder / "config.json").read_text())
    state = _runtime_state(folder)
    on_disk = load_file(str(folder / "model.safetensors"))
    named = dict(checkpoint_named_tensors(list(state.items()), config))
    want = {k for k in on_disk if not (config["tie_word_embeddings"] and k == "lm_head.weight")}
    assert set(named) == want
    for k, t in named.items():
        assert torch.equal(t, on_disk[k]), k
    if config["model_type"] == "qwen3":
        assert "lm_head.weight" not in named and "lm_head.weight" in state  # tied: the embedding is the head
        assert "model.layers.1.self_attn.q_norm.weight" in named and "model.layers.1.self_attn.k_norm.weight" in named
    else:
        assert "lm_head.weight" in named
        fused = [k for k in state if k.endswith("experts.gate_up_proj")]
        assert fused and not any("gate_up_proj" in k for k in named)
        per_expert = [k for k in named if ".experts.3." in k]
        assert len(per_expert) == 2 * 3  # two layers x (gate, up, down) of expert 3


def test_prepare_update_renames_when_the_served_folder_is_here(folder):
    state = _runtime_state(folder)
    update = prepare_update(dict(state), folder)
    assert isinstance(update, TensorUpdate)
    assert {n for n, _ in update.named} <= set(load_file(str(folder / "model.safetensors")))
    body = tensor_bodies(update, 3, max_chunk_bytes=1 << 16)[-1]
    assert body["weight_version"] == "3"
    chunk = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))
    assert all(isinstance(n, str) and isinstance(t, torch.Tensor) for n, t in chunk)
    assert {n for n, _ in prepare_update(dict(state)).named} == set(state)  # no folder here: names as given


def test_an_untied_update_without_its_head_is_refused():
    config = {"model_type": "qwen3_moe", "tie_word_embeddings": False}
    with pytest.raises(ValueError, match="must carry lm_head.weight"):
        checkpoint_named_tensors([("model.embed_tokens.weight", torch.zeros(2, 2))], config)
