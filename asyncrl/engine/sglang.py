"""SGLang rollout engine: the ``RolloutEngine`` Protocol over one SGLang 0.5.23 HTTP server.

Owns: the request life cycle on the client side (queued here -> in flight as one ``/generate`` call ->
finished), the mapping of asyncrl requests/results onto SGLang's native API, and the ordered control
channel (pause / resume / abort / weight updates / cache flush: typed operations, ``Control`` and
``WeightUpdate``). docs/sglang.md is the long form; every
endpoint and field below was read in SGLang 0.5.23's source (entrypoints/http_server.py,
managers/io_struct.py, layers/sampler.py, utils/weight_versions.py).

Must never: wait without a timeout, block a caller other than ``generate``/``close`` on the server, kill a
process it did not start, or label a token with a version the server did not report for it.

Threading (same contract as the native engine, docs/engine.md):
  * ``generate`` is driven by one thread; results of requests submitted by any thread come out of it;
  * ``submit``/``abort``/``pause``/``resume``/``update_weights``/``close`` record intent under ``_lock`` and
    return at once. A *dispatcher* pool sends each queued request as one blocking ``/generate`` call (at
    most ``max_batch_size`` in flight, none while paused); one *control* thread applies control operations
    to the server in the order they were recorded, so pause -> update -> resume reach SGLang in that order.

Mapping (SGLang 0.5.23):
  * request: ``input_ids``, ``rid`` (prefix-free encoding of the sample id: SGLang's scheduler aborts
    every rid that *starts with* the given one), ``return_logprob=true``, ``sampling_params`` with
    ``temperature``/``top_p``/``top_k``/``max_new_tokens``/``stop_token_ids``/``ignore_eos`` and a
    ``sampling_seed`` derived from (seed, sample_id) -- honoured only by servers started with
    ``--enable-deterministic-inference`` (GPU backends); ``capabilities()["seeded"]`` says which;
  * behaviour log-probs: ``meta_info.output_token_logprobs[t][0]``. SGLang's default sampler returns
    ``log(softmax(logits.float() / T))`` over the full vocabulary (greedy: raw ``log_softmax``), taken
    *before* top-k/top-p truncation. This departs from docs/algorithms.md §2.1 (renormalised truncated
    distribution) when truncation is on; training rollouts use top_p=1, top_k=-1, where they agree.
    The env var ``SGLANG_RETURN_ORIGINAL_LOGPROB`` must stay unset (it returns pre-temperature values);
  * versions: ``meta_info.weight_versions`` spans ``{version, start, end}`` over output tokens; every
    version string is one this engine set (``str(int)``);
  * mid-generation updates: ``/pause_generation`` ``mode="in_place"`` (running requests keep their KV
    cache), ``/begin_weight_update``, ``/update_weights_from_tensor`` chunks (last one with
    ``weight_version``), ``/end_weight_update``, ``/continue_generation``. A token sampled before the
    pause carries the old version; its K/V is computed by the new weights, as in the native engine.
"""

from __future__ import annotations

import enum
import hashlib
import json
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.engine.base import FINISH_REASONS, GenRequest, GenResult
from asyncrl.engine.sglang_http import SGLangError, SGLangHTTP, SGLangRequestError
from asyncrl.engine.sglang_server import SGLangServerProcess, cpu_env, free_port, server_command
from asyncrl.engine.sglang_weights import (
    BroadcastWeights,
    TensorUpdate,
    disk_body,
    prepare_update,
    tensor_bodies,
)


class EngineClosedError(RuntimeError):
    """Raised by ``submit``/``update_weights`` after ``close()``."""


