"""Native-engine specifics: step-level control, continuous batching, truncated sampling, validation."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.engine import GenRequest, SamplingParams
from asyncrl.engine.base import EngineClosedError
from asyncrl.engine.native.engine import NativeEngine


def ids(text: str) -> list[int]:
    return [1] + [4 + b for b in text.encode()]


def params(n: int = 8, **kw) -> SamplingParams:
    kw.setdefault("stop_token_ids", ())
    return SamplingParams(max_new_tokens=n, **kw)


@pytest.fixture
def engine(tiny_hf):
    eng = NativeEngine(copy.deepcopy(tiny_hf), max_batch_size=4)
    yield eng
    eng.close()


def drain(engine: NativeEngine) -> dict:
    out = {}
    while engine.has_work():
        for r in engine.step():
            assert r.sample_id not in out
            out[r.sample_id] = r
    return out


def test_step_applies_weight_update_exactly_at_the_boundary(engine, tiny_hf, tiny_hf_v1, reference):
    engine.submit([GenRequest("a", ids("12+"), params(10))])
    for _ in range(3):
        assert engine.step() == []
    engine.update_weights(1, tiny_hf_v1.state_dict())
    assert engine.version == 0, "pending until the next boundary"
    (res,) = drain(engine).values()
    assert engine.version == 1
    assert res.versions.tolist() == [0, 0, 0] + [1] * 7
    ref = reference.swapped(tiny_hf, tiny_hf_v1, res.prompt_ids, res.response_ids, 3, 1.0).numpy()
    np.testing.assert_allclose(res.behav_logp, ref, atol=1e-4, rtol=0)


def test_latest_pending_update_wins_and_versions_must_increase(engine, tiny_hf_v1):
    sd = tiny_hf_v1.state_dict()
    engine.update_weights(1, sd)
    engine.update_weights(2, sd)
    with pytest.raises(ValueError, match="not newer"):
        engine.update_weights(2, sd)
    engine.submit([GenRequest("a", ids("1"), params(3))])
    (res,) = drain(engine).values()
    assert res.versions.tolist() == [2, 2, 2]


def test_paused_step_runs_nothing_but_applies_aborts_and_weights(engine, tiny_hf_v1):
    engine.submit([GenRequest("a", ids("1+1"), params(6)), GenRequest("b", ids("2+2"), params(6))])
    engine.step()
    engine.pause()
    engine.submit([GenRequest("c", ids("3"), params(2))])
    engine.abort(["b"])
    engine.update_weights(5, tiny_hf_v1.state_dict())
    (aborted,) = engine.step()
    assert aborted.sample_id == "b" and aborted.finish_reason == "abort" and len(aborted.response_ids) == 1
    assert engine.version == 5
    assert engine.step() == [] and engine.num_active == 1 and engine.num_queued == 1
    assert not engine.wait(timeout=0.0), "paused with nothing to apply: no runnable work"
    engine.resume()
    got = drain(engine)
    assert got["a"].versions.tolist() == [0] + [5] * 5
    assert got["c"].versions.tolist() == [5, 5]


def test_more_requests_than_slots_queue_and_all_match_hf(tiny_hf, reference):
    engine = NativeEngine(copy.deepcopy(tiny_hf), max_batch_size=3)
    prompts = [
        ids("1"),
        ids("What is 2+2? "),
        ids("33*3="),
        ids("x"),
        ids("long prompt here: 123+456="),
        ids("7-"),
    ]
    reqs = [GenRequest(f"r{i}", p, params(4 + 5 * (i % 3), seed=i)) for i, p in enumerate(prompts)]
    engine.submit(reqs)
    got = drain(engine)
    assert len(got) == 6 and engine.num_active == 0
    for r in reqs:
        res = got[r.sample_id]
        assert len(res.response_ids) == r.params.max_new_tokens
        ref = reference.plain(tiny_hf, res.prompt_ids, res.response_ids, 1.0).numpy()
        np.testing.assert_allclose(res.behav_logp, ref, atol=1e-4, rtol=0)
    assert got["r5"].timings["queue_s"] >= got["r0"].timings["queue_s"]


def test_long_generations_stay_exact_across_kv_cache_growth(tiny_hf, reference):
    engine = NativeEngine(copy.deepcopy(tiny_hf), max_batch_size=2)
    engine.submit(
        [GenRequest(f"r{i}", ids("9" * (i + 1)), params(50, seed=i, temperature=0.7)) for i in range(3)]
    )
    got = drain(engine)
    # grown by doubling, capped at the longest prompt + response limit (3 + 50), not doubled past it (64+)
    assert 50 <= engine._runner.cache.cap_len <= 53
    for res in got.values():
        ref = reference.plain(tiny_hf, res.prompt_ids, res.response_ids, 0.7).numpy()
        np.testing.assert_allclose(res.behav_logp, ref, atol=1e-4, rtol=0)


def test_truncated_sampling_reports_renormalised_logprobs_inside_the_kept_set(engine, tiny_hf):
    reqs = [
        GenRequest("k", ids("5+5="), params(12, top_k=3, seed=2)),
        GenRequest("p", ids("5+5="), params(12, top_p=0.3, temperature=0.8, seed=2)),
    ]
    engine.submit(reqs)
    got = drain(engine)
    for r in reqs:
        res = got[r.sample_id]
        full = torch.tensor([res.prompt_ids + res.response_ids])
        with torch.no_grad():
            logits = tiny_hf(full).logits[0, len(res.prompt_ids) - 1 : -1].float() / r.params.temperature
        for t, tok in enumerate(res.response_ids):
            logp = torch.log_softmax(logits[t], -1)
            order = logp.argsort(descending=True)
            if r.params.top_k > 0:
                keep = order[: r.params.top_k]
            else:
                mass = torch.cumsum(logp[order].exp(), 0) - logp[order].exp()
                keep = order[mass < r.params.top_p]
            assert tok in keep.tolist()
            expected = logp[tok] - torch.logsumexp(logp[keep], 0)
            assert abs(float(expected) - float(res.behav_logp[t])) < 1e-4


def test_prefill_token_budget_admits_queued_requests_over_several_steps(tiny_hf):
    engine = NativeEngine(copy.deepcopy(tiny_hf), max_batch_size=8, max_prefill_tokens=5)
    engine.submit([GenRequest(f"r{i}", ids("abcd"), params(20)) for i in range(3)])  # 5 tokens each
    active = []
    for _ in range(3):
        engine.step()
        active.append(engine.num_active)
    assert active == [1, 2, 3]


def test_sequence_length_cap_ends_sample_with_length(tiny_hf):
    engine = NativeEngine(copy.deepcopy(tiny_hf), max_seq_len=20)
    (res,) = engine.generate([GenRequest("a", ids("123456789"), params(50))])  # 10 prompt tokens
    assert res.finish_reason == "length" and len(res.response_ids) == 10
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.submit([GenRequest("b", ids("x" * 25), params(2))])


def test_bad_requests_and_updates_are_rejected_with_value_errors(engine, tiny_hf_v1):
    with pytest.raises(ValueError, match="outside vocab"):
        engine.submit([GenRequest("a", [1, 100000], params())])
    with pytest.raises(ValueError, match="twice"):
        engine.submit([GenRequest("a", [1], params()), GenRequest("a", [2], params())])
    engine.submit([GenRequest("live", [1], params())])
    with pytest.raises(ValueError, match="already live"):
        engine.submit([GenRequest("live", [1], params())])
    sd = dict(tiny_hf_v1.state_dict())
    sd.pop("model.norm.weight")
    with pytest.raises(ValueError, match="missing"):
        engine.update_weights(1, sd)
    sd = dict(tiny_hf_v1.state_dict())
    sd["lm_head.weight"] = sd["lm_head.weight"][:-1]
    with pytest.raises(ValueError, match="wrong shape"):
        engine.update_weights(1, sd)
    with pytest.raises(ValueError, match="state dict or"):
        engine.update_weights(1, [1, 2, 3])
    with pytest.raises(ValueError):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError):
        SamplingParams(max_new_tokens=4, top_k=0)
    with pytest.raises(ValueError):
        GenRequest("x", [], params())


def test_unknown_quant_format_is_rejected(tiny_hf):
    with pytest.raises(ValueError, match="quant_format"):
        NativeEngine(copy.deepcopy(tiny_hf), quant_format="int4")


def test_architecture_the_native_decoder_lacks_runs_on_the_hf_fallback(tiny_hf):
    from asyncrl.engine.native.hf_runner import HFRunner

    model = copy.deepcopy(tiny_hf)
    model.config.layer_types = ["sliding_attention"] * len(model.config.layer_types)
    model.config.sliding_window = 8
    assert isinstance(NativeEngine(model)._runner, HFRunner)


def test_closed_engine_refuses_updates_and_submissions(engine, tiny_hf_v1):
    engine.close()
    with pytest.raises(EngineClosedError):
        engine.update_weights(1, tiny_hf_v1.state_dict())
    with pytest.raises(EngineClosedError):
        engine.submit([GenRequest("a", [1], params())])
    assert list(engine.generate()) == []


def test_from_pretrained_loads_an_hf_folder(tiny_dir):
    engine = NativeEngine.from_pretrained(tiny_dir, max_batch_size=2)
    (res,) = engine.generate([GenRequest("a", ids("1+1="), params(3))])
    assert len(res.response_ids) == 3 and engine.capabilities()["engine"] == "native"
    engine.close()


def test_from_pretrained_lets_go_of_the_weights_file_and_keeps_tied_weights_tied(tiny_dir, tmp_path):
    """The loaded file's mapping is released (its pages, read by quantization, would stay resident)."""
    import gc
    import shutil

    folder = shutil.copytree(tiny_dir, tmp_path / "model")
    engine = NativeEngine.from_pretrained(folder, quant_format="int8", max_batch_size=2)
    gc.collect()
    assert str(folder) not in Path("/proc/self/maps").read_text()
    model = engine._model
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    (res,) = engine.generate([GenRequest("a", ids("1+1="), params(3))])
    assert len(res.response_ids) == 3
    engine.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["in-step", "overlap"])
