"""``compile_step`` (``rollout.compile=auto|true|false``): where it resolves, and the fall-back when compiling fails.

``auto`` is Inductor on CUDA and off on a CPU. Nothing here runs CUDA, so the engine-level cases make the CPU
engine take the ``auto``-on-CUDA plan by patching ``resolve_compile`` (the one place the choice is made) to
return it with a backend that fails: the failure itself is real (dynamo calls the backend, which raises, and
``torch.compile`` reports it as it would an Inductor failure), and so is everything after it.
"""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch

from asyncrl.engine import GenRequest, SamplingParams
from asyncrl.engine.native import build
from asyncrl.engine.native.build import CompilePlan, resolve_compile
from asyncrl.engine.native.engine import NativeEngine

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU


def test_compile_resolves_in_one_place():
    assert resolve_compile("auto", CUDA) == CompilePlan("inductor", True)
    assert resolve_compile("AUTO", CPU) == resolve_compile("auto", torch.device("cpu")) == CompilePlan(None, False)
    assert resolve_compile("true", CPU) == resolve_compile(True, CUDA) == CompilePlan("inductor", False)
    assert resolve_compile("false", CUDA) == resolve_compile(False, CPU) == CompilePlan(None, False)
    assert resolve_compile("eager", CPU) == CompilePlan("eager", False)  # a backend by name: no fall-back
    with pytest.raises(ValueError, match="rollout.compile=auto, true or false"):
        resolve_compile("fastest", CPU)
    with pytest.raises(ValueError, match="compile_step must be"):
        resolve_compile(3, CPU)  # type: ignore[arg-type]


def test_the_engine_default_is_auto_and_reports_it(tiny_hf):
    engine = NativeEngine(copy.deepcopy(tiny_hf), max_batch_size=2)  # compile_step="auto" on a CPU: off
    caps, stats = engine.capabilities(), engine.step_stats()
    assert caps["compile_step"] is None and caps["compile_failure"] is None
    assert stats["compiled"] is None and not stats["bucketed"] and not stats["prewarm"]
    engine.close()
    with pytest.raises(ValueError, match="rollout.compile"):
        NativeEngine(copy.deepcopy(tiny_hf), compile_step="sometimes")


def _one_layer(tiny_hf):
    model = copy.deepcopy(tiny_hf)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    return model


def _broken(gm, example_inputs):
    raise RuntimeError("no compiler for this device")


def _fails_after_running(gm, example_inputs):
    """A compiled body that runs the whole step (tokens, positions, K/V written), then fails: the worst case."""

    def run(*args):
        gm(*args)
        raise RuntimeError("the compiled kernel failed after it ran")

    return run


def _requests() -> list[GenRequest]:
    kinds = [dict(), dict(temperature=0.0), dict(top_k=5)]
    return [GenRequest(f"r{i}", [1] + [4 + b for b in f"{i}+{i}=".encode()],
                       SamplingParams(max_new_tokens=8 + 3 * i, stop_token_ids=(), seed=i, **kinds[i % 3]))
            for i in range(3)]


@pytest.mark.parametrize("backend, prewarm", [(_broken, "auto"), (_fails_after_running, "false")],
                         ids=["at-start", "inside-a-rollout"])
def test_auto_on_cuda_falls_back_to_the_uncompiled_step_with_an_error(tiny_hf, monkeypatch, caplog, backend, prewarm):
    import torch._dynamo

    torch._dynamo.reset()
    model = _one_layer(tiny_hf)
    monkeypatch.setattr(build, "resolve_compile", lambda choice, device: CompilePlan(backend, True))
    with caplog.at_level(logging.ERROR):
        engine = NativeEngine(copy.deepcopy(model), max_batch_size=4, max_seq_len=40, prewarm=prewarm)
        assert engine.step_stats()["bucketed"]
        got = {r.sample_id: r for r in engine.generate(_requests())}
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "rollout.compile=false" in errors[0] and "failed" in errors[0], errors
    caps, stats = engine.capabilities(), engine.step_stats()
    assert caps["compile_step"] is None and stats["compiled"] is None
    assert "RuntimeError" in caps["compile_failure"] and caps["compile_failure"] == stats["compile_failure"]
    if prewarm == "auto":  # every bucket built at start, uncompiled, and none since
        assert stats["runners"] == stats["buckets"] == 18 and stats["builds"] == stats["buckets"] + 1, stats
    ref = NativeEngine(copy.deepcopy(model), max_batch_size=4, max_seq_len=40)  # exact shapes, never compiled
    for r in ref.generate(_requests()):
        assert got[r.sample_id].response_ids == r.response_ids, r.sample_id
        np.testing.assert_allclose(got[r.sample_id].behav_logp, r.behav_logp, atol=1e-6, rtol=1e-6)
    engine.close()
    ref.close()


def test_a_compile_failure_without_the_fallback_stops_the_engine_naming_the_fix(tiny_hf, monkeypatch):
    import torch._dynamo

    torch._dynamo.reset()
    monkeypatch.setattr(build, "resolve_compile", lambda choice, device: CompilePlan(_broken, False))
    with pytest.raises(RuntimeError, match="set rollout.compile=false") as info:
        NativeEngine(_one_layer(tiny_hf), max_batch_size=2, max_seq_len=40)
    assert "no compiler for this device" in str(info.value)
