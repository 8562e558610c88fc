"""SGLangEngine payloads and error paths, WITHOUT SGLang.

The server here is ``FaultInjectionStub``: a stdlib ``http.server`` in a thread that records what the
adapter sends and answers with canned bodies shaped like SGLang 0.5.23's (or with faults on purpose). It is
not SGLang and proves nothing about SGLang's behaviour; tests/sglang/ runs the contract against the real one.
"""

from __future__ import annotations

import base64
import copy
import json
import pickle
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from asyncrl.engine import GenRequest, RolloutEngine, SamplingParams
from asyncrl.engine.base import EngineClosedError
from asyncrl.engine.sglang.engine import SGLangEngine
from asyncrl.engine.sglang.http import SGLangHTTP, SGLangRequestError, SGLangUnavailableError, parse_base_url
from asyncrl.engine.sglang.requests import parse_generate_output, request_seed
from asyncrl.engine.sglang.server import cpu_env, server_command
from asyncrl.engine.sglang.weights import chunk_update, prepare_update, tensor_bodies

WAIT_S = 60.0
"""Bounds a wait for something the adapter's threads do at once (a hang guard, never a speed claim)."""
RELEASE_GUARD_S = 60.0


def wait_until(condition, what: str, timeout_s: float = WAIT_S) -> None:
    """Poll ``condition()`` until it holds; fail naming ``what`` if it never does within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(0.01)


class FaultInjectionStub:
    """Threaded HTTP server answering like SGLang's native API; ``faults[path]`` overrides an answer with
    ``(status, body_bytes)``, ``"hang"`` (no answer until ``unhang`` is set, or ``hang_s`` passed: a guard) or
    ``"drop"`` (close the socket). A ``/generate`` waits for ``release`` (set by default; ``RELEASE_GUARD_S``
    only bounds a test that never sets it again)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.faults: dict[str, object] = {}
        self.hang_s = 2.0
        self.unhang = threading.Event()
        self.hangs_ended = 0
        self.version = "default"
        self.model_path = "/m"
        self.gen_delay_s = 0.0
        self.release = threading.Event()
        self.release.set()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _handle(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                payload = json.loads(self.rfile.read(n) or b"{}") if n else {}
                stub.calls.append((self.path, payload))
                fault = stub.faults.get(self.path)
                if fault == "hang":
                    stub.unhang.wait(stub.hang_s)
                    stub.hangs_ended += 1
                    return
                if fault == "drop":
                    self.close_connection = True
                    self.connection.close()
                    return
                if isinstance(fault, tuple):
                    self._answer(*fault)
                    return
                self._answer(200, json.dumps(stub.answer(self.path, payload)).encode())

            do_GET = do_POST = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def answer(self, path: str, payload: dict) -> object:
        if path == "/model_info":
            return {"model_path": self.model_path, "is_generation": True, "weight_version": self.version}
        if path == "/server_info":
            return {"device": "cpu", "tp_size": 1, "enable_deterministic_inference": False}
        if path == "/update_weight_version":
            self.version = payload["new_version"]
            return {"success": True}
        if path == "/generate":
            self.release.wait(RELEASE_GUARD_S)
            time.sleep(self.gen_delay_s)
            n = payload["sampling_params"]["max_new_tokens"]
            ids = [(7 * i + len(payload["input_ids"])) % 200 + 4 for i in range(n)]
            return {
                "output_ids": ids,
                "meta_info": {
                    "finish_reason": {"type": "length", "length": n},
                    "output_token_logprobs": [[-0.5 - 0.01 * i, t, None] for i, t in enumerate(ids)],
                    "weight_versions": [{"version": self.version, "start": 0, "end": n}],
                },
            }
        if path in ("/update_weights_from_tensor", "/update_weights_from_disk"):
            self.version = payload.get("weight_version", self.version)
        return {"success": True, "message": "ok"}

    def paths(self) -> list[str]:
        return [p for p, _ in self.calls]

    def close(self) -> None:
        self.unhang.set()  # no handler thread outlives the test waiting on its guard
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    s = FaultInjectionStub()
    yield s
    s.close()


def req(i: int, n: int = 3, **kw) -> GenRequest:
    return GenRequest(f"s{i}", [1, 5, 6 + i], SamplingParams(max_new_tokens=n, **kw))


def test_url_parsing_rejects_paths_and_other_schemes():
    assert parse_base_url("127.0.0.1:30000") == ("127.0.0.1", 30000)
    for bad in ("https://h:1", "http://h:1/generate", "http://:5"):
        with pytest.raises(ValueError, match="SGLang url"):
            parse_base_url(bad)


def test_server_down_raises_unavailable_naming_the_fix():
    from asyncrl.engine.sglang.server import free_port

    http = SGLangHTTP(f"http://127.0.0.1:{free_port()}", timeout_s=2)
    with pytest.raises(SGLangUnavailableError, match="start one"):
        http.get("/model_info")
    with pytest.raises(SGLangUnavailableError):
        SGLangEngine(http.base_url)


def test_timeout_raises_instead_of_hanging(stub):
    # The server answers nothing until the test lets it (hang_s only guards a broken run): the error can
    # only come from the client's own 0.2 s timeout, whatever the machine's speed.
    stub.faults["/model_info"] = "hang"
    stub.hang_s = 600.0
    with pytest.raises(SGLangUnavailableError, match="did not answer"):
        SGLangHTTP(stub.url, timeout_s=0.2).get("/model_info")
    assert stub.hangs_ended == 0, "the client waited for the server instead of its own timeout"
    stub.unhang.set()


@pytest.mark.parametrize("status", [400, 404, 500, 503])
def test_error_status_raises_request_error_with_body(stub, status):
    stub.faults["/model_info"] = (status, b'{"error": "boom"}')
    with pytest.raises(SGLangRequestError, match=f"HTTP {status}.*boom") as info:
        SGLangHTTP(stub.url).get("/model_info")
    assert info.value.status == status


def test_malformed_json_and_dropped_connection_are_reported(stub):
    stub.faults["/model_info"] = (200, b"<html>not json</html>")
    with pytest.raises(SGLangRequestError, match="not JSON"):
        SGLangHTTP(stub.url).get("/model_info")
    stub.faults["/model_info"] = "drop"
    with pytest.raises(SGLangUnavailableError):
        SGLangHTTP(stub.url).get("/model_info")


def test_attach_sets_version_and_generate_payload_is_sglang_native(stub):
    engine = SGLangEngine(stub.url, version=5, eos_token_ids=[2])
    assert isinstance(engine, RolloutEngine)
    assert ("/update_weight_version", {"new_version": "5", "abort_all_requests": False}) in stub.calls
    (res,) = engine.generate([req(0, n=4, temperature=0.7, top_k=20, top_p=0.9, seed=3)])
    body = next(p for path, p in stub.calls if path == "/generate")
    assert body["input_ids"] == [1, 5, 6] and body["return_logprob"] is True
    assert body["rid"].endswith("-2:s0")  # length-prefixed: SGLang aborts rids by prefix
    assert body["sampling_params"] == {
        "max_new_tokens": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "sampling_seed": request_seed(3, "s0"),
        "ignore_eos": True,
    }  # the stub's model folder is unreadable from here, so the stop set is applied client-side
    assert res.versions.tolist() == [5] * 4 and res.behav_logp.dtype == np.float32
    assert res.finish_reason == "length" and res.timings["total_s"] >= 0
    engine.close()


def test_default_stop_leaves_eos_to_the_server_and_explicit_empty_stop_disables_it(stub):
    engine = SGLangEngine(stub.url)
    engine.generate([req(0), req(1, stop_token_ids=())]).__next__()
    list(engine.generate())
    bodies = {p["rid"][-2:]: p["sampling_params"] for path, p in stub.calls if path == "/generate"}
    assert "ignore_eos" not in bodies["s0"] and "stop_token_ids" not in bodies["s0"]
    assert bodies["s1"]["ignore_eos"] is True and "stop_token_ids" not in bodies["s1"]
    engine.close()


def test_stop_set_with_model_eos_goes_to_server_and_other_sets_are_cut_client_side(stub, tmp_path):
    (tmp_path / "config.json").write_text('{"eos_token_id": 2}')
    stub.model_path = str(tmp_path)
    engine = SGLangEngine(stub.url, eos_token_ids=[2, 30])
    first = stub.answer("/generate", {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 6}})
    stop = first["output_ids"][2]
    got = {r.sample_id: r for r in engine.generate([req(0, n=6), req(1, n=6, stop_token_ids=(stop,))])}
    bodies = {p["rid"][-2:]: p["sampling_params"] for path, p in stub.calls if path == "/generate"}
    assert bodies["s0"]["stop_token_ids"] == [2, 30] and "ignore_eos" not in bodies["s0"]
    assert bodies["s1"]["ignore_eos"] is True
    assert got["s1"].response_ids == first["output_ids"][:3] and got["s1"].finish_reason == "stop"
    assert got["s1"].behav_logp.shape == (3,) and got["s1"].versions.shape == (3,)
    engine.close()