def request_seed(seed: int, sample_id: str) -> int:
    """Per-request ``sampling_seed`` in [0, 2**63): distinct sample ids (GRPO group members) get distinct
    streams under one run seed; SGLang hashes it with the token position."""
    h = hashlib.blake2b(f"{seed}\x00{sample_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


class Control(enum.Enum):
    """A control operation without arguments, applied by the control thread in the order recorded."""

    PAUSE = "pause"  # /pause_generation in place
    RESUME = "resume"  # /continue_generation
    RESUME_FOR_CLOSE = "resume_for_close"  # /continue_generation only if a caller had paused
    ABORT = "abort"  # /abort_request for every in-flight sample whose abort was asked for
    FLUSH = "flush"  # /flush_cache (a refusal while requests run is ignored)
    STOP = "stop"  # end the control thread (close)


@dataclass(frozen=True, slots=True)
class WeightUpdate:
    """The control operation that moves the server to ``version`` (pause, load ``payload``, resume)."""

    version: int
    payload: TensorUpdate | Path | BroadcastWeights

    @property
    def skippable(self) -> bool:
        """A tensor or folder update a newer one replaces; broadcast updates are never skipped."""
        return not isinstance(self.payload, BroadcastWeights)


ControlOp = Control | WeightUpdate


@dataclass(slots=True)
class _Pending:
    req: GenRequest
    rid: str
    t_submit: float
    t_sent: float | None = None


class SGLangEngine:
    """``RolloutEngine`` over an SGLang server (see module docstring). Build with ``launch`` or ``attach``."""

    def __init__(
        self,
        url: str,
        *,
        server: SGLangServerProcess | None = None,
        quant_format: str = "fp32",
        version: int = 0,
        max_batch_size: int = 32,
        eos_token_ids: Sequence[int] | None = None,
        request_timeout_s: float = 600.0,
        control_timeout_s: float = 120.0,
        max_chunk_bytes: int = 256 << 20,
        abort_retry_s: float = 0.05,
    ) -> None:
        """Attach to the server at ``url`` and set its weight version to ``version``.

        ``max_batch_size`` bounds the requests in flight at the server; ``request_timeout_s`` bounds one
        ``/generate`` call, ``control_timeout_s`` every other call. ``server``: a process this engine owns
        (stopped by ``close``).
        """
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.http = SGLangHTTP(url, timeout_s=control_timeout_s)
        self.url = self.http.base_url
        self.server = server
        self.quant_format = quant_format
        self.max_batch_size = max_batch_size
        self.request_timeout_s = float(request_timeout_s)
        self.max_chunk_bytes = int(max_chunk_bytes)
        self.abort_retry_s = float(abort_retry_s)
        self.eos_token_ids = None if eos_token_ids is None else tuple(int(t) for t in eos_token_ids)
        info = self.http.get("/model_info")
        if not isinstance(info, dict) or not info.get("is_generation", False):
            raise SGLangRequestError(f"{self.url}/model_info does not describe a generation model: {info!r}")
        self.model_path = info.get("model_path")
        self.model_eos_ids = model_eos_ids(self.model_path)
        self.server_info = self._server_info()
        self.http.post(
            "/update_weight_version", {"new_version": str(int(version)), "abort_all_requests": False}
        )
        self._version = int(version)
        self._token = hashlib.blake2b(f"{id(self)}{time.time_ns()}".encode(), digest_size=4).hexdigest()

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: deque[_Pending] = deque()
        self._inflight: dict[str, _Pending] = {}  # sample id -> sent request
        self._live: set[str] = set()
        self._results: deque[GenResult] = deque()
        self._aborts: set[str] = set()  # in flight, abort wanted, result not back yet
        self._controls: deque[ControlOp] = deque()
        self._errors: deque[BaseException] = deque()
        self._latest_version = self._version
        self._paused = False  # what callers asked for
        self._updates = 0  # weight updates queued or being applied: dispatch is held until they are done
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=max_batch_size, thread_name_prefix="sglang-gen")
        self._control = threading.Thread(target=self._control_loop, name="sglang-control", daemon=True)
        self._control.start()

    # ----------------------------------------------------------------- construction

    @classmethod
    def launch(
        cls,
        model_path: str | Path,
        *,
        device: str = "cuda",
        quant_format: str = "fp32",
        version: int = 0,
        python: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: str | Path | None = None,
        startup_timeout_s: float = 600.0,
        server_args: dict[str, Any] | None = None,
        **engine_kwargs: Any,
    ) -> SGLangEngine:
        """Start a server for this worker (``device="cpu"`` adds asyncrl's CPU setup) and attach to it.

        ``server_args`` go to ``sglang_server.server_command`` (e.g. ``max_total_tokens``, ``deterministic``,
        ``extra_args``). The process is tracked by PID and ended by ``close``.
        """
        port = port or free_port(host)
        if Path(model_path).exists():
            model_path = Path(model_path).resolve()
        argv = server_command(
            model_path,
            python=python,
            host=host,
            port=port,
            device=device,
            quant_format=quant_format,
            weight_version=version,
            **(server_args or {}),
        )
        env = cpu_env() if device == "cpu" else None
        log = Path(log_path) if log_path else Path(f"/tmp/asyncrl-sglang-{port}.log")
        proc = SGLangServerProcess(argv, env=env, log_path=log)
        try:
            proc.wait_ready(startup_timeout_s)
            return cls(proc.url, server=proc, quant_format=quant_format, version=version, **engine_kwargs)
        except BaseException:
            proc.stop()
            raise

    @classmethod
    def attach(cls, url: str, **engine_kwargs: Any) -> SGLangEngine:
        """Use a running server (not stopped by ``close``)."""
        return cls(url, **engine_kwargs)

    def _server_info(self) -> dict[str, Any]:
        info = self.http.get("/server_info")
        return info if isinstance(info, dict) else {}

    # ----------------------------------------------------------------- any-thread control surface

    def submit(self, requests: Sequence[GenRequest]) -> None:
        """Queue requests (FIFO). ``ValueError`` for a repeated or already live sample id (nothing queued)."""
        now = time.monotonic()
        ids = [r.sample_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"sample ids repeated in one submit: {ids}; ids must be unique")
        with self._lock:
            if self._closed:
                raise EngineClosedError("engine is closed; build a new one")
            dup = set(ids) & self._live
            if dup:
                raise ValueError(
                    f"sample ids already live in this engine: {sorted(dup)[:5]}; ids must be unique"
                )
            for r in requests:
                self._queue.append(_Pending(r, f"{self._token}-{len(r.sample_id)}:{r.sample_id}", now))
            self._live |= set(ids)
            self._pump()

    def update_weights(self, version: int, weights: Any) -> None:
        """Queue weights for ``version`` (state dict, fp32/bf16 ``PublishedWeights``, checkpoint folder or
        ``BroadcastWeights``). Versions must increase. Of several tensor/folder updates still waiting, only
        the newest is sent; broadcast updates are never skipped (the learner is sending them)."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"version must be an int, got {version!r}")
        payload = prepare_update(weights, self.model_path)
        with self._lock:
            if self._closed:
                raise EngineClosedError("engine is closed; build a new one")
            if version <= self._latest_version:
                raise ValueError(f"weight version {version} is not newer than {self._latest_version}")
            if not isinstance(payload, BroadcastWeights):
                kept = deque(c for c in self._controls if not (isinstance(c, WeightUpdate) and c.skippable))
                self._updates -= len(self._controls) - len(kept)
                self._controls = kept
            self._updates += 1
            self._latest_version = version
            self._controls.append(WeightUpdate(version, payload))
            self._cond.notify_all()

    def abort(self, sample_ids: Sequence[str]) -> None:
        """Finish live samples with ``"abort"``: a queued one at once (no tokens), one in flight when SGLang
        returns it (tokens so far kept). Unknown or finished ids are ignored."""
        wanted = set(sample_ids)
        with self._lock:
            keep: deque[_Pending] = deque()
            for p in self._queue:
                if p.req.sample_id in wanted:
                    self._finish_locked(p, [], [], [], "abort")
                else:
                    keep.append(p)
            self._queue = keep
            hit = wanted & set(self._inflight) - self._aborts
            if hit:
                self._aborts |= hit
                self._controls.append(Control.ABORT)
            self._cond.notify_all()

    def pause(self) -> None:
        """No new tokens until ``resume``: SGLang pauses in place (KV kept), nothing new is sent."""
        with self._lock:
            if not self._paused:
                self._paused = True
                self._controls.append(Control.PAUSE)
                self._cond.notify_all()

    def resume(self) -> None:
        with self._lock:
            if self._paused:
                self._paused = False
                self._controls.append(Control.RESUME)
                self._cond.notify_all()

    def flush_cache(self) -> None:
        """Queue a ``/flush_cache`` (SGLang refuses it while requests run; the refusal is ignored)."""
        with self._lock:
            self._controls.append(Control.FLUSH)
            self._cond.notify_all()

    def init_broadcast_group(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        *,
        rank_offset: int = 1,
        backend: str = "gloo",
        group_name: str = "weight_update_group",
    ) -> None:
        """Join the learner's broadcast group (``/init_weights_update_group``); blocks until every rank has
        joined, so the learner must build its ``WeightBroadcaster`` concurrently. ``backend``: ``"gloo"`` on
        CPU, ``"nccl"`` on GPU. Call it once, before the first ``BroadcastWeights`` update."""
        body = {
            "master_address": master_address,
            "master_port": int(master_port),
            "rank_offset": int(rank_offset),
            "world_size": int(world_size),
            "group_name": group_name,
            "backend": backend,
        }
        self.http.post("/init_weights_update_group", body)

    def destroy_broadcast_group(self, group_name: str = "weight_update_group") -> None:
        self.http.post("/destroy_weights_update_group", {"group_name": group_name})

    def close(self, timeout_s: float = 30.0) -> None:
        """Abort everything live (yielded as ``"abort"`` by the next ``generate``), wait up to ``timeout_s``
        for in-flight calls to return, stop the control thread and an owned server. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for p in list(self._queue):
                self._finish_locked(p, [], [], [], "abort")
            self._queue.clear()
            self._aborts |= set(self._inflight)
            self._controls.extend((Control.RESUME_FOR_CLOSE, Control.ABORT, Control.STOP))
            self._cond.notify_all()
            deadline = time.monotonic() + timeout_s
            while self._inflight and self._cond.wait(max(0.0, deadline - time.monotonic())):
                pass
        self._control.join(timeout=max(1.0, deadline - time.monotonic()))
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:  # whatever did not come back in time is still yielded, with no tokens
            for p in list(self._inflight.values()):
                self._finish_locked(p, [], [], [], "abort")
        if self.server is not None:
            self.server.stop()

    def capabilities(self) -> dict[str, Any]:
        args = self.server_info
        return {
            "engine": "sglang",
            "url": self.url,
            "quant_format": self.quant_format,
            "device": args.get("device"),
            "max_batch_size": self.max_batch_size,
            "max_seq_len": args.get("context_length"),
            "per_token_versions": True,
            "weight_swap": "pause_in_place",
            "seeded": bool(args.get("enable_deterministic_inference", False)),
            "sampling": ("temperature", "top_p", "top_k", "stop_token_ids", "max_new_tokens"),
            "behav_logp": "tempered_full_vocab",
            "weight_updates": ("state_dict", "published_fp32_bf16", "folder", "broadcast"),
            "quantized_serving": "fp8_flash_rl" if self.quant_format == "fp8" else None,
            "prequantized_push": (),
            "radix_cache": not bool(args.get("disable_radix_cache", False)),
        }

    @property
    def version(self) -> int:
        """Version of the weights the server serves (pending updates not counted)."""
        return self._version

    @property
    def paused(self) -> bool:
        return self._paused

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._live or self._results)

    # ----------------------------------------------------------------- engine thread

    def generate(self, requests: Sequence[GenRequest] = ()) -> Iterator[GenResult]:
        """Submit ``requests``; yield every result as it finishes until none is live. Raises here the first
        error of a control operation (e.g. a weight update SGLang rejected)."""
        if requests:
            self.submit(requests)
        while True:
            with self._lock:
                while not (self._results or self._errors or not self._live):
                    self._cond.wait(timeout=1.0)
                if self._errors:
                    raise self._errors.popleft()
                if not self._results and not self._live:
                    return
                batch = list(self._results)
                self._results.clear()
            yield from batch

    def poll(self, timeout: float) -> list[GenResult]:
        """Wait up to ``timeout`` s for a finished result; return every one finished so far (maybe ``[]``).
        Raises here, once, the first error of a control operation or a failed ``/generate`` (its sample was
        already returned, or is returned by the next call, as ``"abort"`` with no tokens)."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._lock:
            while not (self._results or self._errors):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(timeout=left)
            batch = list(self._results)
            self._results.clear()
            if self._errors and not batch:
                raise self._errors.popleft()
        return batch

    # ----------------------------------------------------------------- internals

    def _pump(self) -> None:
        """Under ``_lock``: send queued requests while there is room and nothing holds dispatch."""
        while (
            self._queue
            and len(self._inflight) < self.max_batch_size
            and not (self._paused or self._updates or self._closed)
        ):
            p = self._queue.popleft()
            p.t_sent = time.monotonic()
            self._inflight[p.req.sample_id] = p
            self._pool.submit(self._run_guarded, p)

    def _run_guarded(self, p: _Pending) -> None:
        """An error ``_run_one`` did not expect must not vanish in the pool (its sample would stay live for
        ever): the sample is finished as ``"abort"`` and the error raised by the next ``generate``/``poll``."""
        try:
            self._run_one(p)
        except BaseException as exc:  # noqa: B036 - reported to the engine thread, not swallowed
            with self._lock:
                if p.req.sample_id in self._inflight:
                    self._finish_locked(p, [], [], [], "abort")
                self._errors.append(exc)
                self._cond.notify_all()

    def _finish_locked(
        self, p: _Pending, ids: list[int], logps: list[float], versions: list[int], reason: str
    ):
        now = time.monotonic()
        timings = {"total_s": now - p.t_submit, "queue_s": (p.t_sent or now) - p.t_submit}
        self._results.append(
            GenResult(
                sample_id=p.req.sample_id,
                prompt_ids=list(p.req.prompt_ids),
                response_ids=ids,
                behav_logp=np.asarray(logps, dtype=np.float32),
                versions=np.asarray(versions, dtype=np.int32),
                finish_reason=reason,
                timings=timings,
            )
        )
        self._live.discard(p.req.sample_id)
        self._inflight.pop(p.req.sample_id, None)
        self._aborts.discard(p.req.sample_id)
        self._cond.notify_all()

    def _stop_set(self, p: _Pending) -> frozenset[int] | None:
        """The exact stop tokens of a request; None = whatever the server's default EOS is."""
        stop = p.req.params.stop_token_ids
        if stop is None:
            stop = self.eos_token_ids
        return None if stop is None else frozenset(stop)

    def _body(self, p: _Pending) -> dict[str, Any]:
        """SGLang 0.5.23 stops on the model's EOS unless ``ignore_eos``, and ``ignore_eos`` also disables
        ``stop_token_ids`` (schedule_batch.py ``_check_token_based_finish``). So an explicit stop set that
        contains the model's EOS ids is sent as ``stop_token_ids``; any other explicit set is sent with
        ``ignore_eos`` and applied here by cutting the response after its first stop token (exact, since
        sampling is causal; the tokens after it are wasted compute)."""
        sp = p.req.params
        params: dict[str, Any] = {
            "max_new_tokens": sp.max_new_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k,
            "sampling_seed": request_seed(sp.seed, p.req.sample_id),
        }
        stop = self._stop_set(p)
        if stop is not None:
            if self.model_eos_ids is not None and self.model_eos_ids <= stop:
                params["stop_token_ids"] = sorted(stop)
            else:
                params["ignore_eos"] = True
        return {
            "input_ids": list(p.req.prompt_ids),
            "rid": p.rid,
            "return_logprob": True,
            "sampling_params": params,
        }

    def _run_one(self, p: _Pending) -> None:
        """Dispatcher thread: one ``/generate`` call; its outcome becomes a result or an engine error."""
        try:
            out = self.http.post("/generate", self._body(p), timeout=self.request_timeout_s)
            ids, logps, versions, reason = parse_generate_output(out, p.req)
            stop = self._stop_set(p)
            if stop is not None:
                cut = next((i for i, t in enumerate(ids) if t in stop), None)
                if cut is not None:
                    ids, logps, versions, reason = (
                        ids[: cut + 1],
                        logps[: cut + 1],
                        versions[: cut + 1],
                        "stop",
                    )
        except (SGLangError, ValueError) as exc:
            with self._lock:
                self._finish_locked(p, [], [], [], "abort")
                self._errors.append(exc)
                self._pump()
            return
        with self._lock:  # a sample that finished before its abort reached SGLang keeps its own reason
            self._finish_locked(p, ids, logps, versions, reason)
            self._pump()

    def _control_loop(self) -> None:
        while True:
            with self._lock:
                while not self._controls:
                    if self._aborts and not self._closed:
                        break  # re-send pending aborts (SGLang ignores one for a rid it has not seen yet)
                    self._cond.wait(timeout=1.0)
                op = self._controls.popleft() if self._controls else Control.ABORT
            try:
                if op is Control.STOP:
                    return
                self._apply(op)
            except (SGLangError, ValueError) as exc:
                with self._lock:
                    self._errors.append(exc)
                    self._cond.notify_all()
            finally:
                with self._lock:
                    if isinstance(op, WeightUpdate):
                        self._updates -= 1
                    self._pump()
            if op is Control.ABORT:
                time.sleep(self.abort_retry_s)

    def _apply(self, op: ControlOp) -> None:
        if isinstance(op, WeightUpdate):
            self._apply_update(op.version, op.payload)
        elif op is Control.PAUSE:
            self.http.post("/pause_generation", {"mode": "in_place"})
        elif op is Control.RESUME or op is Control.RESUME_FOR_CLOSE:
            if op is Control.RESUME or self._paused:
                self.http.post("/continue_generation", {})
        elif op is Control.ABORT:
            with self._lock:
                rids = [self._inflight[s].rid for s in self._aborts if s in self._inflight]
            for rid in rids:
                self.http.post("/abort_request", {"rid": rid}, expect_json=False)
        elif op is Control.FLUSH:
            try:
                self.http.post("/flush_cache", {}, expect_json=False)
            except SGLangRequestError as exc:
                if exc.status != 400:
                    raise

    def _apply_update(self, version: int, payload: TensorUpdate | Path | BroadcastWeights) -> None:
        user_paused = self._paused
        if not user_paused:
            self.http.post("/pause_generation", {"mode": "in_place"})
        try:
            if isinstance(payload, Path):
                self.http.post("/update_weights_from_disk", disk_body(payload, version))
            else:
                tp_size = int(self.server_info.get("tp_size", 1) or 1)
                self.http.post("/begin_weight_update", {})
                try:
                    if isinstance(payload, BroadcastWeights):
                        self.http.post("/update_weights_from_distributed", payload.body(version))
                    else:
                        for body in tensor_bodies(
                            payload, version, tp_size=tp_size, max_chunk_bytes=self.max_chunk_bytes
                        ):
                            self.http.post("/update_weights_from_tensor", body)
                finally:
                    self.http.post("/end_weight_update", {})
            self._version = version
        finally:
            if not user_paused:
                self.http.post("/continue_generation", {})


