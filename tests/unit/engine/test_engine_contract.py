"""Contract suite every RolloutEngine must pass (parametrised over ``ENGINE_FACTORIES`` in conftest).

Every check runs for every quant format (conftest ``CONTRACT_FORMATS``): ``ref_v0`` / ``ref_v1`` are plain
HF forwards of the actor in the case's format. Only the Protocol surface is used here (submit / generate / update_weights / abort / pause / resume / close /
capabilities), so an SGLang engine can be dropped into the same suite. Checks that rely on an
engine-specific guarantee are gated on ``capabilities()``.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from asyncrl.engine import FINISH_REASONS, GenRequest, GenResult, RolloutEngine, SamplingParams


def prompt(text: str) -> list[int]:
    """Tiny-model ids: <bos> then one id per byte (id = 4 + byte)."""
    return [1] + [4 + b for b in text.encode()]


PROMPTS = [prompt("1+2="), prompt("What is 17+25? "), prompt("9*9"), prompt("The answer to 123-45 is ")]


def req(i: int, *, n: int = 12, temperature: float = 1.0, seed: int = 0, stop=(), **kw) -> GenRequest:
    params = SamplingParams(max_new_tokens=n, temperature=temperature, seed=seed, stop_token_ids=stop, **kw)
    return GenRequest(f"s{i}", PROMPTS[i % len(PROMPTS)], params)


def by_id(results: list[GenResult]) -> dict[str, GenResult]:
    ids = [r.sample_id for r in results]
    assert len(ids) == len(set(ids)), f"a sample was yielded twice: {ids}"
    return {r.sample_id: r for r in results}


def assert_well_formed(r: GenResult) -> None:
    assert r.finish_reason in FINISH_REASONS
    assert r.behav_logp.dtype == np.float32 and r.versions.dtype == np.int32
    assert len(r.response_ids) == r.behav_logp.shape[0] == r.versions.shape[0]
    assert np.all(np.isfinite(r.behav_logp)) and np.all(r.behav_logp <= 0)


def test_engine_satisfies_protocol_and_reports_capabilities(make_engine):
    engine = make_engine()
    assert isinstance(engine, RolloutEngine)
    caps = engine.capabilities()
    for key in ("engine", "quant_format", "per_token_versions", "weight_swap", "seeded"):
        assert key in caps


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behav_logp_equals_hf_forward_of_same_tokens(make_engine, ref_v0, reference, temperature, logp_atol):
    engine = make_engine(max_batch_size=8)
    reqs = [req(i, n=10 + 3 * i, temperature=temperature, seed=7) for i in range(4)]
    results = by_id(list(engine.generate(reqs)))
    assert set(results) == {r.sample_id for r in reqs}
    for r in reqs:
        res = results[r.sample_id]
        assert_well_formed(res)
        assert res.prompt_ids == r.prompt_ids
        ref = reference.plain(ref_v0, res.prompt_ids, res.response_ids, temperature).numpy()
        np.testing.assert_allclose(res.behav_logp, ref, atol=logp_atol, rtol=0)


def test_greedy_takes_argmax_and_reports_raw_log_softmax(make_engine, ref_v0, reference, logp_atol):
    import torch

    engine = make_engine()
    (res,) = engine.generate([req(1, n=8, temperature=0.0)])
    ids = torch.tensor([res.prompt_ids + res.response_ids])
    with torch.no_grad():
        logits = ref_v0(ids).logits[0, len(res.prompt_ids) - 1 : -1]
    assert res.response_ids == logits.argmax(-1).tolist()
    ref = reference.plain(ref_v0, res.prompt_ids, res.response_ids, 0.0).numpy()
    np.testing.assert_allclose(res.behav_logp, ref, atol=logp_atol, rtol=0)


def test_same_seed_gives_same_samples_and_other_seed_differs(make_engine):
    def run(seed: int) -> dict[str, list[int]]:
        engine = make_engine()
        return {
            r.sample_id: r.response_ids for r in engine.generate([req(i, n=16, seed=seed) for i in range(3)])
        }

    first, second, other = run(3), run(3), run(4)
    assert first == second
    assert first != other


def test_seeded_sample_does_not_depend_on_batch_composition(make_engine):
    engine = make_engine()
    if not engine.capabilities().get("seeded"):
        pytest.skip("engine does not promise batch-independent seeded sampling")
    (solo,) = engine.generate([req(0, n=16, seed=5)])
    crowd = by_id(list(engine.generate([req(i, n=16, seed=5) for i in range(1, 4)] + [req(0, n=16, seed=5)])))
    assert crowd["s0"].response_ids == solo.response_ids


def test_versions_and_logps_are_right_across_a_mid_generation_weight_update(
    make_engine, tiny_hf_v1, ref_v0, ref_v1, reference, logp_atol
):
    engine = make_engine(max_batch_size=4)
    short, long = req(0, n=4, seed=1), req(1, n=14, seed=1)
    results = []
    for res in engine.generate([short, long]):
        results.append(res)
        if res.sample_id == short.sample_id:  # a step boundary: long is in flight with 4 tokens
            engine.update_weights(1, tiny_hf_v1.state_dict())
    got = by_id(results)
    assert got["s0"].versions.tolist() == [0] * 4
    versions = got["s1"].versions.tolist()
    assert len(versions) == 14
    switch = versions.index(1)
    assert versions == [0] * switch + [1] * (14 - switch), "one swap, later tokens carry the new version"
    if engine.capabilities().get("weight_swap") == "step_boundary":
        assert switch == 4
    res = got["s1"]
    ref = reference.swapped(ref_v0, ref_v1, res.prompt_ids, res.response_ids, switch, 1.0).numpy()
    np.testing.assert_allclose(res.behav_logp, ref, atol=logp_atol, rtol=0)


def test_requests_after_a_weight_update_use_the_new_version(
    make_engine, tiny_hf_v1, ref_v1, reference, logp_atol
):
    engine = make_engine()
    engine.update_weights(3, tiny_hf_v1.state_dict())
    (res,) = engine.generate([req(2, n=6)])
    assert res.versions.tolist() == [3] * 6
    ref = reference.plain(ref_v1, res.prompt_ids, res.response_ids, 1.0).numpy()
    np.testing.assert_allclose(res.behav_logp, ref, atol=logp_atol, rtol=0)


def test_abort_finishes_live_sample_with_partial_tokens(make_engine, ref_v0, reference, logp_atol):
    engine = make_engine()
    results = []
    for res in engine.generate([req(0, n=3), req(1, n=200)]):
        results.append(res)
        if res.sample_id == "s0":
            engine.abort(["s1", "no-such-id"])
    got = by_id(results)
    aborted = got["s1"]
    assert aborted.finish_reason == "abort"
    # Live when s0 finished (3 tokens); an HTTP engine may have started it a step later than s0.
    assert 1 <= len(aborted.response_ids) < 200
    ref = reference.plain(ref_v0, aborted.prompt_ids, aborted.response_ids, 1.0).numpy()
    np.testing.assert_allclose(aborted.behav_logp, ref, atol=logp_atol, rtol=0)


def test_abort_of_a_queued_request_yields_it_empty(make_engine):
    engine = make_engine(max_batch_size=1)
    engine.submit([req(0, n=5), req(1, n=5)])
    engine.abort(["s1"])
    got = by_id(list(engine.generate()))
    assert got["s0"].finish_reason == "length" and len(got["s0"].response_ids) == 5
    assert got["s1"].finish_reason == "abort" and got["s1"].response_ids == []


def generate_pausing_after_s0(engine: RolloutEngine, reqs: list[GenRequest], *,
                              pause_s: float) -> tuple[dict[str, GenResult], list[int]]:
    """Generate ``reqs`` (``s0`` first to finish); when ``s0`` comes back, pause the engine, and from another
    thread queue ``s3`` (4 new tokens, seed 9), hold the pause ``pause_s``, note how many results had come
    back by then, and resume. Returns the results by id and that count (a list of one)."""
    results: list[GenResult] = []
    during_pause: list[int] = []

    def resume_later() -> None:
        engine.submit([req(3, n=4, seed=9)])  # queued while paused, joins after resume
        threading.Event().wait(pause_s)
        during_pause.append(len(results))
        engine.resume()

    thread = None
    for res in engine.generate(reqs):
        results.append(res)
        if res.sample_id == "s0":
            engine.pause()
            thread = threading.Thread(target=resume_later)
            thread.start()
    assert thread is not None, "s0 never came back"
    thread.join()
    return by_id(results), during_pause


def test_pause_holds_generation_and_resume_continues_unchanged(make_engine):
    reqs = [req(0, n=2, seed=9), req(1, n=24, seed=9), req(2, n=24, seed=9)]
    baseline = {r.sample_id: r.response_ids for r in make_engine().generate(reqs)}
    got, during_pause = generate_pausing_after_s0(make_engine(), reqs, pause_s=0.05)
    assert during_pause == [1], "no sample may finish while paused"
    assert {k: got[k].response_ids for k in baseline} == baseline
    assert got["s3"].finish_reason == "length"


def test_stop_token_ends_sample_and_is_included(make_engine):
    engine = make_engine()
    (free,) = engine.generate([req(2, n=12, temperature=0.0)])
    # Pick the first token that has not occurred before it, so the stop point is unambiguous.
    k = next(i for i in range(2, 12) if free.response_ids[i] not in free.response_ids[:i])
    stop = free.response_ids[k]
    (stopped,) = engine.generate(
        [
            GenRequest(
                "t",
                free.prompt_ids,
                SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(stop,)),
            )
        ]
    )
    assert stopped.finish_reason == "stop"
    assert stopped.response_ids == free.response_ids[: k + 1]
    np.testing.assert_allclose(stopped.behav_logp, free.behav_logp[: k + 1], atol=1e-5, rtol=0)


def test_default_stop_tokens_are_the_engine_eos(make_engine):
    engine = make_engine()
    (free,) = engine.generate([req(3, n=10, temperature=0.0)])
    eos = free.response_ids[4]
    k = free.response_ids.index(eos)
    engine2 = make_engine(eos_token_ids=[eos])
    (stopped,) = engine2.generate(
        [GenRequest("t", free.prompt_ids, SamplingParams(max_new_tokens=10, temperature=0.0))]
    )
    assert stopped.finish_reason == "stop" and stopped.response_ids == free.response_ids[: k + 1]


def test_length_limit_is_respected_exactly(make_engine):
    engine = make_engine()
    results = by_id(list(engine.generate([req(i, n=n) for i, n in enumerate([1, 5, 17])])))
    assert [len(results[f"s{i}"].response_ids) for i in range(3)] == [1, 5, 17]
    assert all(r.finish_reason == "length" for r in results.values())


def generate_with_joiners(engine: RolloutEngine) -> dict[str, GenResult]:
    """``s0`` (3 new tokens) and ``s1`` (30) start; when ``s0`` comes back, ``s2`` (10) is submitted from the
    generating thread and ``from-thread`` (6) from another, both joining while ``s1`` is mid-generation
    (seed 4 throughout). Returns every result by id."""
    from_thread = GenRequest(
        "from-thread", PROMPTS[0], SamplingParams(max_new_tokens=6, seed=4, stop_token_ids=())
    )
    results = []
    for res in engine.generate([req(0, n=3, seed=4), req(1, n=30, seed=4)]):
        results.append(res)
        if res.sample_id == "s0":
            engine.submit([req(2, n=10, seed=4)])
            t = threading.Thread(target=engine.submit, args=([from_thread],))
            t.start()
            t.join()
    return by_id(results)


def test_requests_joining_mid_batch_match_their_solo_runs(make_engine, ref_v0, reference, logp_atol):
    solo = {r.sample_id: r.response_ids for r in make_engine().generate([req(2, n=10, seed=4)])}
    got = generate_with_joiners(make_engine(max_batch_size=8))
    assert set(got) == {"s0", "s1", "s2", "from-thread"}
    assert got["s2"].response_ids == solo["s2"]
    for res in got.values():
        ref = reference.plain(ref_v0, res.prompt_ids, res.response_ids, 1.0).numpy()
        np.testing.assert_allclose(res.behav_logp, ref, atol=logp_atol, rtol=0)


def test_close_aborts_live_samples_and_refuses_new_work(make_engine):
    engine = make_engine()
    results = []
    for res in engine.generate([req(0, n=2), req(1, n=100)]):
        results.append(res)
        if res.sample_id == "s0":
            engine.close()
    got = by_id(results)
    assert got["s1"].finish_reason == "abort"
    with pytest.raises(RuntimeError):
        engine.submit([req(2)])
    engine.close()  # idempotent


def test_poll_streams_every_result_once_without_generate(make_engine):
    """``poll`` is the streaming worker's loop: results of requests submitted at any time come out of it,
    each exactly once, with the versions of a weight update made between submissions."""
    engine = make_engine()
    assert engine.poll(0.0) == []  # idle: returns at once
    engine.submit([req(0, n=4), req(1, n=6)])
    got: list[GenResult] = []
    late = False
    while len(got) < 3:
        got += engine.poll(0.5)
        if not late and got:
            engine.submit([req(2, n=3)])  # joins while the engine streams
            late = True
    results = by_id(got)
    assert sorted(results) == ["s0", "s1", "s2"]
    for r in results.values():
        assert_well_formed(r)
        assert r.finish_reason == "length"
    assert engine.poll(0.0) == []