def test_concurrent_submits_updates_and_aborts_from_another_thread_lose_nothing(tiny_hf, tiny_hf_v1, overlap):
    import threading

    engine = NativeEngine(copy.deepcopy(tiny_hf), max_batch_size=4, overlap=overlap)
    sd = tiny_hf_v1.state_dict()
    started = threading.Event()

    def feeder() -> None:
        started.wait()
        for k in range(6):
            engine.submit(
                [GenRequest(f"t{k}-{j}", ids(f"{k}+{j}="), params(6 + j, seed=k)) for j in range(3)]
            )
            engine.update_weights(k + 1, sd)
            if k % 2:
                engine.abort([f"t{k}-0"])

    thread = threading.Thread(target=feeder)
    thread.start()
    results = []
    first = True
    while thread.is_alive() or engine.has_work():
        if first:
            engine.submit([GenRequest("seed", ids("0"), params(40))])
            started.set()
            first = False
        for res in engine.generate():
            results.append(res)
        engine.wait(timeout=0.01)
    thread.join()
    results += list(engine.generate())
    names = [r.sample_id for r in results]
    assert sorted(names) == sorted(["seed"] + [f"t{k}-{j}" for k in range(6) for j in range(3)])
    for res in results:
        v = res.versions
        assert np.all(np.diff(v) >= 0), "versions never go back within a sample"
        if res.finish_reason != "abort":
            expected = 40 if res.sample_id == "seed" else 6 + int(res.sample_id[-1])
            assert len(res.response_ids) == expected