def test_request_seeds_differ_per_sample_and_are_stable():
    assert request_seed(0, "a") == request_seed(0, "a") != request_seed(0, "b") != request_seed(1, "b")
    assert 0 <= request_seed(123, "x") < 2**63


def test_stop_cut_and_rids_of_the_request_mapping():
    from asyncrl.engine.sglang.requests import cut_at_stop, request_rid, stop_set

    assert stop_set(req(0), None) is None and stop_set(req(0), (2, 3)) == {2, 3}
    assert stop_set(req(0, stop_token_ids=()), (2,)) == frozenset()  # explicit empty set: no stop token
    ids, logps, versions = [5, 9, 2, 7], [-1.0, -2.0, -3.0, -4.0], [0, 0, 1, 1]
    assert cut_at_stop(ids, logps, versions, "length", frozenset({2, 7})) == ([5, 9, 2], [-1.0, -2.0, -3.0],
                                                                            [0, 0, 1], "stop")
    assert cut_at_stop(ids, logps, versions, "length", frozenset({4})) == (ids, logps, versions, "length")
    assert cut_at_stop(ids, logps, versions, "length", None) == (ids, logps, versions, "length")
    # prefix-free: no rid is a prefix of another sample's rid (SGLang aborts by prefix)
    assert not request_rid("t", "s1").startswith(request_rid("t", "s")) and request_rid("t", "s1") == "t-2:s1"


