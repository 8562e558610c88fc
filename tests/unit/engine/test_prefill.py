"""Admission prefill: every row a step admits is prefilled in one forward, and nothing in it syncs with the host.

A step that admits rows runs ``DecoderRunner.prefill`` once for all of them (right-padded to the longest
prompt, causal + padding mask), then samples their first tokens with the rest of the step. These tests drive
admissions of several rows of different prompt lengths (1 token and the longest of the step among them) into
a batch of rows that are decoding, on the static step and on the eager reference path, and check:

* each row's tokens equal those of the same request run alone (its own one-row prefill), and its behaviour
  log-probs agree within 1e-6 (+ 1e-6 relative), a few fp32 ulps: a batch of padded prompts changes the GEMM
  and attention shapes, hence the summation order, so the logits differ in their last bits (the K/V cache
  carries that on to later tokens); bit equality with a one-row prefill cannot hold. The worst difference
  measured on these cases is 4.8e-7 (4 ulps of a log-prob near -2), on both paths and on padded buckets;
* the static and the eager path agree bit for bit on the same admissions (same shapes, same ops), and a rerun
  is bitwise identical (per-request seeded streams);
* the prefill of an admitting step issues none of the host-sync ops, uploads the prompts in one non-blocking
  copy, and runs the same ops whether it admits one row or four (one forward for all of them).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from asyncrl.engine import GenRequest, SamplingParams
from asyncrl.engine.native.engine import NativeEngine

_SYNC_OPS = ("_local_scalar_dense", "nonzero", "item")  # as in test_static_step.py
STEPS = ("static", "eager")
LOGP_ATOL = LOGP_RTOL = 1e-6


def ids(text: str) -> list[int]:
    return [1] + [4 + b for b in text.encode()]


def _req(sid: str, prompt: list[int], seed: int, tokens: int = 12, **kw) -> GenRequest:
    return GenRequest(sid, prompt, SamplingParams(max_new_tokens=tokens, stop_token_ids=kw.pop("stop", ()),
                                                  seed=seed, **kw))


def _live() -> list[GenRequest]:
    """Two rows that are decoding when the others join."""
    return [_req("live0", ids("12+3="), 10, tokens=20), _req("live1", ids("What is 9*9? "), 11, tokens=20,
                                                              temperature=0.8)]


def _joining() -> list[GenRequest]:
    """Four rows admitted in one step: prompt lengths 1, 5, 3 and 17 (the longest); greedy, plain sampled,
    top-k and top-p rows."""
    return [
        _req("one", [1], 0, temperature=0.0),
        _req("five", ids("7*6="), 1),
        _req("three", ids("hi"), 2, top_k=5),
        _req("long", ids("a much longer one"), 3, top_p=0.7, temperature=0.9),
    ]


class _OpLog(TorchDispatchMode):
    """Every aten op run, with ``copy_``'s ``non_blocking`` flag; ``mark`` adds a named boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, bool | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func.overloadpacket.__name__)
        flag = kwargs.get("non_blocking", args[2] if len(args) > 2 else False) if name == "copy_" else None
        self.ops.append((name, flag))
        return out

    def mark(self, what: str) -> None:
        self.ops.append((what, None))

    def between(self, start: str, end: str) -> list[tuple[str, bool | None]]:
        names = [name for name, _ in self.ops]
        return self.ops[names.index(start) + 1 : names.index(end)]


@contextmanager
def _prefills(engine: NativeEngine, log: _OpLog | None = None) -> Iterator[list[int]]:
    """Count the runner's prefill forwards (the number of prompts of each); mark them in ``log``."""
    runner = engine._runner
    real = runner.prefill
    calls: list[int] = []

    def spy(row0, prompts, live_rows):
        calls.append(len(prompts))
        if log is not None:
            log.mark("<prefill")
        out = real(row0, prompts, live_rows)
        if log is not None:
            log.mark(">prefill")
        return out

    runner.prefill = spy
    try:
        yield calls
    finally:
        del runner.prefill


