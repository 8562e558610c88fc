"""The learner on every tiny model family (Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE, Mixtral): a training step
with and without LoRA, sharded by the model's own decoder blocks, and the publication round trip into a
native engine (the engine's log-probs are those of the HF model holding the trained weights)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from asyncrl.engine import GenRequest, SamplingParams
from asyncrl.engine.native.engine import NativeEngine
from asyncrl.learner import LRSchedule, StepConfig, TrainState, build_optimizer, build_scheduler, train_step
from asyncrl.learner.fsdp import decoder_layers, shard_model
from asyncrl.learner.policy import (
    LoraSpec,
    checkpoint_decoder_layers,
    policy_state_dict,
    prepare_policy,
)
from asyncrl.models.families import FAMILIES, build_family_model

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LAYER_CLASS = {"llama": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer", "qwen3": "Qwen3DecoderLayer",
               "mistral": "MistralDecoderLayer", "qwen3_moe": "Qwen3MoeDecoderLayer",
               "mixtral": "MixtralDecoderLayer"}


def _state(model: torch.nn.Module, lr: float = 5e-2) -> TrainState:
    opt = build_optimizer(model, lr=lr)
    return TrainState(model=model, optimizer=opt, scheduler=build_scheduler(opt, LRSchedule()))


def _step(state: TrainState, tiny, info, seed: int = 0) -> dict:
    return train_step(state, tiny.batch(6, seed=seed, version=state.version), tiny.objective, StepConfig(), info)


@pytest.mark.parametrize("name", FAMILIES)
def test_full_step_moves_every_block_and_keeps_the_hf_names(name, tiny, dist_info):
    model = build_family_model(name, seed=1)
    layers = decoder_layers(model)
    assert [type(m).__name__ for m in layers] == [LAYER_CLASS[name]] * 2
    before = {k: v.clone() for k, v in model.state_dict().items()}
    policy = prepare_policy(model, dist_info, activation_checkpointing=True)
    metrics = _step(_state(policy), tiny, dist_info)
    assert np.isfinite(metrics["learner/loss"])
    sd = policy_state_dict(policy)
    assert set(sd) == set(before)
    moved = {k.split(".")[2] for k in sd if k.startswith("model.layers.") and not torch.equal(sd[k], before[k])}
    assert moved == {"0", "1"}


@pytest.mark.parametrize("name", FAMILIES)
def test_lora_step_adapts_the_models_projections_and_merges_into_hf_names(name, tiny, dist_info):
    model = build_family_model(name, seed=2)
    names = set(model.state_dict())
    policy = prepare_policy(model, dist_info, lora=LoraSpec(rank=4, alpha=8.0, target_modules=DEFAULT_TARGETS))
    adapted = {n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n, _ in policy.named_parameters() if ".lora_A." in n}
    # MoE experts are fused tensors, not linears: their blocks adapt attention only
    want = {"q_proj", "k_proj", "v_proj", "o_proj"} | (set() if name in ("qwen3_moe", "mixtral")
                                                      else {"gate_proj", "up_proj", "down_proj"})
    assert adapted == want
    state = _state(policy)
    for v in range(2):
        assert np.isfinite(_step(state, tiny, dist_info, seed=v)["learner/loss"])
    merged = dict(policy_state_dict(policy, LoraSpec(rank=4, alpha=8.0, target_modules=DEFAULT_TARGETS)))
    assert set(merged) == names
    hf = policy.merge_and_unload()
    for k, v in hf.state_dict().items():
        torch.testing.assert_close(merged[k], v, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_fsdp2_shards_by_the_models_decoder_blocks(name, tiny, dist_info):
    from torch.distributed.fsdp import FSDPModule

    model = shard_model(build_family_model(name, seed=3), dist_info)
    layers = decoder_layers(model)
    assert len(layers) == 2 and all(isinstance(layer, FSDPModule) for layer in layers)
    # fully_shard swaps each block's class for an FSDP subclass; the blocks are still found by class alone
    holder = torch.nn.Module()
    holder._no_split_modules = [LAYER_CLASS[name]]
    holder.blocks = model.model.layers
    assert all(type(layer).__name__.startswith("FSDP") for layer in layers)
    assert decoder_layers(holder) == layers
    assert np.isfinite(_step(_state(model), tiny, dist_info)["learner/loss"])
    assert set(policy_state_dict(model)) == set(build_family_model(name).state_dict())


def _requests() -> list[GenRequest]:
    return [GenRequest(f"r{i}", [1, 17 + i, 40, 52 + i], SamplingParams(max_new_tokens=8, stop_token_ids=(), seed=i))
            for i in range(4)]


@torch.no_grad()
def _errors(results, model) -> float:
    errs = []
    for res in results:
        full = torch.tensor([res.prompt_ids + res.response_ids])
        logits = model(full).logits[0, len(res.prompt_ids) - 1 : -1].float()
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(res.response_ids)[:, None])[:, 0]
        errs.append(float(np.abs(ref.numpy() - res.behav_logp).max()))
    return max(errs)


@pytest.mark.parametrize("fmt", ["fp32", "int8"])
@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_moe", "mixtral"])
def test_published_trained_weights_round_trip_into_the_engine(name, fmt, tiny, dist_info):
    """Tied (qwen3) and untied heads, dense and MoE: train, publish, swap into an engine built at v0."""
    from asyncrl.quant import publish, quantize_model

    initial = build_family_model(name, seed=4)
    policy = prepare_policy(copy.deepcopy(initial), dist_info)
    state = _state(policy, lr=1e-2)
    _step(state, tiny, dist_info)
    published = publish(dict(policy_state_dict(policy)), fmt, version=1)
    engine = NativeEngine(copy.deepcopy(initial), quant_format=fmt, max_batch_size=4)
    try:
        engine.update_weights(1, published)
        results = list(engine.generate(_requests()))
        assert all(r.versions.tolist() == [1] * 8 for r in results)
        trained = copy.deepcopy(initial)
        trained.load_state_dict(dict(policy_state_dict(policy)))
        ref = trained if fmt == "fp32" else quantize_model(trained, fmt).eval()
        assert _errors(results, ref) <= (1e-5 if fmt == "fp32" else 1e-2)
    finally:
        engine.close()


def test_activation_checkpointing_wraps_each_block_of_a_moe(dist_info):
    model = build_family_model("mixtral")
    assert checkpoint_decoder_layers(model) == 2


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "mixtral"])
def test_export_writes_the_checkpoint_names_and_loads_back_to_the_same_model(name, tiny, dist_info, tmp_path):
    """A MoE's fused expert tensors are exported per expert, as ``save_pretrained`` writes them (what SGLang,
    vLLM and older transformers read); the folder loads back to the trained model."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from asyncrl.learner import export_hf

    policy = prepare_policy(build_family_model(name, seed=6), dist_info)
    _step(_state(policy, lr=1e-2), tiny, dist_info)
    out = export_hf(policy, None, tmp_path / "export", dist_info)
    policy.save_pretrained(tmp_path / "reference")
    assert set(load_file(str(out / "model.safetensors"))) == set(load_file(str(tmp_path / "reference" /
                                                                               "model.safetensors")))
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 20, 30, 40, 50]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, policy(ids).logits, rtol=0, atol=1e-6)
