"""Native torch rollout engine: continuous batching over an HF causal LM, interruptible weight swaps.

Owns: ``NativeEngine``'s state and its thread-safe control surface (submit / update_weights / load_stream /
abort / pause / resume / close), what it reports (``capabilities``, ``step_stats``, ``version``, ``paused``,
``num_active``, ``num_queued``). The engine thread's half (``step``, ``generate``, ``poll``, the live batch, the
choice of decode path per step, the record of every sampled token's behaviour log-prob and policy version) is
``asyncrl.engine.native.step_loop.StepLoop``; how the model, its runner and the static step are built from the
options is ``asyncrl.engine.native.build``. Row state, the checks on submitted requests and batch admission
are ``asyncrl.engine.native.rows``; the weight state (the version served, updates handed over, what a load
changes besides the weights) is the engine's ``weights``, a ``asyncrl.engine.native.weight_updates.WeightUpdates``.

Must never: import zmq/msgspec or know about controllers and workers; call ``torch.manual_seed`` or use the
global RNG (sampling randomness comes from ``sampling.request_uniform``); hold ``_lock`` while running the
model (other threads must never wait on a forward pass, except ``close``, which waits for at most one step).

Threading model (docs/engine.md has the long form):
  * one *engine thread* drives ``step()`` (directly or through ``generate``); the model, the KV cache and
    ``_active`` are touched only by that thread, under ``_step_lock``;
  * ``submit``, ``update_weights``, ``abort``, ``pause``, ``resume``, ``close`` may be called from any thread;
    they only record intent under ``_lock`` and wake the engine thread;
  * everything recorded is applied at the next *step boundary* (the start of ``step()``), in this order:
    weights -> aborts -> (stop here if paused or closed) -> admit queued requests -> one forward + sample.

Invariants:
  * ``versions[t]`` is the version whose weights produced the logits token t was drawn from; a weight swap
    keeps the KV cache of in-flight samples, so only later tokens carry the new version;
  * a sample's random stream is ``request_uniform(seed, sample_id, t)``: it does not depend on the batch;
    so does the per-forward AQN noise of a version published with ``aqn_resample="forward"``
    (``asyncrl.quant.ForwardAqn``: keyed by (version seed, sample_id, t));
  * every request submitted is yielded exactly once (``stop``, ``length`` or ``abort``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from asyncrl.engine.base import EngineClosedError, GenRequest, GenResult
from asyncrl.engine.native.build import build_decode, check_options, resolve_overlap
from asyncrl.engine.native.decoder import decoder_view
from asyncrl.engine.native.rows import Seq, model_eos_ids, new_rows
from asyncrl.engine.native.static_step import StaticStep
from asyncrl.engine.native.step_loop import InFlight, StepLoop
from asyncrl.engine.native.weight_updates import WeightUpdates
from asyncrl.engine.native.weights import check_weights
from asyncrl.quant import QuantLinear


class NativeEngine(StepLoop):
    """``RolloutEngine`` for HF Llama/Qwen2/Qwen3/Mistral causal LMs on CPU or one GPU (see module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        quant_format: str = "fp32",
        version: int = 0,
        device: str | torch.device = "cpu",
        max_batch_size: int = 32,
        max_seq_len: int | None = None,
        max_prefill_tokens: int = 4096,
        eos_token_ids: Sequence[int] | None = None,
        num_threads: int | None = 1,
        quantize_head: bool = False,
        quantize_embedding: bool = False,
        decode_step: str = "auto",
        cuda_graphs: str | bool = "auto",
        compile_step: bool | str = "auto",
        prewarm: str | bool = "auto",
        overlap: str | bool = "auto",
    ) -> None:
        """Wrap ``model`` (fp32 HF causal LM; quantized here when ``quant_format != "fp32"``) at ``version``.

        ``quantize_head``: the output head (``lm_head``) is quantized too (``quant.lm_head``; the
        learner must publish with ``head=True``). ``quantize_embedding``: the token embedding is int8 row
        codes (``quant.embedding``; the learner must publish with ``embedding=True``).

        ``num_threads``: torch intra-op threads for this process (None leaves torch's setting alone).
        ``eos_token_ids``: default stop tokens (requests with ``stop_token_ids=None``); default = model's EOS.
        ``decode_step``: ``static`` (``asyncrl.engine.native.static_step``: static shapes, no host sync), ``eager``
        (``DecoderRunner.decode``: the reference), ``auto`` = static for a natively supported model.
        ``cuda_graphs``: ``auto`` (on for CUDA), ``true`` (CUDA only, else ``ValueError``), ``false``: replay
        the static step per batch/length bucket as CUDA graphs. ``compile_step``: ``torch.compile`` the
        static step body (``fullgraph=True``): ``auto`` (Inductor on CUDA, falling back to the uncompiled body
        with an error logged if compiling fails; off on a CPU), ``true``, ``false``, or a backend name
        (``asyncrl.engine.native.build.resolve_compile``). ``prewarm``: ``auto`` (on when the static step runs buckets: CUDA
        graphs or a compiled body), ``true``, ``false``: build the runner of every batch/span bucket here, on a
        K/V cache sized to ``max_seq_len``, and again at the step boundary after a weight load dropped them, so
        no runner is built inside a rollout. ``overlap``: ``auto`` (on for CUDA), ``true``, ``false``: a static
        step whose rows all go on is left in flight and its results (copied to pinned memory without blocking)
        are read after the next step is launched, so the host's bookkeeping overlaps the device.
        """
        check_options(quant_format, max_batch_size, max_prefill_tokens, decode_step)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        config = decoder_view(model).config
        model_max = int(getattr(config, "max_position_embeddings", 0) or 0) or 4096
        self.max_seq_len = int(max_seq_len or model_max)
        if self.max_seq_len > model_max:
            raise ValueError(
                f"max_seq_len={self.max_seq_len} exceeds the model's max_position_embeddings={model_max}"
            )
        self.quant_format = quant_format
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.vocab_size = int(config.vocab_size)
        self.eos_token_ids = frozenset(eos_token_ids if eos_token_ids is not None else model_eos_ids(model))
        self.device = torch.device(device)
        setup = build_decode(model, device=self.device, quant_format=quant_format, max_batch_size=max_batch_size,
                             max_seq_len=self.max_seq_len, vocab_size=self.vocab_size, quantize_head=quantize_head,
                             quantize_embedding=quantize_embedding, decode_step=decode_step,
                             cuda_graphs=cuda_graphs, compile_step=compile_step, prewarm=prewarm)
        model = setup.model
        self._model: torch.nn.Module | None = model
        self._runner: Any = setup.runner
        self._static: StaticStep | None = setup.static
        self._prewarm = setup.prewarm
        self._overlap = resolve_overlap(overlap, self.device, self._static)
        self._inflight: InFlight | None = None  # a static step whose results are not read yet (overlap)
        self._ready: list[GenResult] = []  # results read from it before a step that then raised
        self._eager_notice = False

        self._lock = threading.Lock()
        self.weights = WeightUpdates(model, quant_format, version, self._lock)
        self._wake = threading.Condition(self._lock)
        self._step_lock = threading.Lock()
        self._inbox: deque[Seq] = deque()
        self._live_ids: set[str] = set()
        self._aborts: set[str] = set()
        self._paused = False
        self._closed = False
        self._active: list[Seq] = []  # row r of the KV cache <-> _active[r]; engine thread only

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype = torch.float32, **kwargs: Any
    ) -> NativeEngine:
        """Load an HF folder (config + safetensors) and build an engine; ``kwargs`` go to ``__init__``."""
        from transformers import AutoModelForCausalLM

        from asyncrl.engine.native.rows import own_memory

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        engine = cls(model, **kwargs)
        assert engine._model is not None
        own_memory(engine._model)
        return engine

    # ----------------------------------------------------------------- any-thread control surface

    def submit(self, requests: Sequence[GenRequest]) -> None:
        """Queue requests (FIFO). Raises ``ValueError`` for a bad request, before queueing any of them."""
        seqs = new_rows(requests, max_seq_len=self.max_seq_len, vocab_size=self.vocab_size,
                        eos_ids=self.eos_token_ids, now=time.monotonic())
        ids = {s.req.sample_id for s in seqs}
        with self._lock:
            if self._closed:
                raise EngineClosedError("engine is closed; build a new one")
            dup = ids & self._live_ids
            if dup:
                raise ValueError(
                    f"sample ids already live in this engine: {sorted(dup)[:5]}; ids must be unique"
                )
            self._live_ids |= ids
            self._inbox.extend(seqs)
            self._wake.notify_all()

    def abort(self, sample_ids: Sequence[str]) -> None:
        """Finish live samples with ``finish_reason="abort"`` (partial tokens kept); unknown ids are ignored."""
        with self._lock:
            self._aborts |= set(sample_ids) & self._live_ids
            self._wake.notify_all()

    def update_weights(self, version: int, weights: Any) -> None:
        """Record weights for ``version``; they are swapped in at the next step boundary.

        ``weights``: a ``PublishedWeights`` from ``asyncrl.quant.publish`` in this engine's format, a
        ``PublishedDelta`` from the version handed over before it (``asyncrl.quant.make_delta``), or a plain
        state dict (fp32 engine: loaded as is; quantized engine: quantized here). If several full updates
        arrive before a boundary only the newest is applied; deltas queued after it are applied in order.
        ``version`` must exceed every earlier one.
        """
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"version must be an int, got {version!r}")
        with self._lock:
            model = self._model
        if model is None:
            raise EngineClosedError("engine is closed; build a new one")
        check_weights(weights, self.quant_format, model)
        with self._lock:
            if self._closed:
                raise EngineClosedError("engine is closed; build a new one")
            self.weights.record(version, weights)
            self._wake.notify_all()

    def load_stream(self, version: int, buckets: Iterable[Any]) -> Any:
        """Load ``version`` as its buckets arrive (``buckets``: a ``WeightClient.stream``), on the calling thread,
        at a step boundary: the first bucket is received while the engine decodes, then the load waits for the step
        in progress and no forward runs until it ends (a token is never drawn from half a version), so the receive
        buffers held are one bucket's instead of a model's. On any error (a check, a torn transfer) the weights are
        the version before, bit for bit, and it propagates. Returns the ``asyncrl.quant.LoadedVersion``. Weights
        handed to ``update_weights`` must be applied first."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"version must be an int, got {version!r}")
        rest = iter(buckets)
        first = next(rest, None)  # taken before the boundary: a version of one bucket stops decoding only to load
        if first is not None:
            rest = itertools.chain([first], rest)
            del first
        with self._step_lock:
            with self._lock:
                if self._closed or self._model is None:
                    raise EngineClosedError("engine is closed; build a new one")
            self._drain(self._ready)  # the step in flight ran the weights before this version
            loaded = self.weights.stream(self._model, version, rest, self._static)
            self._keep_warm()
            return loaded

    def take_delta_failure(self) -> bool:
        """True once after a delta failed to apply (the engine kept its version; fetch the next one whole)."""
        return self.weights.take_delta_failure()

    def pause(self) -> None:
        """After the step in progress, run no forward until ``resume``; queued and live samples are kept."""
        with self._lock:
            self._paused = True
            self._wake.notify_all()

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            self._wake.notify_all()

    def close(self) -> None:
        """Abort every live sample (yielded by the next ``step``/``generate``), free the model and cache.

        Waits for the step in progress, if any. Idempotent.
        """
        with self._lock:
            self._closed = True
            self.weights.pending = []
            self._wake.notify_all()
        with self._step_lock:
            if self._runner is not None:
                self._runner.cache.release()
                self._runner = None
                self._static = None
                self._model = None

    def capabilities(self) -> dict[str, Any]:
        return {
            "engine": "native",
            "quant_format": self.quant_format,
            "device": str(self.device),
            "max_batch_size": self.max_batch_size,
            "max_seq_len": self.max_seq_len,
            "vocab_size": self.vocab_size,
            "per_token_versions": True,
            "weight_swap": "step_boundary",
            "seeded": True,
            "sampling": ("temperature", "top_p", "top_k", "stop_token_ids", "max_new_tokens"),
            "behav_logp": "processed",
            "decode_step": "eager" if self._static is None else "static",
            "weight_delta": True,
            "weight_stream": True,
            "kernels": sorted({m.kernel for m in self._model.modules() if isinstance(m, QuantLinear)}
                              if self._model is not None else ()),
            "cuda_graphs": self._static is not None and self._static.graphs.use_graphs,
            "overlap": self._overlap,
            "compile_step": self._static.compiled if self._static is not None else None,
            "compile_failure": self._static.compile_failure if self._static is not None else None,
        }

    def step_stats(self) -> dict[str, Any]:
        """What the static decode step has built and run so far, and the K/V cache's size.

        ``bucketed``: steps run as (batch, span) buckets (CUDA graphs or a compiled step); ``builds``,
        ``captures``, ``replays``, ``drops``: ``StepGraphs.counters`` (all 0 on an engine that runs exact
        shapes eagerly, or with no static step); ``prewarm``: every bucket's runner is built at construction
        (and after a weight load that dropped them); ``buckets``: the (batch, span, truncation) keys a step can
        run on the cache as sized now, ``runners``: how many of them hold a runner; ``compiled``: the
        ``torch.compile`` backend the step body runs under (None: uncompiled), ``compile_failure``: why compiling
        failed when the step fell back to the uncompiled body (None otherwise); ``kv_allocations``: how many
        times the K/V storage was (re)allocated (each drops every runner); ``kv_capacity``: positions per row.
        """
        static, runner = self._static, self._runner
        counters = static.graphs.counters() if static is not None else dict.fromkeys(
            ("builds", "captures", "replays", "drops"), 0)
        cache = getattr(runner, "cache", None)
        return {"bucketed": bool(static is not None and static.pad), **counters, "prewarm": self._prewarm,
                "compiled": static.compiled if static is not None else None,
                "compile_failure": static.compile_failure if static is not None else None,
                "buckets": len(static.bucket_keys()) if static is not None else 0,
                "runners": len(static.graphs.runners) if static is not None else 0,
                "kv_allocations": int(getattr(cache, "generation", 0)),
                "kv_capacity": int(getattr(cache, "cap_len", 0))}

    @property
    def version(self) -> int:
        """Version of the weights the next forward will use (pending updates not counted)."""
        return self.weights.version

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_queued(self) -> int:
        return len(self._inbox)