def model_eos_ids(model_path: str | None) -> frozenset[int] | None:
    """EOS ids SGLang stops on by default, from the model folder's config.json / generation_config.json;
    None when the folder is not readable from here (then explicit stop sets are applied client-side)."""
    if not model_path or not Path(model_path).is_dir():
        return None
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        try:
            eos = json.loads((Path(model_path) / name).read_text()).get("eos_token_id")
        except (OSError, ValueError):
            continue
        ids |= {eos} if isinstance(eos, int) else set(eos or ())
    return frozenset(ids) if ids else None


def parse_generate_output(out: Any, req: GenRequest) -> tuple[list[int], list[float], list[int], str]:
    """``/generate`` answer -> (response ids, behaviour log-probs, versions, finish reason).

    ``ValueError`` when the answer is not what SGLang 0.5.23 documents (missing fields, lengths that
    disagree, a version string this engine did not set).
    """
    try:
        ids = [int(t) for t in out["output_ids"]]
        meta = out["meta_info"]
        reason = meta["finish_reason"]["type"]
        lps = meta["output_token_logprobs"]
        spans = meta["weight_versions"]
    except (KeyError, TypeError) as exc:
        raise ValueError(
            f"request {req.sample_id!r}: SGLang /generate answer lacks output_ids / meta_info.finish_reason / "
            f"output_token_logprobs / weight_versions ({exc!r}); is the server SGLang 0.5.23?"
        ) from exc
    if reason not in FINISH_REASONS:
        raise ValueError(f"request {req.sample_id!r}: unknown SGLang finish reason {reason!r}")
    if len(lps) != len(ids) or any(int(lp[1]) != t for lp, t in zip(lps, ids, strict=False)):
        raise ValueError(
            f"request {req.sample_id!r}: {len(lps)} log-probs for {len(ids)} tokens (or token ids disagree)"
        )
    versions = [-1] * len(ids)
    for span in spans:
        try:
            v = int(span["version"])
        except (KeyError, ValueError) as exc:
            raise ValueError(
                f"request {req.sample_id!r}: weight version {span!r} was not set by this engine; another "
                "client changed the server's weight_version"
            ) from exc
        for t in range(int(span["start"]), min(int(span["end"]), len(ids))):
            versions[t] = v
    if -1 in versions:
        raise ValueError(
            f"request {req.sample_id!r}: weight_versions spans {spans} do not cover {len(ids)} tokens"
        )
    return ids, [float(lp[0]) for lp in lps], versions, reason
