"""Fixtures for the engine tests: the tiny model, its HF reference forward, and the engine factories.

``ENGINE_FACTORIES`` is the list the contract suite is parametrised over. An engine joins the suite by
adding a factory ``(hf_model, model_dir, **kwargs) -> RolloutEngine``; ``kwargs`` may hold
``max_batch_size``, ``version``, ``eos_token_ids`` and ``quant_format``. A factory that cannot run here
calls ``pytest.skip``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from asyncrl.engine.native import NativeEngine
from asyncrl.models import ensure_tiny_model


def _native(hf_model, model_dir, **kwargs):
    return NativeEngine(copy.deepcopy(hf_model), **kwargs)


ENGINE_FACTORIES: dict[str, Callable] = {"native": _native}


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


@pytest.fixture(params=sorted(ENGINE_FACTORIES))
def make_engine(request, tiny_hf, tiny_dir):
    """``make_engine(**kwargs)`` builds a fresh engine on the tiny model; closed at teardown."""
    engines = []

    def build(**kwargs):
        engine = ENGINE_FACTORIES[request.param](tiny_hf, tiny_dir, **kwargs)
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.close()


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