def test_parse_maps_version_spans_and_rejects_foreign_versions():
    r = req(0)
    out = {
        "output_ids": [9, 8, 7],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 7},
            "output_token_logprobs": [[-1.0, 9, None], [-2.0, 8, None], [-3.0, 7, None]],
            "weight_versions": [
                {"version": "1", "start": 0, "end": 2},
                {"version": "2", "start": 2, "end": 3},
            ],
        },
    }
    assert parse_generate_output(out, r) == ([9, 8, 7], [-1.0, -2.0, -3.0], [1, 1, 2], "stop")
    out["meta_info"]["weight_versions"][0]["version"] = "default"
    with pytest.raises(ValueError, match="not set by this engine"):
        parse_generate_output(out, r)
    with pytest.raises(ValueError, match="lacks"):
        parse_generate_output({"output_ids": []}, r)


def test_generate_error_from_server_surfaces_in_generate_and_sample_is_yielded_once(stub):
    engine = SGLangEngine(stub.url)
    stub.faults["/generate"] = (500, b'{"error": "scheduler died"}')
    with pytest.raises(SGLangRequestError, match="scheduler died"):
        list(engine.generate([req(0)]))
    got = list(engine.generate())
    assert [(r.sample_id, r.finish_reason, r.response_ids) for r in got] == [("s0", "abort", [])]
    engine.close()


def test_server_restart_mid_run_is_an_error_then_work_continues(stub):
    engine = SGLangEngine(stub.url)
    stub.faults["/generate"] = "drop"  # the process went away under an in-flight request
    with pytest.raises(SGLangUnavailableError):
        list(engine.generate([req(0)]))
    list(engine.generate())
    del stub.faults["/generate"]  # back up: the same engine serves again
    (res,) = engine.generate([req(1)])
    assert res.finish_reason == "length"
    engine.close()


def test_abort_of_queued_request_is_local_and_inflight_abort_posts_encoded_rid(stub):
    stub.release.clear()  # hold /generate answers
    engine = SGLangEngine(stub.url, max_batch_size=1)
    engine.submit([req(0), req(1)])
    engine.abort(["s1"])
    wait_until(lambda: "/generate" in stub.paths(), "s0 was never sent")
    engine.abort(["s0", "nope"])
    wait_until(lambda: "/abort_request" in stub.paths(), "the in-flight abort was never posted")
    stub.release.set()
    got = {r.sample_id: r for r in engine.generate()}
    assert got["s1"].finish_reason == "abort" and got["s1"].response_ids == []
    sent = [p["rid"] for path, p in stub.calls if path == "/generate"]
    aborted = {p["rid"] for path, p in stub.calls if path == "/abort_request"}
    assert len(sent) == 1 and aborted == set(sent)
    engine.close()