def _engine(tiny_hf, decode_step: str, **kw) -> NativeEngine:
    return NativeEngine(copy.deepcopy(tiny_hf), max_batch_size=8, decode_step=decode_step, **kw)


def _drain(engine: NativeEngine, out: dict) -> None:
    for r in engine.step():
        assert r.sample_id not in out
        out[r.sample_id] = r


def _admitting(tiny_hf, decode_step: str, joining: list[GenRequest], *, aborts_queued=(), aborts_after=(),
               pad: bool = False) -> tuple[dict, list[int]]:
    """Two live rows decode for two steps, then ``joining`` is submitted and admitted in one step (``aborts_queued``
    aborted before it, ``aborts_after`` right after it); run to the end. Returns the results and the number of
    prompts of each prefill forward of the admitting step."""
    engine = _engine(tiny_hf, decode_step)
    if engine._static is not None:
        engine._static.pad = pad
    out: dict = {}
    engine.submit(_live())
    _drain(engine, out)
    _drain(engine, out)
    engine.submit(joining)
    engine.abort(list(aborts_queued))
    with _prefills(engine) as calls:
        _drain(engine, out)
    admitted = [r.sample_id for r in joining if r.sample_id not in aborts_queued]
    assert engine.num_active + sum(sid in out for sid in admitted) == 2 + len(admitted), "all joined in one step"
    engine.abort(list(aborts_after))
    while engine.has_work():
        _drain(engine, out)
    engine.close()
    return out, calls


def _alone(tiny_hf, decode_step: str, requests: list[GenRequest]) -> dict:
    """Each request in an engine of its own: a one-row prefill, then decoding alone."""
    out = {}
    for req in requests:
        engine = _engine(tiny_hf, decode_step)
        (out[req.sample_id],) = engine.generate([req])
        engine.close()
    return out


def _assert_same_samples(got, ref) -> None:
    assert got.response_ids == ref.response_ids, got.sample_id
    np.testing.assert_allclose(got.behav_logp, ref.behav_logp, atol=LOGP_ATOL, rtol=LOGP_RTOL)


@pytest.mark.parametrize("decode_step", STEPS)
def test_rows_admitted_in_one_step_sample_what_each_samples_alone(tiny_hf, decode_step):
    joining = _joining()
    out, calls = _admitting(tiny_hf, decode_step, joining)
    assert calls == [4], "one prefill forward for the four rows the step admits"
    ref = _alone(tiny_hf, decode_step, _live() + joining)
    assert sorted(out) == sorted(ref)
    for sid, r in ref.items():
        assert out[sid].finish_reason == r.finish_reason == "length"
        _assert_same_samples(out[sid], r)
    greedy = out["one"]
    assert greedy.response_ids == ref["one"].response_ids and len(greedy.response_ids) == 12


def test_admission_is_bitwise_the_same_on_both_paths_and_across_runs(tiny_hf):
    """Same shapes, same ops: the static step equals the eager path bit for bit, and so does a rerun."""
    joining = _joining()
    static, _ = _admitting(tiny_hf, "static", joining)
    again, _ = _admitting(tiny_hf, "static", joining)
    eager, _ = _admitting(tiny_hf, "eager", joining)
    for sid, ref in eager.items():
        for got in (static[sid], again[sid]):
            assert got.response_ids == ref.response_ids, sid
            assert got.behav_logp.tobytes() == ref.behav_logp.tobytes(), sid


def test_admission_into_padded_buckets_samples_what_each_samples_alone(tiny_hf):
    """The bucketed static step (padded rows and spans, as under CUDA graphs) around the same admission."""
    joining = _joining()
    out, calls = _admitting(tiny_hf, "static", joining, pad=True)
    assert calls == [4]
    for sid, r in _alone(tiny_hf, "static", _live() + joining).items():
        _assert_same_samples(out[sid], r)


