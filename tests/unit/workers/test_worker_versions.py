"""The version a worker asks for work with is the one its engine has applied, so every token of the work it
is given comes from weights at least that new (a real worker object, a real native engine, real weights)."""

from __future__ import annotations

import time

import pytest
import torch

from asyncrl.engine.base import GenRequest, SamplingParams
from asyncrl.engine.native.engine import NativeEngine
from asyncrl.models import ensure_tiny_model
from asyncrl.quant import publish
from asyncrl.transport.publication import to_wire
from workers.generator.args import parse_args
from workers.generator.process import GeneratorWorker
from workers.generator.weights import WeightSync


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def test_a_work_request_names_the_applied_version_not_one_still_pending_in_the_engine(model_dir):
    from transformers import AutoModelForCausalLM

    worker = GeneratorWorker(parse_args(["controller=tcp://127.0.0.1:1", "worker_id=w"]))
    worker.engine = engine = NativeEngine.from_pretrained(model_dir, quant_format="fp32", version=0, max_batch_size=4)
    weights = WeightSync(engine, "fp32", worker.link, give_up=print)
    weights.version = 0
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():
            model.lm_head.weight.mul_(1.05)
        weights.take(*to_wire(publish(model.state_dict(), "fp32", version=1)), time.perf_counter())
        assert weights.version == 1 and engine.version == 0  # handed over, applied at the next step
        request = worker._work_request(free=4)
        assert request.version == 0 and request.credits == 4  # what the engine's next tokens may still come from
        engine.submit([GenRequest(sample_id="g/0", prompt_ids=[1, 55, 47, 56, 65],
                                  params=SamplingParams(max_new_tokens=6, temperature=1.0, seed=3))])
        (result,) = list(engine.generate())
        assert result.versions.min() >= request.version
        assert engine.version == 1 and worker._work_request(free=4).version == 1  # applied: it says so now
    finally:
        engine.close()
