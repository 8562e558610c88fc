"""SGLang rollout engine: the ``RolloutEngine`` Protocol over one SGLang 0.5.23 HTTP server.

Owns: the request life cycle on the client side (queued here -> in flight as one ``/generate`` call ->
finished), dispatch, and the any-thread control surface, which records control operations in the engine's
``control`` (``asyncrl.engine.sglang.control.ControlChannel``: the ordered channel that applies pause / resume /
abort / weight updates / cache flush to the server, with the state of each). The mapping of requests and
results onto SGLang's native API is ``asyncrl.engine.sglang.requests``. docs/sglang.md is the long form.

Must never: wait without a timeout, block a caller other than ``generate``/``close`` on the server, kill a
process it did not start, or label a token with a version the server did not report for it.

Threading (same contract as the native engine, docs/engine.md):
  * ``generate`` is driven by one thread; results of requests submitted by any thread come out of it;
  * ``submit``/``abort``/``pause``/``resume``/``update_weights``/``close`` record intent under ``_lock`` and
    return at once. A *dispatcher* pool sends each queued request as one blocking ``/generate`` call (at
    most ``max_batch_size`` in flight, none while paused); one *control* thread applies control operations
    to the server in the order they were recorded, so pause -> update -> resume reach SGLang in that order.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.constants import STARTUP_TIMEOUT_S
from asyncrl.engine.base import EngineClosedError, GenRequest, GenResult
from asyncrl.engine.sglang.control import Control, ControlChannel
from asyncrl.engine.sglang.http import SGLangError, SGLangHTTP, SGLangRequestError
from asyncrl.engine.sglang.requests import (
    Pending,
    cut_at_stop,
    model_eos_ids,
    parse_generate_output,
    request_body,
    request_rid,
    stop_set,
)
from asyncrl.engine.sglang.server import SGLangServerProcess, start_server
from asyncrl.engine.sglang.weights import prepare_update


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
        self._token = hashlib.blake2b(f"{id(self)}{time.time_ns()}".encode(), digest_size=4).hexdigest()

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: deque[Pending] = deque()
        self._inflight: dict[str, Pending] = {}  # sample id -> sent request
        self._live: set[str] = set()
        self._results: deque[GenResult] = deque()
        self._errors: deque[BaseException] = deque()
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=max_batch_size, thread_name_prefix="sglang-gen")
        self.control = ControlChannel(self.http, self._cond, version=int(version), errors=self._errors,
                                      tp_size=int(self.server_info.get("tp_size", 1) or 1), dispatch=self._pump,
                                      max_chunk_bytes=int(max_chunk_bytes), abort_retry_s=float(abort_retry_s))

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
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        server_args: dict[str, Any] | None = None,
        **engine_kwargs: Any,
    ) -> SGLangEngine:
        """Start a server for this worker (``device="cpu"`` adds asyncrl's CPU setup) and attach to it.

        ``server_args`` go to ``sglang_server.server_command`` (e.g. ``max_total_tokens``, ``deterministic``,
        ``extra_args``). The process is tracked by PID and ended by ``close``.
        """
        proc = start_server(
            model_path,
            device=device,
            quant_format=quant_format,
            version=version,
            python=python,
            host=host,
            port=port,
            log_path=log_path,
            startup_timeout_s=startup_timeout_s,
            server_args=server_args,
        )
        try:
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
                self._queue.append(Pending(r, request_rid(self._token, r.sample_id), now))
            self._live |= set(ids)
            self._pump()

    def update_weights(self, version: int, weights: Any) -> None:
        """Queue weights for ``version`` (state dict, fp32/bf16 ``PublishedWeights`` or checkpoint folder).
        Versions must increase. Of several updates still waiting, only the newest is sent."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"version must be an int, got {version!r}")
        payload = prepare_update(weights, self.model_path)
        with self._lock:
            if self._closed:
                raise EngineClosedError("engine is closed; build a new one")
            self.control.update(version, payload)

    def abort(self, sample_ids: Sequence[str]) -> None:
        """Finish live samples with ``"abort"``: a queued one at once (no tokens), one in flight when SGLang
        returns it (tokens so far kept). Unknown or finished ids are ignored."""
        wanted = set(sample_ids)
        with self._lock:
            keep: deque[Pending] = deque()
            for p in self._queue:
                if p.req.sample_id in wanted:
                    self._finish_locked(p, [], [], [], "abort")
                else:
                    keep.append(p)
            self._queue = keep
            self.control.abort({s: self._inflight[s].rid for s in wanted & self._inflight.keys()})
            self._cond.notify_all()

    def pause(self) -> None:
        """No new tokens until ``resume``: SGLang pauses in place (KV kept), nothing new is sent."""
        with self._lock:
            self.control.set_paused(True)

    def resume(self) -> None:
        with self._lock:
            self.control.set_paused(False)

    def flush_cache(self) -> None:
        """Queue a ``/flush_cache`` (SGLang refuses it while requests run; the refusal is ignored)."""
        with self._lock:
            self.control.push(Control.FLUSH)

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
            self.control.aborts |= {s: p.rid for s, p in self._inflight.items()}
            self.control.push(Control.RESUME_FOR_CLOSE, Control.ABORT, Control.STOP)
            deadline = time.monotonic() + timeout_s
            while self._inflight and self._cond.wait(max(0.0, deadline - time.monotonic())):
                pass
        self.control.thread.join(timeout=max(1.0, deadline - time.monotonic()))
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
            "weight_updates": ("state_dict", "published_fp32_bf16", "folder"),
            "quantized_serving": "fp8_flash_rl" if self.quant_format == "fp8" else None,
            "prequantized_push": (),
            "radix_cache": not bool(args.get("disable_radix_cache", False)),
        }

    @property
    def version(self) -> int:
        """Version of the weights the server serves (pending updates not counted)."""
        return self.control.version

    @property
    def paused(self) -> bool:
        return self.control.paused

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
            and not (self.control.paused or self.control.updates or self._closed)
        ):
            p = self._queue.popleft()
            p.t_sent = time.monotonic()
            self._inflight[p.req.sample_id] = p
            self._pool.submit(self._run_guarded, p)

    def _run_guarded(self, p: Pending) -> None:
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
        self, p: Pending, ids: list[int], logps: list[float], versions: list[int], reason: str
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
        self.control.aborts.pop(p.req.sample_id, None)
        self._cond.notify_all()

    def _run_one(self, p: Pending) -> None:
        """Dispatcher thread: one ``/generate`` call; its outcome becomes a result or an engine error."""
        try:
            stop = stop_set(p.req, self.eos_token_ids)
            body = request_body(p, stop, self.model_eos_ids)
            out = self.http.post("/generate", body, timeout=self.request_timeout_s)
            ids, logps, versions, reason = cut_at_stop(*parse_generate_output(out, p.req), stop)
        except (SGLangError, ValueError) as exc:
            with self._lock:
                self._finish_locked(p, [], [], [], "abort")
                self._errors.append(exc)
                self._pump()
            return
        with self._lock:  # a sample that finished before its abort reached SGLang keeps its own reason
            self._finish_locked(p, ids, logps, versions, reason)
            self._pump()