@pytest.mark.parametrize("decode_step", STEPS)
def test_a_row_that_stops_on_its_first_token_leaves_and_the_others_go_on(tiny_hf, decode_step):
    """The first admitted row stops on its first token: it is returned from the admitting step and the last
    row moves into its cache row; every other row samples what it samples alone."""
    joining = _joining()
    first = _alone(tiny_hf, decode_step, [_req("stops", ids("7*6="), 1, temperature=0.0)])["stops"].response_ids[0]
    stopper = _req("stops", ids("7*6="), 1, temperature=0.0, stop=(first,))  # greedy: its first token is known
    joining = [stopper, *joining[:1], *joining[2:]]
    engine = _engine(tiny_hf, decode_step)
    out: dict = {}
    engine.submit(_live())
    _drain(engine, out)
    _drain(engine, out)
    engine.submit(joining)
    with _prefills(engine) as calls:
        finished = engine.step()
    assert calls == [4]
    assert [r.sample_id for r in finished] == ["stops"]
    assert finished[0].finish_reason == "stop" and finished[0].response_ids == [first]
    assert engine.num_active == 5
    out["stops"] = finished[0]
    while engine.has_work():
        _drain(engine, out)
    engine.close()
    for sid, r in _alone(tiny_hf, decode_step, _live() + joining[1:]).items():
        _assert_same_samples(out[sid], r)


@pytest.mark.parametrize("decode_step", STEPS)
def test_aborts_around_admission(tiny_hf, decode_step):
    """One queued request aborted before the step that admits the others (never prefilled, no tokens), one
    aborted right after its admission (its first token kept); the rest sample what they sample alone."""
    joining = _joining()
    out, calls = _admitting(tiny_hf, decode_step, joining, aborts_queued=("five",), aborts_after=("three",))
    assert calls == [3], "the aborted request is not prefilled"
    assert out["five"].finish_reason == "abort" and out["five"].response_ids == []
    assert out["three"].finish_reason == "abort" and len(out["three"].response_ids) == 1
    ref = _alone(tiny_hf, decode_step, _live() + joining)
    assert out["three"].response_ids == ref["three"].response_ids[:1]
    for sid in ("live0", "live1", "one", "long"):
        _assert_same_samples(out[sid], ref[sid])


def _admitting_step_ops(tiny_hf, decode_step: str, k: int, pad: bool = False) -> _OpLog:
    """The ops of one step that admits the first ``k`` of the joining rows while two rows decode."""
    engine = _engine(tiny_hf, decode_step)
    if engine._static is not None:
        engine._static.pad = pad
    engine.submit(_live())
    engine.step()
    engine.step()
    engine.submit(_joining()[::-1][:k])  # the longest, truncating row first: one truncation variant for 1 and 4
    with _OpLog() as log, _prefills(engine, log) as calls:
        engine.step()
    assert calls == [k] and engine.num_active == 2 + k
    engine.close()
    return log


@pytest.mark.parametrize("pad", [False, True], ids=["exact", "buckets"])
def test_an_admitting_static_step_makes_no_host_sync_and_one_forward_for_all_rows(tiny_hf, pad):
    """The whole step (upload, decode of the live rows, prefill, sampling of the joined rows) up to its one
    fetch: no host-sync op; the prompts go up in one non-blocking copy; admitting four rows runs exactly the
    ops of admitting one."""
    logs = {k: _admitting_step_ops(tiny_hf, "static", k, pad) for k in (1, 4)}
    layers = tiny_hf.config.num_hidden_layers
    for k, log in logs.items():
        names = [name for name, _ in log.ops]
        assert not set(names) & set(_SYNC_OPS), (k, sorted(set(names) & set(_SYNC_OPS)))
        prefill = log.between("<prefill", ">prefill")
        assert [flag for name, flag in prefill if name == "copy_" and flag] == [True], "one non-blocking upload"
        assert not {"lift_fresh", "lift_fresh_copy"} & {name for name, _ in prefill}, "no tensor from host data"
        assert sum("attention" in name for name, _ in prefill) == layers, "one forward"
    assert [n for n, _ in logs[1].ops] == [n for n, _ in logs[4].ops], "the same ops for one row as for four"


