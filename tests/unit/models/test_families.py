"""Every tiny model family (Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE, Mixtral) through the native engine, the
HF fallback runner, the learner and publication: random-weight models built with ``from_config``.

References are plain fp32 HF forwards of the whole sequence (``hf_logps``); quantized actors are compared
with the HF forward of ``asyncrl.quant.quantize_model`` of the same model, at the tolerances of
``tests/unit/engine/conftest.py`` (formats that round activations: 1e-2; the others: 1e-4).
"""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch

from asyncrl.engine import GenRequest, SamplingParams
from asyncrl.engine.native.decoder import DecoderRunner
from asyncrl.engine.native.engine import NativeEngine
from asyncrl.engine.native.hf_runner import HFRunner, make_runner
from asyncrl.models.families import FAMILIES, build_family_model, tiny_family_config

MOE = ("qwen3_moe", "mixtral")
TEXTS = ["1+2=", "What is 17+25? ", "9*9=", "3-8", "answer: ", "100/4=", "x"]
LOGP_ATOL = {"bf16": 1e-2, "int8": 1e-2, "fp8": 1e-2}


def ids(text: str) -> list[int]:
    return [1] + [4 + b for b in text.encode()]


def requests(n: int = 7, tokens: int = 10) -> list[GenRequest]:
    """``n`` requests of different prompt and response lengths (rows join and leave a 3-row batch)."""
    return [GenRequest(f"r{i}", ids(TEXTS[i % len(TEXTS)]),
                       SamplingParams(max_new_tokens=tokens + 2 * i, stop_token_ids=(), seed=i))
            for i in range(n)]


@torch.no_grad()
def hf_logps(model, res) -> np.ndarray:
    """Unpadded HF forward of prompt + response: the log-prob of each response token, ``[T]``."""
    full = torch.tensor([res.prompt_ids + res.response_ids])
    logits = model(full).logits[0, len(res.prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(res.response_ids)[:, None])[:, 0].numpy()


def max_error(results, model) -> float:
    results = list(results)
    assert len(results) == 7 and all(len(r.response_ids) > 0 for r in results)
    return max(float(np.abs(hf_logps(model, r) - r.behav_logp).max()) for r in results)


def assert_the_fallback_runs_it_exactly(model) -> None:
    """A native engine over a copy of ``model`` picks the HF fallback runner and its log-probs equal the HF
    forward of ``model`` (1e-5)."""
    engine = NativeEngine(copy.deepcopy(model), max_batch_size=3)
    try:
        assert isinstance(engine._runner, HFRunner)
        assert max_error(engine.generate(requests()), model) <= 1e-5
    finally:
        engine.close()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param, build_family_model(request.param, seed=3)


def test_engine_logps_equal_an_fp32_hf_forward(family):
    name, model = family
    engine = NativeEngine(copy.deepcopy(model), max_batch_size=3)
    try:
        if name in MOE:
            assert isinstance(engine._runner, HFRunner)
        assert max_error(engine.generate(requests()), model) <= 1e-5
    finally:
        engine.close()


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int8_wo", "fp8", "nvfp4", "mxfp4"])
def test_quantized_engine_logps_match_the_quantized_hf_forward(family, fmt):
    from asyncrl.quant import quantize_model

    name, model = family
    ref = quantize_model(copy.deepcopy(model), fmt).eval()
    engine = NativeEngine(copy.deepcopy(model), quant_format=fmt, max_batch_size=3)
    try:
        assert max_error(engine.generate(requests()), ref) <= LOGP_ATOL.get(fmt, 1e-4)
    finally:
        engine.close()


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_fallback_runner_is_exact_on_natively_supported_families_too(name):
    """The fallback forced onto families the native decoder also runs: it is the HF forward, so it agrees."""
    model = build_family_model(name, seed=5)
    engine = NativeEngine(copy.deepcopy(model), max_batch_size=3, decode_step="eager")
    engine._runner = HFRunner(engine._model, 3, engine.max_seq_len)
    try:
        assert max_error(engine.generate(requests()), model) <= 1e-5
    finally:
        engine.close()


def test_fallback_runner_applies_a_sliding_window_beyond_the_window():
    """Mistral with a 6-token window: every response runs past it; the HF forward masks the same keys."""
    from transformers import AutoModelForCausalLM

    from asyncrl.models.families import init_weights

    config = tiny_family_config("mistral")
    config.sliding_window = 6
    model = init_weights(AutoModelForCausalLM.from_config(config, dtype=torch.float32), 7).eval()
    runner = make_runner(copy.deepcopy(model), 3, 64)
    assert isinstance(runner, HFRunner), "the native decoder has no sliding window; the fallback must run it"
    assert_the_fallback_runs_it_exactly(model)


def test_native_families_stay_native_and_the_fallback_is_announced_once(caplog):
    from asyncrl.engine.native import hf_runner

    assert isinstance(make_runner(build_family_model("llama"), 2, 32), DecoderRunner)
    hf_runner._ANNOUNCED.discard("mixtral")
    with caplog.at_level(logging.WARNING, logger="asyncrl.engine"):
        for _ in range(2):
            assert isinstance(make_runner(build_family_model("mixtral"), 2, 32), HFRunner)
    said = [r.getMessage() for r in caplog.records if "HF fallback path" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("model_type mixtral runs on the HF fallback path")


def test_fallback_cache_grows_and_moves_rows_like_the_native_one(family):
    """Prefill three rows, drop the middle one (the last moves into its hole), decode on: the moved row's
    logits equal those of a runner that never moved it."""
    name, model = family
    a, b = HFRunner(copy.deepcopy(model), 3, 64), HFRunner(copy.deepcopy(model), 3, 64)
    prompts = [ids("12+7="), ids("a"), ids("What is 3*4? ")]
    a.prefill(0, prompts, 3)
    b.prefill(0, [prompts[0], prompts[2]], 2)
    a.cache.move_row(2, 1, len(prompts[2]))
    lens = [len(prompts[0]), len(prompts[2])]
    for t in range(20):  # past the first capacity (16): the buffers grow with contents kept
        got = a.decode([5 + t, 9 + t], lens)
        want = b.decode([5 + t, 9 + t], lens)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        lens = [n + 1 for n in lens]
    assert a.cache.cap_len >= max(lens)


OTHER_ARCHITECTURES = {
    "phi3": {},
    "gemma3_text": {"head_dim": 16, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]},
    "gpt_neox": {"rotary_pct": 1.0},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32},
}


