"""``overlap``: a static step's results are read after the next step is launched; the samples are unchanged.

On CUDA the host's bookkeeping of step k (recording tokens, finish checks, results, the next uniforms) then
runs while step k+1 computes; on a CPU the same code path runs (the copy and the wait are trivial) when
``overlap=True`` is asked for. Driven through the same step boundaries as the engine without it (joins,
leaves, aborts, a weight swap, pause/resume, greedy, sampled and truncated rows), every sample has the same
tokens, versions and behaviour log-probs, bit for bit; with stop tokens (a row that stops is only seen once the
step after it runs) the tokens and versions are equal and the log-probs within a few ulps.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from asyncrl.engine import GenRequest, SamplingParams
from asyncrl.engine.native.engine import NativeEngine


def ids(text: str) -> list[int]:
    return [1] + [4 + b for b in text.encode()]


def _requests(stops: tuple[int, ...]) -> list[GenRequest]:
    texts = ["1+2=", "What is 17+25? ", "9*9=", "3-8", "answer: ", "100/4=", "x", "12345+", "7*6=", "hi"]
    kinds = [dict(), dict(temperature=0.0), dict(top_k=5), dict(top_p=0.6, temperature=0.8),
             dict(temperature=0.7), dict(top_k=3, top_p=0.9)]
    return [GenRequest(f"r{i}", ids(t), SamplingParams(max_new_tokens=4 + (7 * i) % 13, stop_token_ids=stops,
                                                       seed=i, **kinds[i % len(kinds)]))
            for i, t in enumerate(texts)]


def _drive(engine: NativeEngine, reqs: list[GenRequest], new_weights) -> tuple[dict, int]:
    """Events keyed on the forwards launched so far (with overlap, a call may read a step and launch none)."""
    out: dict = {}
    in_flight = launched = 0
    upload = engine._static.upload

    def counted(*args):  # one upload per forward on the static path
        nonlocal launched
        launched += 1
        return upload(*args)

    engine._static.upload = counted
    events = {3: lambda: engine.abort(["r1"]),
              5: lambda: (engine.update_weights(1, new_weights), engine.submit(reqs[7:])),
              8: engine.pause}
    paused_calls = 0
    engine.submit(reqs[:7])
    for _ in range(1000):
        if not (events or engine.has_work()):
            break
        for key in [k for k in events if k <= launched]:
            events.pop(key)()
        if engine.paused:
            paused_calls += 1
            if paused_calls == 3:
                engine.resume()
        for r in engine.step():
            assert r.sample_id not in out, "every sample comes back once"
            out[r.sample_id] = r
        in_flight += engine._inflight is not None
    else:
        raise AssertionError(f"still running after 1000 steps ({sorted(events)} not reached)")
    engine.close()
    return out, in_flight


@pytest.mark.parametrize("pad", [False, True], ids=["exact", "buckets"])
@pytest.mark.parametrize("stops", [(), tuple(range(40, 90))], ids=["length", "stop-tokens"])
def test_overlapped_steps_give_the_samples_of_the_engine_without_overlap(tiny_hf, tiny_hf_v1, pad, stops):
    reqs = _requests(stops)
    outs = []
    for overlap in (False, True):
        engine = NativeEngine(copy.deepcopy(tiny_hf), max_batch_size=5, max_prefill_tokens=12, overlap=overlap)
        engine._static.pad = pad  # buckets: padded rows and spans, as under CUDA graphs
        assert engine.capabilities()["overlap"] is overlap
        out, in_flight = _drive(engine, reqs, tiny_hf_v1.state_dict())
        assert (in_flight > 0) is overlap, "with overlap some steps were read after the next one was launched"
        outs.append(out)
    ref, got = outs
    assert sorted(got) == sorted(ref) == sorted(r.sample_id for r in reqs)
    if not stops:  # (with stop tokens r1 may stop before its abort, in both engines alike)
        assert ref["r1"].finish_reason == "abort"
    assert {0, 1} <= set(np.concatenate([r.versions for r in got.values()]).tolist())
    if stops:
        assert any(r.finish_reason == "stop" for r in ref.values()), "the stop tokens are drawn"
    for sid, r in ref.items():
        assert got[sid].response_ids == r.response_ids, sid
        assert got[sid].versions.tolist() == r.versions.tolist(), sid
        assert got[sid].finish_reason == r.finish_reason, sid
        if not stops:  # the same forwards on the same batches: bit for bit
            assert got[sid].behav_logp.tobytes() == r.behav_logp.tobytes(), sid
        # a row that stopped is in the batch of the step launched before its stop was read: other shapes
        np.testing.assert_allclose(got[sid].behav_logp, r.behav_logp, atol=1e-6, rtol=1e-6)


def test_overlap_is_on_for_cuda_only_and_needs_the_static_step(tiny_hf):
    engine = NativeEngine(copy.deepcopy(tiny_hf), max_batch_size=2)
    assert engine.capabilities()["overlap"] is False  # auto on a CPU
    engine.close()
    with pytest.raises(ValueError, match="overlap=auto"):
        NativeEngine(copy.deepcopy(tiny_hf), decode_step="eager", overlap=True)
    with pytest.raises(ValueError, match="overlap must be one of"):
        NativeEngine(copy.deepcopy(tiny_hf), overlap="maybe")
