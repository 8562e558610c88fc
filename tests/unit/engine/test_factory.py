"""Engine selection for a worker: specs, its formats, device resolution, SGLang interpreter, ``poll``."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config.roles import worker_formats
from asyncrl.engine import GenRequest, SamplingParams
from asyncrl.engine.factory import EngineSpec, build_engine, resolve_device, sglang_python
from asyncrl.engine.sglang.server import SGLANG_PYTHON_ENV


def test_one_place_decides_what_each_engine_runs_and_the_format_it_fetches():
    assert worker_formats("native", "", "int8") == ("int8", "int8")  # the run's
    assert worker_formats("native", "nvfp4", "int8") == ("nvfp4", "nvfp4")  # its own
    assert worker_formats("sglang", "", "int8") == ("fp32", "fp32")  # SGLang does not serve int8
    assert worker_formats("sglang", "", "bf16") == ("bf16", "bf16")
    assert worker_formats("sglang", "fp32", "bf16") == ("fp32", "fp32")
    assert worker_formats("sglang", "", "fp8") == ("fp8", "bf16")  # quantized on load by SGLang


def test_unknown_engine_or_unservable_format_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="choose one of: native, sglang"):
        EngineSpec(kind="vllm")
    with pytest.raises(ValueError, match="quant.fmt=fp32"):
        EngineSpec(kind="sglang", quant_format="int8")


def test_device_resolution_follows_what_torch_sees():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="auto, cpu, cuda or cuda:N"):
        resolve_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no GPU"):
            resolve_device("cuda:0")


def test_sglang_interpreter_that_does_not_exist_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv(SGLANG_PYTHON_ENV, str(tmp_path / "nope" / "python"))
    with pytest.raises(ValueError, match="does not exist"):
        sglang_python()
    assert sglang_python(__import__("sys").executable)


def test_sglang_worker_without_a_model_folder_or_url_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match="sglang.model_path=DIR"):
        build_engine(EngineSpec(kind="sglang", quant_format="fp32", model_path=str(tmp_path / "missing")))


def test_native_poll_streams_results_without_generate(tiny_dir):
    import json

    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_dir).to_json_string(use_diff=False)
    engine = build_engine(EngineSpec(kind="native", quant_format="fp32", device="cpu", slots=4,
                                     eos_token_ids=[2], model_config_json=cfg))
    try:
        assert engine.version == -1 and engine.poll(0.01) == []  # nothing to do: returns after the timeout
        engine.update_weights(0, {k: v.clone() for k, v in engine._model.state_dict().items()})
        params = SamplingParams(max_new_tokens=3, stop_token_ids=())
        engine.submit([GenRequest(f"s{i}", [1, 53, 47], params) for i in range(3)])
        got = []
        while len(got) < 3:
            got += engine.poll(1.0)
        assert sorted(r.sample_id for r in got) == ["s0", "s1", "s2"]
        assert all(r.versions.tolist() == [0, 0, 0] for r in got)
        assert json.loads(cfg)["model_type"] and engine.capabilities()["device"] == "cpu"
    finally:
        engine.close()
