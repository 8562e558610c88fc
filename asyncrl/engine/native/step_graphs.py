"""Batch/length buckets and the per-bucket runners ("graphs") of the native engine's static decode step.

Owns: which padded shape a step of ``n`` live rows at context ``max_pos + 1`` runs as (``batch_bucket``,
``length_bucket``), and one runner per ``(rows, length, truncate)`` key: a captured ``torch.cuda.CUDAGraph``
on CUDA (``cuda_graphs`` on), else an object that calls the step body eagerly on the same static buffers,
so the bucket, padding and replay bookkeeping runs the same code on a CPU as on a GPU.

Must never: allocate or resize the step's buffers, know about requests, or capture anything off CUDA.

Invariants:
  * a key's first use runs the body eagerly (the warm-up; its outputs are the step's real outputs) and,
    with graphs on, then captures it into the one memory pool every graph of the engine shares; later uses
    replay it; a capture that fails turns graphs off for the engine, with one warning, and steps run eagerly;
  * graphs hold pointers: ``invalidate`` drops them all when the K/V storage is reallocated or a weight
    load moved a parameter (``asyncrl.engine.native.kv_cache.StaticKVCache.generation``, ``tensor_pointers``);
  * ``counters`` says how many runners were built (a key's first use: its capture with graphs, its
    compilation with a compiled body), captured, replayed and dropped: a benchmark reads them around a
    timed run to prove nothing was built inside it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from asyncrl.constants import CUDA_GRAPHS

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
MIN_LENGTH_BUCKET = 16

StepBody = Callable[[int, int, bool], None]
log = logging.getLogger(__name__)


def batch_buckets(max_rows: int) -> tuple[int, ...]:
    """The padded batch sizes of an engine with ``max_rows`` rows (past 128: steps of 32, then ``max_rows``)."""
    sizes = {b for b in BATCH_BUCKETS if b < max_rows} | set(range(160, max_rows, 32)) | {max_rows}
    return tuple(sorted(sizes))


def batch_bucket(n: int, max_rows: int) -> int:
    """Smallest bucket holding ``n`` live rows (``1 <= n <= max_rows``)."""
    if not 1 <= n <= max_rows:
        raise ValueError(f"a step runs 1..{max_rows} rows, got {n}")
    return next(b for b in batch_buckets(max_rows) if b >= n)


def length_bucket(n: int, cap_len: int) -> int:
    """Attention span for a context of ``n`` positions: the next power of two (>= 16), at most ``cap_len``."""
    if not 1 <= n <= cap_len:
        raise ValueError(f"a context of {n} positions does not fit the K/V capacity {cap_len}")
    span = MIN_LENGTH_BUCKET
    while span < n:
        span *= 2
    return min(span, cap_len)


def length_buckets(cap_len: int) -> tuple[int, ...]:
    """Every attention span ``length_bucket`` gives on a cache of ``cap_len`` positions."""
    spans, span = [], MIN_LENGTH_BUCKET
    while span < cap_len:
        spans.append(span)
        span *= 2
    return (*spans, cap_len)


def resolve_cuda_graphs(choice: str | bool, device: torch.device) -> bool:
    """``auto`` -> on for CUDA devices; ``true`` off CUDA is refused (``ValueError`` naming the fix)."""
    value = str(choice).lower()
    if value not in CUDA_GRAPHS:
        raise ValueError(f"cuda_graphs must be one of {CUDA_GRAPHS}, got {choice!r}")
    if value == "true" and device.type != "cuda":
        raise ValueError(f"cuda_graphs=true needs a CUDA device, and this engine runs on {device}; set "
                         "rollout.cuda_graphs=auto (or false), or rollout.device=cuda")
    return value != "false" and device.type == "cuda"


def tensor_pointers(module: torch.nn.Module) -> tuple[int, ...]:
    """``data_ptr`` of every parameter and buffer: equal before and after an in-place weight load."""
    return tuple(t.data_ptr() for t in [*module.parameters(), *module.buffers()])


class _EagerRunner:
    """The "graph" of one key where nothing is captured: replaying calls the body on the static buffers."""

    def __init__(self, body: StepBody, key: tuple[int, int, bool]) -> None:
        self.body, self.key = body, key

    def replay(self) -> None:
        self.body(*self.key)


class StepGraphs:
    """One runner per ``(rows, length, truncate)`` key; CUDA graphs when ``use_graphs`` (CUDA only)."""

    def __init__(self, body: StepBody, device: torch.device, *, use_graphs: bool) -> None:
        if use_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.body, self.device, self.use_graphs = body, device, use_graphs
        self.runners: dict[tuple[int, int, bool], object] = {}
        self.pool: Any = None  # torch.cuda.graph_pool_handle() of the first capture
        self.captures = 0
        self.replays = 0
        self.warmups = 0
        self.drops = 0

    def counters(self) -> dict[str, int]:
        """``builds`` (first uses of a key: warm-up, then capture or compilation), ``captures`` (CUDA graphs
        made), ``replays`` (later uses of a key) and ``drops`` (runners forgotten by ``invalidate``)."""
        return {"builds": self.warmups, "captures": self.captures, "replays": self.replays, "drops": self.drops}

    def invalidate(self) -> None:
        """Forget every runner (their pointers are stale); the pool is kept for the next captures."""
        self.drops += len(self.runners)
        self.runners.clear()

    def run(self, rows: int, length: int, truncate: bool) -> None:
        """Run the step for the key: warm-up (+ capture) on first use, replay after."""
        key = (rows, length, truncate)
        runner = self.runners.get(key)
        if runner is not None:
            self.replays += 1
            runner.replay()  # type: ignore[attr-defined]
            return
        self.warmups += 1
        if not self.use_graphs:
            self.runners[key] = _EagerRunner(self.body, key)
            self.body(*key)
            return
        self.runners[key] = self._capture(key)
        if not self.use_graphs:  # the capture failed: this engine runs its steps eagerly from now on
            self.runners = {k: _EagerRunner(self.body, k) for k in self.runners}

    def _capture(self, key: tuple[int, int, bool]) -> object:
        """CUDA only: the real step on a side stream (warm-up), then capture into the shared pool."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.body(*key)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: other threads of the worker (weight fetches, sockets) may touch CUDA meanwhile
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self.body(*key)
        except RuntimeError as exc:  # an op of this mode (a quantized kernel, say) cannot be captured
            log.warning("the decode step cannot be captured as a CUDA graph (%s); it runs eagerly", exc)
            self.use_graphs = False
            return _EagerRunner(self.body, key)
        self.captures += 1
        return graph