def test_failed_weight_load_loses_nothing_and_keeps_serving_the_old_version(tiny_hf, tiny_hf_v1):
    quant = pytest.importorskip("asyncrl.quant")
    engine = NativeEngine(copy.deepcopy(tiny_hf), quant_format="int8_wo")
    engine.submit([GenRequest("a", ids("1+"), params(6))])
    engine.step()
    published = quant.publish(tiny_hf_v1.state_dict(), "int8_wo", version=1)
    name = next(iter(published.tensors))
    published.tensors[name] = published.tensors[name].clone()
    published.tensors[name].view(-1)[0] += 1  # bytes no longer match the manifest digest
    engine.update_weights(1, published)
    engine.submit([GenRequest("b", ids("2+"), params(3))])
    with pytest.raises(ValueError):
        engine.step()
    assert engine.version == 0 and engine.num_queued == 1 and engine.num_active == 1
    got = drain(engine)
    assert sorted(got) == ["a", "b"]
    assert got["a"].versions.tolist() == [0] * 6 and len(got["b"].response_ids) == 3


def _int8_publications(model, n: int):
    """``n`` int8 publications of small successive updates of ``model`` (versions 1..n)."""
    from asyncrl.quant import publish

    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    out = []
    for v in range(1, n + 1):
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 2e-5)
        out.append(publish(m.state_dict(), "int8", version=v))
    return out


def test_deltas_queued_before_a_boundary_are_applied_in_order_and_a_bad_one_keeps_the_version(tiny_hf):
    from asyncrl.quant import load_published, make_delta, quantize_model

    pubs = _int8_publications(tiny_hf, 4)
    engine = NativeEngine(copy.deepcopy(tiny_hf), quant_format="int8", max_batch_size=4)
    try:
        engine.update_weights(1, pubs[0])
        engine.update_weights(2, make_delta(pubs[0], pubs[1]))
        engine.update_weights(3, make_delta(pubs[1], pubs[2]))  # both before the boundary: applied in order
        with pytest.raises(ValueError, match="cannot follow version 3"):
            engine.update_weights(4, make_delta(pubs[1], pubs[3]))
        engine.submit([GenRequest("a", ids("1"), params(2))])
        (res,) = drain(engine).values()
        assert engine.version == 3 and res.versions.tolist() == [3, 3] and not engine.take_delta_failure()
        full = quantize_model(copy.deepcopy(tiny_hf), "int8")
        load_published(full, pubs[2])
        want, got = full.state_dict(), engine._model.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)
        bad = make_delta(pubs[2], pubs[3])
        i = next(i for i, p in enumerate(p for p in bad.parts if p.kind != "same") if p.kind == "sparse")
        frame = bad.payloads[i].clone()
        frame[-1] ^= 1
        bad.payloads[i] = frame
        engine.update_weights(4, bad)
        engine.submit([GenRequest("b", ids("2"), params(2))])
        (res,) = drain(engine).values()  # the engine went on serving version 3, and says a delta failed
        assert engine.version == 3 and res.versions.tolist() == [3, 3]
        assert engine.take_delta_failure() and not engine.take_delta_failure()
        assert all(torch.equal(engine._model.state_dict()[k], want[k]) for k in want)
    finally:
        engine.close()