def test_weight_update_pauses_in_place_and_wraps_tensor_update_in_a_session(stub):
    engine = SGLangEngine(stub.url, max_chunk_bytes=64)
    sd = {"a.weight": torch.ones(4, 4), "b.bias": torch.arange(3.0)}
    engine.update_weights(1, sd)
    (res,) = engine.generate([req(0)])
    wait_until(lambda: "/continue_generation" in stub.paths(), "the update never resumed generation")
    ctl = [
        p
        for p in stub.paths()
        if p not in ("/generate", "/model_info", "/server_info", "/update_weight_version")
    ]
    assert ctl == [
        "/pause_generation",
        "/begin_weight_update",
        "/update_weights_from_tensor",
        "/update_weights_from_tensor",
        "/end_weight_update",
        "/continue_generation",
    ]
    pause = next(p for path, p in stub.calls if path == "/pause_generation")
    assert pause == {"mode": "in_place"}
    updates = [p for path, p in stub.calls if path == "/update_weights_from_tensor"]
    assert "weight_version" not in updates[0] and updates[1]["weight_version"] == "1"
    assert all(u["flush_cache"] is False for u in updates)
    sent = [pickle.loads(base64.b64decode(u["serialized_named_tensors"][0])) for u in updates]
    assert [n for chunk in sent for n, _ in chunk] == ["a.weight", "b.bias"]
    assert torch.equal(sent[1][0][1], torch.arange(3.0))
    assert engine.version == 1
    engine.close()


def test_versions_must_increase_and_bad_payloads_fail_before_queueing(stub, tmp_path):
    engine = SGLangEngine(stub.url, version=2)
    with pytest.raises(ValueError, match="not newer"):
        engine.update_weights(2, {"w": torch.zeros(1)})
    with pytest.raises(ValueError, match="does not exist"):
        engine.update_weights(3, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="state dict"):
        engine.update_weights(3, {"w": [1.0]})
    with pytest.raises(ValueError, match="weights must be"):
        engine.update_weights(3, 42)
    engine.update_weights(3, tmp_path)
    list(engine.generate([req(0)]))
    engine.close()
    body = next(p for path, p in stub.calls if path == "/update_weights_from_disk")
    assert body == {"model_path": str(tmp_path), "weight_version": "3", "flush_cache": False}
    assert "/begin_weight_update" not in stub.paths()  # disk updates need no session in 0.5.23


def test_quantized_publication_is_rejected_with_the_fix():
    quant = pytest.importorskip("asyncrl.quant")
    pub = quant.publish({"model.layers.0.mlp.down_proj.weight": torch.randn(64, 64)}, "int8", version=1)
    with pytest.raises(ValueError, match="'fp32' or 'bf16'"):
        prepare_update(pub)
    full = quant.publish({"x.weight": torch.randn(4, 4)}, "fp32", version=1)
    assert [n for n, _ in prepare_update(full).named] == ["x.weight"]


def test_rejected_update_surfaces_in_generate_and_keeps_the_old_version(stub):
    engine = SGLangEngine(stub.url)
    stub.faults["/update_weights_from_tensor"] = (400, b'{"success": false, "message": "shape mismatch"}')
    engine.update_weights(1, {"w": torch.zeros(2)})
    with pytest.raises(SGLangRequestError, match="shape mismatch"):
        list(engine.generate([req(0)]))
    assert engine.version == 0
    assert "/end_weight_update" in stub.paths() and "/continue_generation" in stub.paths()
    engine.close()


def test_pause_holds_dispatch_until_resume(stub):
    engine = SGLangEngine(stub.url)
    engine.pause()
    engine.submit([req(0)])
    wait_until(lambda: "/pause_generation" in stub.paths(), "the pause was never posted")
    time.sleep(0.2)  # a window in which a dispatch while paused would show (its absence is the check)
    assert "/generate" not in stub.paths()
    engine.resume()
    (res,) = engine.generate()
    assert (
        res.finish_reason == "length"
        and stub.paths().index("/continue_generation") < stub.paths().index("/generate")
        or "/generate" in stub.paths()
    )
    engine.close()


def test_close_aborts_everything_and_refuses_new_work(stub):
    stub.release.clear()
    engine = SGLangEngine(stub.url, max_batch_size=1)
    engine.submit([req(0), req(1)])
    wait_until(lambda: "/generate" in stub.paths(), "s0 was never sent")  # s0 in flight, s1 queued behind it
    threading.Timer(0.2, stub.release.set).start()
    engine.close(timeout_s=WAIT_S)
    got = {r.sample_id: r.finish_reason for r in engine.generate()}
    assert set(got) == {"s0", "s1"} and got["s1"] == "abort"
    with pytest.raises(EngineClosedError):
        engine.submit([req(2)])
    with pytest.raises(EngineClosedError):
        engine.update_weights(1, {"w": torch.zeros(1)})
    engine.close()