@pytest.mark.parametrize("fmt", ["bf16", "int8", "fp8", "nvfp4"])
def test_an_admitting_static_step_of_a_quantized_actor_makes_no_host_sync(tiny_hf, fmt):
    """The prefill runs the quantized linears on ``[rows, L, D]`` inputs (the decode step on ``[rows, 1, D]``)."""
    engine = _engine(tiny_hf, "static", quant_format=fmt)
    engine.submit(_live())
    engine.step()
    engine.step()
    engine.submit(_joining())
    with _OpLog() as log, _prefills(engine, log) as calls:
        engine.step()
    assert calls == [4] and engine.num_active == 6
    names = {name for name, _ in log.ops}
    assert not names & set(_SYNC_OPS), sorted(names & set(_SYNC_OPS))
    engine.close()


def test_the_eager_path_prefills_without_a_host_sync_too(tiny_hf):
    """The reference path shares the prefill: no host-sync op in it, one upload, the same ops for 1 and 4 rows
    (its sampler, the reference, reads the device on purpose)."""
    prefills = {k: _admitting_step_ops(tiny_hf, "eager", k).between("<prefill", ">prefill") for k in (1, 4)}
    for ops in prefills.values():
        assert not {name for name, _ in ops} & set(_SYNC_OPS)
        assert [flag for name, flag in ops if name == "copy_" and flag] == [True]
    assert [n for n, _ in prefills[1]] == [n for n, _ in prefills[4]]


def test_the_hf_fallback_prefill_reads_nothing_back_from_the_device():
    """The fallback runner's own prefill code (the model's forward aside) makes no host sync: lengths, the padded
    width and the logits kept come from the host, in one upload."""
    from asyncrl.engine.native.hf_runner import HFRunner
    from asyncrl.models.families import build_family_model

    model = build_family_model("mixtral")
    runner = HFRunner(copy.deepcopy(model), 4, 64)
    prompts = [ids("12+7="), [1], ids("What is 3*4? "), ids("a")]
    forward = runner._forward

    def spy(*args):
        log.mark("<model")
        out = forward(*args)
        log.mark(">model")
        return out

    runner._forward = spy
    with _OpLog() as log:
        logits = runner.prefill(0, prompts, 4)
    names = [name for name, _ in log.ops]
    model_ops = names[names.index("<model") : names.index(">model") + 1]
    own = names[: names.index("<model")] + names[names.index(">model") + 1 :]
    assert model_ops and not set(own) & set(_SYNC_OPS), sorted(set(own) & set(_SYNC_OPS))
    assert [flag for name, flag in log.ops if name == "copy_" and flag] == [True]
    # the logits of each row's last prompt token: those of the row prefilled alone
    for i, p in enumerate(prompts):
        alone = HFRunner(copy.deepcopy(model), 1, 64).prefill(0, [p], 1)
        torch.testing.assert_close(logits[i : i + 1], alone, rtol=0, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_an_admitting_step_on_a_gpu_syncs_only_in_its_fetch(tiny_hf):
    """GPU only: CUDA's sync debug mode raises on any synchronising call (a pageable copy, ``.item()``) made by
    a step that decodes two rows and admits four, up to its one fetch."""
    engine = NativeEngine(copy.deepcopy(tiny_hf), device="cuda", max_batch_size=8, cuda_graphs="false",
                          compile_step="false")
    engine.submit(_live())
    engine.step()
    engine.step()
    engine.submit(_joining())
    st = engine._static
    fetch = st.fetch_wait  # where a step's results are waited on (the step before, with overlap, or its own)

    def fetch_may_sync(slot, n):
        torch.cuda.set_sync_debug_mode("default")
        return fetch(slot, n)

    st.fetch_wait = fetch_may_sync
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert engine.num_active == 6
    engine.close()
