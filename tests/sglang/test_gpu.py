"""SGLang modes that need a GPU: FP8 serving (flash_rl) and a deterministic server (markers gpu + sglang).

Run on a GPU machine with the SGLang venv (docs/sglang.md, "GPU"):
    ASYNCRL_SGLANG_DEVICE=cuda .venv/bin/python -m pytest tests/sglang -m "sglang" -q
Without ``nvidia-smi`` or without the SGLang interpreter every test here is skipped. The servers use the
triton attention backend (the tiny model's head_dim 32 is outside some FA3 builds' list).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from asyncrl.engine import GenRequest, SamplingParams
from asyncrl.engine.sglang.engine import SGLangEngine

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]
GPU_SERVER_ARGS = {"max_total_tokens": 16384, "extra_args": ["--attention-backend", "triton"]}


@pytest.fixture(scope="module")
def gpu_python(sglang_python_path) -> str:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no CUDA device (nvidia-smi not found)")
    return sglang_python_path


def _requests(n: int = 4) -> list[GenRequest]:
    return [
        GenRequest(f"g{i}", [1, 53, 47, 54, 65 + i], SamplingParams(max_new_tokens=16, stop_token_ids=()))
        for i in range(n)
    ]


def _logp_gap(results, model, reference) -> float:
    gaps = [
        np.abs(r.behav_logp - reference.plain(model, r.prompt_ids, r.response_ids, 1.0).numpy()).mean()
        for r in results
    ]
    return float(np.mean(gaps))


def test_fp8_flash_rl_serves_and_requantizes_full_precision_updates(
    gpu_python, tiny_dir, tiny_hf, tiny_hf_v1, reference, tmp_path
):
    engine = SGLangEngine.launch(
        tiny_dir,
        device="cuda",
        quant_format="fp8",
        python=gpu_python,
        log_path=tmp_path / "fp8.log",
        server_args=GPU_SERVER_ARGS,
    )
    try:
        caps = engine.capabilities()
        assert caps["quantized_serving"] == "fp8_flash_rl" and caps["prequantized_push"] == ()
        before = list(engine.generate(_requests()))
        assert all(r.versions.tolist() == [0] * 16 for r in before)
        gap_v0 = _logp_gap(before, tiny_hf, reference)
        engine.update_weights(1, tiny_hf_v1.state_dict())  # full precision, quantized on load
        after = list(engine.generate(_requests()))
        assert all(r.versions.tolist() == [1] * 16 for r in after)
        gap_new, gap_old = _logp_gap(after, tiny_hf_v1, reference), _logp_gap(after, tiny_hf, reference)
        print(f"fp8 mean |logp - HF fp32|: v0 {gap_v0:.4f}, v1 {gap_new:.4f} (vs old weights {gap_old:.4f})")
        assert gap_v0 < 0.1 and gap_new < 0.1, "FP8 serving stays close to the full-precision model"
        assert gap_new < gap_old, "the update was applied (re-quantized from the new weights)"
    finally:
        engine.close()


def test_gpu_contract_server_is_seeded(gpu_python, tiny_dir, tmp_path):
    """``--enable-deterministic-inference`` (triton backend) makes sampling_seed count: same seed and sample
    id give the same tokens, distinct sample ids differ."""
    engine = SGLangEngine.launch(
        tiny_dir,
        device="cuda",
        python=gpu_python,
        log_path=tmp_path / "det.log",
        server_args=dict(GPU_SERVER_ARGS, deterministic=True),
    )
    try:
        assert engine.capabilities()["seeded"]
        runs = []
        for _ in range(2):
            reqs = [
                GenRequest(f"d{i}", [1, 53, 47], SamplingParams(max_new_tokens=12, seed=5)) for i in range(3)
            ]
            runs.append({r.sample_id: r.response_ids for r in engine.generate(reqs)})
        assert runs[0] == runs[1]
        assert runs[0]["d0"] != runs[0]["d1"]
    finally:
        engine.close()
