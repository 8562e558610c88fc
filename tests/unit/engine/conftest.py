"""Fixtures for the engine tests: the tiny model, its HF reference forward, and the engine factories.

The contract suite is parametrised over ``ENGINE_FACTORIES`` x ``CONTRACT_FORMATS``. An engine joins the
suite by adding a factory ``(hf_model, model_dir, **kwargs) -> RolloutEngine``; ``kwargs`` may hold
``quant_format``, ``max_batch_size`` and ``eos_token_ids``. A factory that cannot run here (or not in a
format) calls ``pytest.skip``. For a quantized case the reference forward is plain HF ``forward`` of
``asyncrl.quant.quantize_model(fp32 model, fmt)``, and fp32 state-dict updates are quantized on receipt,
so every contract check also holds for every quantized actor.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from asyncrl.engine.native.engine import NativeEngine
from asyncrl.models import ensure_tiny_model


def _native(hf_model, model_dir, **kwargs):
    return NativeEngine(copy.deepcopy(hf_model), **kwargs)


def _native_eager(hf_model, model_dir, **kwargs):
    """The eager reference decode step (what forward AQN runs on); fp32 only, the static step covers formats."""
    return NativeEngine(copy.deepcopy(hf_model), decode_step="eager", **kwargs)


def _native_overlap(hf_model, model_dir, **kwargs):
    """A step's results read after the next step is launched (the CUDA default), here on the CPU; fp32 only."""
    return NativeEngine(copy.deepcopy(hf_model), overlap=True, **kwargs)


ENGINE_FACTORIES: dict[str, Callable] = {"native": _native, "native-eager": _native_eager,
                                         "native-overlap": _native_overlap}
CONTRACT_FORMATS = ("fp32", "bf16", "int8", "int8_wo", "fp8", "nvfp4", "mxfp4")
ENGINE_FORMATS: dict[str, tuple[str, ...]] = {"native-eager": ("fp32",), "native-overlap": ("fp32",)}
"""Engines that run the contract in fewer formats than ``CONTRACT_FORMATS``."""
# Max |engine behav_logp - reference forward| per format. Formats whose linears compute in fp32 on fixed
# weights (fp32 and the weight-only int8_wo / nvfp4 / mxfp4) agree to float rounding. Formats that round
# activations (bf16 rounds each projection's input and output, int8 and fp8 quantize activations per token)
# are discontinuous: fp32 last-bit differences between the engine's batched decode ([B, 1, D] matmuls over
# the KV cache) and the reference's one-shot forward ([1, L, D]) occasionally flip one rounding, which moves
# a log-prob by up to a few 1e-3 and persists through the KV cache. test_quantized.py checks that such flips
# are rare; here they are bounded.
LOGP_ATOL = {"bf16": 1e-2, "int8": 1e-2, "fp8": 1e-2}
DEFAULT_LOGP_ATOL = 1e-4
_QUANTIZED_REFS: dict[tuple[int, str], torch.nn.Module] = {}


def quantized_reference(model, fmt: str):
    """``model`` as the actor of ``fmt`` would run it (cached per model and format); fp32 is ``model``."""
    if fmt == "fp32":
        return model
    key = (id(model), fmt)
    if key not in _QUANTIZED_REFS:
        quant = pytest.importorskip("asyncrl.quant")
        _QUANTIZED_REFS[key] = quant.quantize_model(copy.deepcopy(model), fmt).eval()
    return _QUANTIZED_REFS[key]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def tiny_hf(tiny_dir):
    """The plain HF model (v0). Tests must not modify it."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_dir)).eval()


@pytest.fixture(scope="session")
def tiny_hf_v1(tiny_hf):
    """A second policy version: v0 with seeded noise on every parameter."""
    gen = torch.Generator().manual_seed(123)
    model = copy.deepcopy(tiny_hf)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


@pytest.fixture(params=[(e, f) for e in sorted(ENGINE_FACTORIES) for f in ENGINE_FORMATS.get(e, CONTRACT_FORMATS)],
                ids="-".join)
def engine_case(request) -> tuple[str, str]:
    """``(engine name, quant format)`` of the contract case."""
    return request.param


@pytest.fixture
def make_engine(engine_case, tiny_hf, tiny_dir):
    """``make_engine(**kwargs)`` builds a fresh engine of the case on the tiny model; closed at teardown."""
    name, fmt = engine_case
    engines = []

    def build(**kwargs):
        engine = ENGINE_FACTORIES[name](tiny_hf, tiny_dir, quant_format=fmt, **kwargs)
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.close()


@pytest.fixture
def logp_atol(engine_case) -> float:
    return LOGP_ATOL.get(engine_case[1], DEFAULT_LOGP_ATOL)


@pytest.fixture
def ref_v0(engine_case, tiny_hf):
    """Reference model for version 0 of the case (the actor's format)."""
    return quantized_reference(tiny_hf, engine_case[1])


@pytest.fixture
def ref_v1(engine_case, tiny_hf_v1):
    """Reference model for version 1 (``tiny_hf_v1`` as the actor's format would run it)."""
    return quantized_reference(tiny_hf_v1, engine_case[1])


def _temp(t: float) -> float:
    return t if t > 0 else 1.0


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """Plain HF forward of prompt+response: ``log_softmax(logits.float()/T)`` at each response token, ``[T]``."""
    ids = torch.tensor([prompt + response])
    logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(response) - 1].float()
    logp = torch.log_softmax(logits / _temp(temperature), dim=-1)
    return logp.gather(1, torch.tensor(response)[:, None])[:, 0]


@torch.no_grad()
def hf_logprobs_swapped(
    model0, model1, prompt: list[int], response: list[int], switch: int, temperature: float
) -> torch.Tensor:
    """HF reference for a swap before response token ``switch`` (``switch >= 1``), KV cache kept.

    Tokens ``< switch`` come from model0 on the full prefix. Token ``switch`` onward comes from model1 reading a
    cache that model0 filled for ``prompt + response[:switch-1]``; model1 itself computes K/V for
    ``response[switch-1:]`` -- exactly what an engine does when it swaps at a step boundary.
    """
    from transformers import DynamicCache

    assert 1 <= switch < len(response)
    head = hf_logprobs(model0, prompt, response[:switch], temperature)
    cache = DynamicCache(config=model0.config)
    model0(torch.tensor([prompt + response[: switch - 1]]), cache=cache, use_cache=True)
    logits = model1(torch.tensor([response[switch - 1 : -1]]), cache=cache, use_cache=True).logits[0].float()
    tail = torch.log_softmax(logits / _temp(temperature), dim=-1)
    tail = tail.gather(1, torch.tensor(response[switch:])[:, None])[:, 0]
    return torch.cat([head, tail])


@pytest.fixture
def reference():
    """Namespace of HF reference forwards (``plain``, ``swapped``)."""

    class _Ref:
        plain = staticmethod(hf_logprobs)
        swapped = staticmethod(hf_logprobs_swapped)

    return _Ref