@pytest.mark.parametrize("model_type", sorted(OTHER_ARCHITECTURES))
def test_fallback_is_exact_on_architectures_the_native_decoder_lacks(model_type):
    """Fused qkv (Phi-3, GPT-NeoX), a shared expert (Qwen2-MoE), sliding and full layers mixed (Gemma 3, whose
    masks go to the model by layer type): all through the model's own forward."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncrl.models.families import _TINY_COMMON, init_weights

    common = {k: v for k, v in _TINY_COMMON.items() if k != "rope_parameters"}
    config = AutoConfig.for_model(model_type, **common, **OTHER_ARCHITECTURES[model_type])
    model = init_weights(AutoModelForCausalLM.from_config(config, dtype=torch.float32), 0).eval()
    assert_the_fallback_runs_it_exactly(model)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_engine_on_a_gpu_matches_the_hf_forward(name):
    """The fallback's masks, cache and per-row positions on CUDA (fp32 here; TF32 off for exactness)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build_family_model(name, seed=3)
    engine = NativeEngine(copy.deepcopy(model), max_batch_size=3, device="cuda")
    try:
        results = list(engine.generate(requests()))
    finally:
        engine.close()
    assert max_error(results, model) <= 1e-4


def test_fallback_gives_eager_attention_an_additive_mask():
    """A model loaded with ``attn_implementation="eager"`` adds the mask to its scores: the runner hands it
    0 / dtype-min instead of booleans, and the log-probs stay exact."""
    model = build_family_model("qwen3_moe", seed=9)
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    engine = NativeEngine(eager, max_batch_size=3)
    try:
        assert isinstance(engine._runner, HFRunner) and engine._runner.config._attn_implementation == "eager"
        assert max_error(engine.generate(requests()), model) <= 1e-5
    finally:
        engine.close()


@pytest.mark.parametrize("fmt", ["int8", "nvfp4"])
@pytest.mark.parametrize("model_type", ["phi3", "gpt_neox", "qwen2_moe"])
def test_quantized_formats_convert_every_linear_of_the_decoder_blocks(model_type, fmt):
    """Fused and differently named projections are quantized too (only fused 3-D expert tensors, which
    are not linears, stay full precision); the engine samples from exactly the quantized model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncrl.learner.fsdp import decoder_layers
    from asyncrl.models.families import _TINY_COMMON, init_weights
    from asyncrl.quant import quantize_model

    common = {k: v for k, v in _TINY_COMMON.items() if k != "rope_parameters"}
    config = AutoConfig.for_model(model_type, **common, **OTHER_ARCHITECTURES[model_type])
    model = init_weights(AutoModelForCausalLM.from_config(config, dtype=torch.float32), 0).eval()
    ref = quantize_model(copy.deepcopy(model), fmt).eval()
    left = [n for layer in decoder_layers(ref) for n, m in layer.named_modules() if type(m) is torch.nn.Linear]
    assert left == []
    engine = NativeEngine(copy.deepcopy(model), quant_format=fmt, max_batch_size=3)
    try:
        assert max_error(engine.generate(requests()), ref) <= LOGP_ATOL.get(fmt, 1e-4)
    finally:
        engine.close()
