"""Adapter behaviour that only a real SGLang 0.5.23 server can show (marker ``sglang``).

Each update path is checked end to end by the log-probs the server then reports: they must equal the HF
forward of the *new* weights on the tokens drawn, and every token must carry the new version.
"""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.engine import GenRequest, SamplingParams
from asyncrl.engine.sglang.engine import SGLangEngine

pytestmark = pytest.mark.sglang


def _req(sid: str, n: int = 6, temperature: float = 1.0) -> GenRequest:
    return GenRequest(
        sid, [1, 53, 47, 54, 65], SamplingParams(max_new_tokens=n, temperature=temperature, stop_token_ids=())
    )


def _check_v1(engine, version, tiny_hf_v1, reference, logp_atol) -> None:
    res = {r.sample_id: r for r in engine.generate([_req("a"), _req("b", temperature=0.6)])}
    for r, temp in ((res["a"], 1.0), (res["b"], 0.6)):
        assert r.versions.tolist() == [version] * len(r.response_ids)
        ref = reference.plain(tiny_hf_v1, r.prompt_ids, r.response_ids, temp).numpy()
        np.testing.assert_allclose(r.behav_logp, ref, atol=logp_atol, rtol=0)


def test_published_fp32_update_is_served(make_engine, tiny_hf_v1, reference, logp_atol):
    quant = pytest.importorskip("asyncrl.quant")
    engine = make_engine()
    engine.update_weights(4, quant.publish(tiny_hf_v1.state_dict(), "fp32", version=4))
    _check_v1(engine, 4, tiny_hf_v1, reference, logp_atol)
    assert engine.version == 4


def test_folder_update_is_served(make_engine, tiny_hf_v1, reference, logp_atol, tmp_path):
    tiny_hf_v1.save_pretrained(tmp_path)
    engine = make_engine()
    engine.update_weights(2, tmp_path)
    _check_v1(engine, 2, tiny_hf_v1, reference, logp_atol)


def test_update_mid_generation_splits_versions_at_the_pause(make_engine, tiny_hf_v1):
    engine = make_engine()
    results = []
    for res in engine.generate([_req("short", n=2), _req("long", n=120)]):
        results.append(res)
        if res.sample_id == "short":
            engine.update_weights(1, tiny_hf_v1.state_dict())
    long = next(r for r in results if r.sample_id == "long")
    v = long.versions.tolist()
    assert v[0] == 0 and v[-1] == 1 and v == sorted(v), "one switch from 0 to 1"


def test_flush_cache_and_health_on_idle_server(make_engine):
    engine = make_engine()
    engine.flush_cache()
    (res,) = engine.generate([_req("x", n=3)])
    assert res.finish_reason == "length"
    status, _ = engine.http.request("GET", "/health_generate", timeout=60)
    assert status == 200


def test_launch_starts_a_server_and_close_ends_it_by_pid(
    tiny_dir, sglang_device, sglang_python_path, tmp_path
):
    import os

    engine = SGLangEngine.launch(
        tiny_dir,
        device=sglang_device,
        python=sglang_python_path,
        version=7,
        log_path=tmp_path / "srv.log",
        server_args={"max_total_tokens": 4096},
    )
    pid = engine.server.pid
    try:
        (res,) = engine.generate([_req("x", n=3)])
        assert res.versions.tolist() == [7, 7, 7]
    finally:
        engine.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert _running_in_group(pid) == [], "the scheduler/detokenizer children are gone too"


def _running_in_group(pgid: int) -> list[int]:
    """PIDs of non-zombie processes in process group ``pgid`` (/proc; zombies await reaping by init)."""
    from pathlib import Path

    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found
