"""``prewarm``: the runner of every batch/span bucket of the static step is built when the engine is built.

On a GPU a runner is a CUDA graph (of the compiled body, by default); here it is the step body compiled by
``torch.compile`` with dynamo's ``eager`` backend (one graph per bucket), counted by the same ``StepGraphs``
bookkeeping and built by the same ``StaticStep.build_all``. A rollout after construction builds nothing; a
rebuild between two steps (after a weight load dropped the runners) leaves live rows exactly as they were.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from asyncrl.engine import GenRequest, SamplingParams
from asyncrl.engine.native.engine import NativeEngine

MAX_LEN = 40  # spans 16, 32, 40; batch buckets 1, 2, 4; two truncation variants: 18 runners


def ids(text: str) -> list[int]:
    return [1] + [4 + b for b in text.encode()]


def _requests(tag: str, n: int, new: int) -> list[GenRequest]:
    kinds = [dict(), dict(temperature=0.0), dict(top_k=5), dict(top_p=0.7, temperature=0.8)]
    return [GenRequest(f"{tag}{i}", ids("12+3=" * (1 + i % 3)),
                       SamplingParams(max_new_tokens=new + 3 * i, stop_token_ids=(), seed=i, **kinds[i % 4]))
            for i in range(n)]


def _one_layer(tiny_hf):
    model = copy.deepcopy(tiny_hf)  # one layer: the same ops, a quarter of what dynamo traces
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    return model


def _compiled(model, **kw) -> NativeEngine:
    import torch._dynamo

    torch._dynamo.reset()  # each engine's body is its own set of compiled graphs
    return NativeEngine(copy.deepcopy(model), max_batch_size=4, max_seq_len=MAX_LEN, compile_step="eager", **kw)


def test_every_bucket_is_built_at_construction_and_a_rollout_builds_none(tiny_hf):
    model = _one_layer(tiny_hf)
    engine = _compiled(model)
    stats = engine.step_stats()
    assert stats["bucketed"] and stats["prewarm"]
    assert stats["buckets"] == 3 * 3 * 2 and stats["builds"] == stats["runners"] == stats["buckets"], stats
    assert stats["kv_capacity"] == MAX_LEN and stats["replays"] == 0
    ref = NativeEngine(copy.deepcopy(model), max_batch_size=4, max_seq_len=MAX_LEN)  # exact shapes, eager
    for reqs in (_requests("a", 1, 20), _requests("b", 3, 6), _requests("c", 4, 12), _requests("d", 2, 24)):
        want = {r.sample_id: r for r in ref.generate(reqs)}
        got = {r.sample_id: r for r in engine.generate(reqs)}
        assert sorted(got) == sorted(want)
        for sid, r in want.items():
            assert got[sid].response_ids == r.response_ids, sid
            np.testing.assert_allclose(got[sid].behav_logp, r.behav_logp, atol=1e-6, rtol=1e-6)
    after = engine.step_stats()
    assert after["builds"] == stats["builds"] and after["drops"] == 0, after
    assert after["kv_allocations"] == stats["kv_allocations"], "the cache never grew after construction"
    assert after["replays"] > 0
    engine.close()
    ref.close()


def _run(engine: NativeEngine, reqs: list[GenRequest], disturb_at: int | None) -> dict:
    engine.submit(reqs)
    out, k = {}, 0
    while engine.has_work():
        if k == disturb_at:  # what a load that reallocates a parameter leaves: the runners are dropped
            with torch.no_grad():
                weight = engine._model.model.norm.weight
                weight.data = weight.data.clone()
            engine.weights.swap.check_pointers(engine._model, engine._static)
            assert engine.step_stats()["runners"] == 0
        out |= {r.sample_id: r for r in engine.step()}
        k += 1
    return out


def test_a_rebuild_at_a_step_boundary_leaves_live_rows_bit_for_bit(tiny_hf):
    reqs = _requests("r", 4, 10)
    model = _one_layer(tiny_hf)
    want = _run(_compiled(model), reqs, None)
    engine = _compiled(model)
    got = _run(engine, reqs, disturb_at=5)
    stats = engine.step_stats()
    assert stats["drops"] == stats["buckets"] and stats["builds"] == 2 * stats["buckets"], stats
    assert stats["runners"] == stats["buckets"], "the next boundary built every bucket again"
    for sid, r in want.items():
        assert got[sid].response_ids == r.response_ids, sid
        assert got[sid].behav_logp.tobytes() == r.behav_logp.tobytes(), sid
    engine.close()


def test_prewarm_follows_the_bucketed_step_and_true_without_one_is_refused(tiny_hf):
    plain = NativeEngine(copy.deepcopy(tiny_hf), max_batch_size=2, max_seq_len=MAX_LEN)
    stats = plain.step_stats()
    assert not stats["prewarm"] and stats["builds"] == stats["buckets"] == 0 and stats["kv_capacity"] == 0
    plain.close()
    off = _compiled(_one_layer(tiny_hf), prewarm="false")
    assert off.step_stats()["builds"] == 0 and off.step_stats()["kv_capacity"] == 0
    off.close()
    with pytest.raises(ValueError, match="rollout.prewarm=auto"):
        NativeEngine(copy.deepcopy(tiny_hf), max_seq_len=MAX_LEN, prewarm="true")
    with pytest.raises(ValueError, match="rollout.prewarm=auto"):
        NativeEngine(copy.deepcopy(tiny_hf), max_seq_len=MAX_LEN, decode_step="eager", prewarm=True)
    with pytest.raises(ValueError, match="prewarm must be one of"):
        NativeEngine(copy.deepcopy(tiny_hf), max_seq_len=MAX_LEN, prewarm="sometimes")