def test_both_engines_raise_the_one_base_engine_closed_error_after_close(stub, tiny_hf):
    """Native (tiny model) and SGLang (stub server) refuse work after close with the same class, so one
    ``except EngineClosedError`` in a worker covers either engine."""
    from asyncrl.engine.native.engine import NativeEngine

    engines = {"native": NativeEngine(copy.deepcopy(tiny_hf)), "sglang": SGLangEngine(stub.url)}
    for name, engine in engines.items():
        engine.close()
        with pytest.raises(EngineClosedError) as submitted:
            engine.submit([req(0)])
        with pytest.raises(EngineClosedError) as updated:
            engine.update_weights(1, {"model.norm.weight": torch.ones(1)})
        assert type(submitted.value) is type(updated.value) is EngineClosedError, name
        assert "build a new one" in str(submitted.value), name
        engine.close()  # idempotent


def test_chunks_keep_order_and_split_by_bytes():
    upd = prepare_update({f"t{i}": torch.zeros(10) for i in range(5)})  # 40 bytes each
    chunks = chunk_update(upd, 100)
    assert [[n for n, _ in c] for c in chunks] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    bodies = tensor_bodies(upd, 7, tp_size=2, max_chunk_bytes=100)
    assert len(bodies[0]["serialized_named_tensors"]) == 2 and bodies[-1]["weight_version"] == "7"


def test_views_are_sent_by_their_own_bytes():
    big = torch.arange(1000.0)
    ((name, t),) = prepare_update({"v": big[10:14]}).named
    assert t.untyped_storage().nbytes() == 16 and torch.equal(t, big[10:14])


def test_server_command_uses_documented_flags_and_cpu_env(tmp_path):
    cmd = server_command("/m", python="py", port=123, device="cpu", max_total_tokens=64)
    assert cmd[:3] == ["py", "-m", "sglang.launch_server"]
    for flag in ("--device", "--attention-backend", "--disable-overlap-schedule", "--sleep-on-idle", "--disable-radix-cache"):
        assert flag in cmd
    fp8 = server_command("/m", python="py", port=1, quant_format="fp8")
    assert fp8[fp8.index("--quantization") + 1] == "fp8" and fp8[fp8.index("--load-format") + 1] == "flash_rl"
    with pytest.raises(ValueError, match="GPU"):
        server_command("/m", port=1, device="cpu", quant_format="fp8")
    with pytest.raises(ValueError, match="not supported"):
        server_command("/m", port=1, quant_format="int8")
    env = cpu_env({"PYTHONPATH": "/x"}, shim_dir=tmp_path)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["PYTHONPATH"].split(":")[0] == str(tmp_path)
    assert "asyncrl.engine.sglang.cpu_kernels" in (tmp_path / "sgl_kernel" / "__init__.py").read_text()


def test_cpu_kernel_stand_ins_match_their_sglang_contracts():
    from asyncrl.engine.sglang import cpu_kernels as k

    table = torch.zeros(3, 6, dtype=torch.int64)
    k.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]), table, torch.tensor([1, 0]), torch.tensor([3, 1]), torch.tensor([7, 8, 9]), 6
    )
    assert table[2].tolist() == [0, 7, 8, 0, 0, 0] and table[0].tolist() == [9, 0, 0, 0, 0, 0]
    buf = torch.arange(12.0).reshape(4, 3)
    k.copy_all_layer_kv_cache_cpu(
        torch.tensor([buf.data_ptr()]), torch.tensor([3 * 4]), torch.tensor([0]), torch.tensor([3])
    )
    assert buf[0].tolist() == [9.0, 10.0, 11.0]
    with pytest.raises(RuntimeError, match="speculative"):
        k.verify_tree_greedy_cpu()
    with pytest.raises(AttributeError, match="not provided"):
        k.some_future_kernel  # noqa: B018


def test_poll_raises_a_failed_generate_once_and_yields_its_sample_as_abort(stub):
    engine = SGLangEngine(stub.url)
    stub.faults["/generate"] = (500, b'{"error": "scheduler died"}')
    engine.submit([req(0)])
    got, raised = [], 0
    deadline = time.monotonic() + WAIT_S
    while not (got and raised) and time.monotonic() < deadline:
        try:
            got += engine.poll(0.2)
        except SGLangRequestError as exc:
            raised += 1
            assert "scheduler died" in str(exc)
    assert raised == 1 and [(r.sample_id, r.finish_reason, r.response_ids) for r in got] == [("s0", "abort", [])]
    assert engine.poll(0.0) == []  # the error was raised once; the engine goes on
    engine.close()
