"""The static, sync-free decode step: the same samples as the eager reference, static shapes, no host sync.

Two engines on the same weights, one with ``decode_step="static"`` and one with ``"eager"`` (the reference
path: ``DecoderRunner.decode`` + ``processed_logprobs`` + ``sample_tokens``), are driven through the same
sequence of step boundaries (joins, leaves, aborts, a weight swap, pause/resume, greedy, sampled and
truncated rows); their tokens must be equal and their behaviour log-probs bit-identical on exact shapes, within
1e-6 (+ 1e-6 relative: a few fp32 ulps) on padded buckets. The sampler alone is bit-identical to the reference.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from asyncrl.engine import GenRequest, SamplingParams
from asyncrl.engine.native.engine import NativeEngine
from asyncrl.engine.native.sampling import processed_logprobs, request_uniform, sample_static, sample_tokens
from asyncrl.engine.native.static_step import row_truncates
from asyncrl.engine.native.step_graphs import batch_bucket, batch_buckets, length_bucket, resolve_cuda_graphs


def ids(text: str) -> list[int]:
    return [1] + [4 + b for b in text.encode()]


def _sampling_case(B: int = 12, V: int = 50, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=gen) * 4
    temps = [0.0, 1.0, 0.7, 1.3] * (B // 4)
    top_k = [-1, 5, -1, 3, 7, -1] * (B // 6)
    top_p = [1.0, 1.0, 0.4, 0.9] * (B // 4)
    uniforms = [request_uniform(3, f"r{b}", b) for b in range(B)]
    uniforms[1], uniforms[2] = 0.0, 1.0 - 2**-53  # the edges of [0, 1)
    return logits, temps, top_k, top_p, uniforms


def _static_args(temps, top_k, top_p, uniforms, V):
    trunc = [row_truncates(t, k, p, V) for t, k, p in zip(temps, top_k, top_p, strict=True)]
    return (
        torch.tensor([t if t > 0 else 1.0 for t in temps], dtype=torch.float32),
        torch.tensor([t == 0 for t in temps]),
        torch.tensor(uniforms, dtype=torch.float64),
        torch.tensor([k if tr and k != -1 else V for k, tr in zip(top_k, trunc, strict=True)]),
        torch.tensor([p if tr else 1.0 for p, tr in zip(top_p, trunc, strict=True)], dtype=torch.float32),
        torch.tensor(trunc),
    )


@pytest.mark.parametrize("truncate", [False, True])
def test_sample_static_is_bitwise_sample_tokens(truncate):
    logits, temps, top_k, top_p, uniforms = _sampling_case()
    if not truncate:
        top_k, top_p = [-1] * len(temps), [1.0] * len(temps)
    V = logits.shape[1]
    logp = processed_logprobs(logits, temps, top_k, top_p)
    ref_tok, ref_lp = sample_tokens(logp, uniforms, [t == 0 for t in temps])
    temp, greedy, u, k, p, trunc = _static_args(temps, top_k, top_p, uniforms, V)
    extra = (k, p, trunc) if truncate else ()
    tok, lp = sample_static(logits, temp, greedy, u, *extra)
    assert torch.equal(tok, ref_tok)
    assert torch.equal(lp.view(torch.int32), ref_lp.view(torch.int32)), "bit-identical log-probs"
    if truncate:  # the truncated variant on rows that truncate nothing is the plain one
        none = torch.zeros_like(trunc)
        tok2, lp2 = sample_static(logits, temp, greedy, u, k, p, none)
        ref = sample_static(logits, temp, greedy, u)
        assert torch.equal(tok2, ref[0]) and torch.equal(lp2, ref[1])


def test_sample_static_dead_row_falls_back_to_the_last_token_with_mass():
    logits = torch.tensor([[1.0, 2.0, float("-inf"), float("-inf")]] * 2)
    one = torch.ones(2)
    tok, lp = sample_static(logits, one, torch.tensor([False, False]),
                            torch.tensor([1.0 - 2**-53, 0.0], dtype=torch.float64))
    assert tok.tolist() == [1, 0]
    ref_tok, ref_lp = sample_tokens(torch.log_softmax(logits, -1), [1.0 - 2**-53, 0.0], [False, False])
    assert torch.equal(tok, ref_tok) and torch.equal(lp, ref_lp)


def test_buckets_pad_batches_and_contexts():
    assert batch_buckets(32) == (1, 2, 4, 8, 16, 24, 32)
    assert batch_buckets(200) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 200)
    assert [batch_bucket(n, 32) for n in (1, 3, 5, 17, 25, 32)] == [1, 4, 8, 24, 32, 32]
    assert batch_bucket(3, 3) == 3
    assert [length_bucket(n, 300) for n in (1, 16, 17, 33, 257, 300)] == [16, 16, 32, 64, 300, 300]
    with pytest.raises(ValueError, match="does not fit"):
        length_bucket(301, 300)
    with pytest.raises(ValueError, match="1..32"):
        batch_bucket(33, 32)


def test_cuda_graph_choice_is_checked_against_the_device():
    cpu = torch.device("cpu")
    assert resolve_cuda_graphs("auto", cpu) is False and resolve_cuda_graphs("false", cpu) is False
    assert resolve_cuda_graphs("auto", torch.device("cuda")) is True  # no GPU needed to decide
    with pytest.raises(ValueError, match="rollout.cuda_graphs=auto"):
        resolve_cuda_graphs(True, cpu)
    with pytest.raises(ValueError, match="one of"):
        resolve_cuda_graphs("sometimes", cpu)


def _pair(tiny_hf, **kw):
    return (NativeEngine(copy.deepcopy(tiny_hf), decode_step="static", **kw),
            NativeEngine(copy.deepcopy(tiny_hf), decode_step="eager", **kw))


def _drain(engine, out):
    for r in engine.step():
        assert r.sample_id not in out
        out[r.sample_id] = r


def _scenario_requests():
    texts = ["1+2=", "What is 17+25? ", "9*9=", "3-8", "answer: ", "100/4=", "x", "12345+", "7*6=", "hi"]
    kinds = [dict(), dict(temperature=0.0), dict(top_k=5), dict(top_p=0.6, temperature=0.8),
             dict(temperature=0.7), dict(top_k=3, top_p=0.9)]
    return [GenRequest(f"r{i}", ids(t), SamplingParams(max_new_tokens=4 + (7 * i) % 13, stop_token_ids=(),
                                                       seed=i, **kinds[i % len(kinds)]))
            for i, t in enumerate(texts)]


@pytest.mark.parametrize("pad", [False, True], ids=["exact", "buckets"])
def test_static_step_matches_the_eager_path_through_joins_leaves_aborts_swaps_and_pauses(tiny_hf, tiny_hf_v1, pad):
    engines = _pair(tiny_hf, max_batch_size=5, max_prefill_tokens=12)
    engines[0]._static.pad = pad  # buckets: padded rows and spans, as under CUDA graphs
    assert [e.capabilities()["decode_step"] for e in engines] == ["static", "eager"]
    reqs = _scenario_requests()
    outs: list[dict] = [{}, {}]
    for engine, out in zip(engines, outs, strict=True):
        engine.submit(reqs[:7])
        for k in range(40):
            if k == 3:
                engine.abort(["r1"])
            if k == 5:
                engine.update_weights(1, tiny_hf_v1.state_dict())
                engine.submit(reqs[7:])
            if k == 8:
                engine.pause()
            if k == 10:
                engine.resume()
            _drain(engine, out)
        while engine.has_work():
            _drain(engine, out)
        engine.close()
    static, eager = outs
    assert sorted(static) == sorted(eager) == sorted(r.sample_id for r in reqs)
    assert static["r1"].finish_reason == "abort"
    assert {1} <= set(np.concatenate([r.versions for r in static.values()]).tolist())
    for sid, ref in eager.items():
        got = static[sid]
        assert got.response_ids == ref.response_ids, sid
        assert got.versions.tolist() == ref.versions.tolist()
        if not pad:  # the same ops on the same shapes: bit for bit
            assert got.behav_logp.tobytes() == ref.behav_logp.tobytes(), sid
        # buckets: padded rows and a longer span change the GEMM and SDPA blocking (~1e-7 in the logits),
        # which the K/V cache carries from step to step: a few fp32 ulps
        np.testing.assert_allclose(got.behav_logp, ref.behav_logp, atol=1e-6, rtol=1e-6)


_SYNC_OPS = ("_local_scalar_dense", "nonzero", "item")


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shapes = tuple((tuple(a.shape), a.dtype) for a in args if isinstance(a, torch.Tensor))
        self.ops.append((str(func.overloadpacket.__name__), shapes))
        return out


def _live_engine(tiny_hf, n: int = 3, layers: int | None = None, **kw) -> NativeEngine:
    model = copy.deepcopy(tiny_hf)
    if layers is not None:  # fewer layers: the same ops, less for a compiler to build
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
    engine = NativeEngine(model, max_batch_size=8, decode_step="static", **kw)
    engine.submit([GenRequest(f"g{i}", ids("12+3" * (i + 1)), SamplingParams(max_new_tokens=40, top_k=4,
                                                                             stop_token_ids=(), seed=i))
                   for i in range(n)])
    engine.step()  # admission: prefill, rows live
    engine.step()
    engine._runner.cache.reserve(n, 32, torch.float32, torch.device("cpu"))  # room for a 32-position span
    return engine


def test_the_step_makes_no_host_sync_and_repeats_the_same_ops_at_every_position(tiny_hf):
    engine = _live_engine(tiny_hf)
    st = engine._static
    st.pad = True
    logs = []
    for _ in range(2):
        with _OpLog() as log:
            st.decode(3, 31, True)  # the same bucket (4 rows, 32 positions), positions move on
        logs.append(log.ops)
    names = {name for name, _ in logs[0]}
    assert not names & set(_SYNC_OPS), sorted(names & set(_SYNC_OPS))
    assert "index_put_" in names and any("attention" in n for n in names), sorted(names)
    assert logs[0] == logs[1], "a step of one bucket is the same (op, shape, dtype) sequence every time"
    engine.close()


def test_bucket_runners_warm_up_once_replay_after_and_are_dropped_when_the_cache_grows(tiny_hf):
    engine = NativeEngine(copy.deepcopy(tiny_hf), max_batch_size=4, decode_step="static")
    assert not engine._static.pad, "a CPU engine without graphs or compile runs exact shapes"
    engine._static.pad = True  # the bucket path CUDA graphs take, here with eager runners
    engine.submit([GenRequest("a", ids("1"), SamplingParams(max_new_tokens=60, stop_token_ids=(), seed=1))])
    for _ in range(12):
        engine.step()
    graphs = engine._static.graphs
    assert graphs.warmups == 1 and graphs.replays == 10  # one key (1 row, 16 positions) after the prefill
    assert list(graphs.runners) == [(1, 16, False)]
    gen = engine._runner.cache.generation
    while engine.has_work():
        engine.step()
    assert engine._runner.cache.generation > gen, "the cache grew past 16 positions"
    assert set(graphs.runners) == {(1, 62, False)}, "older runners were dropped with the storage"
    stats = engine.step_stats()  # what a benchmark reads around a timed run
    assert stats["bucketed"] and stats["builds"] == graphs.warmups and stats["replays"] == graphs.replays
    assert stats["drops"] == graphs.warmups - 1, "every runner built before the last growth was dropped"
    assert stats["captures"] == 0, "nothing is captured off CUDA"
    assert stats["kv_allocations"] == engine._runner.cache.generation and stats["kv_capacity"] == 62
    engine.close()


def test_cuda_graphs_true_is_refused_on_a_cpu_engine(tiny_hf):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        NativeEngine(copy.deepcopy(tiny_hf), cuda_graphs="true")
    with pytest.raises(ValueError, match="decode_step"):
        NativeEngine(copy.deepcopy(tiny_hf), decode_step="fast")
    assert NativeEngine(copy.deepcopy(tiny_hf), cuda_graphs="auto").capabilities()["cuda_graphs"] is False


def test_step_body_compiles_as_one_graph_and_matches_eager(tiny_hf):
    """``torch.compile(fullgraph=True)`` (inductor, C++ on a CPU) of the step body: no graph break, same samples."""
    import torch._dynamo

    engine = _live_engine(tiny_hf, layers=1)
    st = engine._static
    with torch.inference_mode():
        state = {name: getattr(st, name).clone() for name in ("tok", "pos", "u")}
        kv = st.cache.kv.clone()
        st.body(4, 32, True)
        eager_out, eager_tok = st.out.clone(), st.tok.clone()

        def restore() -> None:
            for name, value in state.items():
                getattr(st, name).copy_(value)
            st.cache.kv.copy_(kv)

        restore()
        explained = torch._dynamo.explain(st.body)(4, 32, True)
        assert explained.graph_break_count == 0, explained.break_reasons
        restore()
        torch._dynamo.reset()
        torch.compile(st.body, fullgraph=True, dynamic=False)(4, 32, True)
    assert torch.equal(st.out[0, :3], eager_out[0, :3]) and torch.equal(st.tok, eager_tok)
    torch.testing.assert_close(st.out[1, :3], eager_out[1, :3], atol=1e-6, rtol=0)
    engine.close()


def test_compiled_step_in_the_engine_gives_the_static_samples(tiny_hf):
    """``compile_step=True`` end to end (dynamo's ``eager`` backend keeps it quick; inductor is tested above)."""
    reqs = _scenario_requests()[:4]
    ref = {r.sample_id: r for r in NativeEngine(copy.deepcopy(tiny_hf), max_batch_size=4).generate(reqs)}
    import torch._dynamo

    torch._dynamo.reset()
    engine = NativeEngine(copy.deepcopy(tiny_hf), max_batch_size=4, compile_step="eager")
    got = {r.sample_id: r for r in engine.generate(reqs)}
    for sid, r in ref.items():
        assert got[sid].response_ids == r.response_ids
        np.testing.assert_allclose(got[sid].behav_logp, r.behav_logp, atol=1e-6, rtol=0)
    engine.close()


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int8_wo", "fp8", "nvfp4", "mxfp4"])
def test_a_publication_load_keeps_every_parameter_and_buffer_where_it_was(tiny_hf, tiny_hf_v1, fmt):
    """Captured CUDA graphs read weights by address: a load must copy into the same storage."""
    from asyncrl.engine.native.step_graphs import tensor_pointers
    from asyncrl.quant import publish

    engine = NativeEngine(copy.deepcopy(tiny_hf), quant_format=fmt, max_batch_size=2)
    engine.submit([GenRequest("a", ids("1+1="), SamplingParams(max_new_tokens=6, stop_token_ids=()))])
    engine.step()
    engine.step()
    named = [*engine._model.named_parameters(), *engine._model.named_buffers()]
    before = {name: t.data_ptr() for name, t in named}
    values = {name: t.detach().clone() for name, t in named}
    engine.update_weights(1, publish(tiny_hf_v1.state_dict(), fmt, version=1))
    engine.step()
    assert engine.version == 1
    after = {name: t.data_ptr() for name, t in [*engine._model.named_parameters(), *engine._model.named_buffers()]}
    assert after == before
    assert any(not torch.equal(t, values[name]) for name, t in named), "the load changed the weights"
    assert tensor_pointers(engine._model) == engine.weights.swap.pointers
    engine.close()


def test_a_load_that_moves_a_parameter_drops_the_bucket_runners(tiny_hf, caplog):
    engine = NativeEngine(copy.deepcopy(tiny_hf), max_batch_size=2)
    engine._static.pad = True
    engine.submit([GenRequest("a", ids("1+1="), SamplingParams(max_new_tokens=8, stop_token_ids=()))])
    engine.step()
    engine.step()
    assert engine._static.graphs.runners
    with torch.no_grad():
        weight = engine._model.model.norm.weight
        weight.data = weight.data.clone()  # what a load that reallocates leaves behind
    with caplog.at_level("WARNING"):
        engine.weights.swap.check_pointers(engine._model, engine._static)
    assert not engine._static.graphs.runners and "rebuilt" in caplog.text
    (res,) = engine.generate()
    assert len(res.response_ids) == 8
    engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replays_give_the_eager_static_samples_without_a_host_sync(tiny_hf):
    """GPU only: graphs on vs off on the same device, same samples; a replayed step never syncs."""
    reqs = _scenario_requests()
    outs = []
    for graphs in ("true", "false"):
        engine = NativeEngine(copy.deepcopy(tiny_hf), device="cuda", max_batch_size=5, cuda_graphs=graphs,
                              compile_step="false")
        assert engine.capabilities()["cuda_graphs"] is (graphs == "true")
        outs.append({r.sample_id: r for r in engine.generate(reqs)})
        if graphs == "true":
            assert engine._static.graphs.captures >= 1 and engine._static.graphs.replays >= 1
            engine.submit([GenRequest("s", ids("1+1="), SamplingParams(max_new_tokens=30, stop_token_ids=()))])
            engine.step()
            engine.step()
            st = engine._static
            torch.cuda.set_sync_debug_mode("error")
            try:
                st.upload([], [], [0.5])
                st.decode(1, engine._active[0].cache_len, False)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        engine.close()
    for sid, ref in outs[1].items():
        assert outs[0][sid].response_ids == ref.response_ids
        np.testing.assert_allclose(outs[0][sid].behav_logp, ref.behav_logp, atol=1e-6, rtol=1e-6)


def test_forward_aqn_steps_run_eagerly_and_the_static_step_takes_over_again(tiny_hf, caplog):
    """A forward-AQN version decodes on the eager path; the next version's steps are static again, and the
    rows' device state is rebuilt from the host: the samples equal an all-eager engine's, bit for bit."""
    from asyncrl.quant import publish

    sd = tiny_hf.state_dict()
    noisy = publish(sd, "fp32", version=1, aqn_sigma=0.05, aqn_seed=9, aqn_resample="forward")
    clean = publish(sd, "fp32", version=2)
    reqs = _scenario_requests()[:4]
    outs = []
    for engine in _pair(tiny_hf, max_batch_size=4):
        out: dict = {}
        static_steps: list[int] = []  # the boundary of every static step body run
        at = [0]
        if engine._static is not None:
            body = engine._static.body

            def spy(*key, _body=body, _steps=static_steps, _at=at):
                _steps.append(_at[0])
                return _body(*key)

            engine._static.body = spy
        engine.submit(reqs)
        for k in range(30):
            at[0] = k
            if k == 3:
                engine.update_weights(1, noisy)
            if k == 6:
                engine.update_weights(2, clean)
            with caplog.at_level("INFO"):
                _drain(engine, out)
        while engine.has_work():
            _drain(engine, out)
        outs.append(out)
        if engine._static is not None:
            assert "eager decode path" in caplog.text
            assert {1, 2} <= set(static_steps) and not {3, 4, 5} & set(static_steps) and 6 in static_steps
        engine.close()
    for sid, ref in outs[1].items():
        assert outs[0][sid].response_ids == ref.response_ids
        assert outs[0][sid].versions.tolist() == ref.versions.tolist()
        assert outs[0][sid].behav_logp.tobytes() == ref.behav_logp.tobytes()
    assert {1, 2} <= set(np.concatenate([r.versions for r in outs[0].values()]).tolist())
