"""The native engine's static-shape, sync-free decode step: device-resident per-row state, one step body.

Owns: the per-row device buffers a decode step reads (``tok``, ``pos``, ``temp``, ``greedy``, ``live``,
``top_k``, ``top_p``, ``trunc``, ``u``: ``[max_rows]`` each) and writes (``out: [2, max_rows] float64`` =
sampled token, behaviour log-prob), their upload from the host, the step body (decoder layers over the
shared ``StaticKVCache`` + ``sampling.sample_static``) and the sampling of freshly prefilled rows.

Must never: sync with the device inside the body (no ``.item()``, ``.tolist()``, boolean-mask indexing or
data-dependent shapes; ``tests/unit/engine/test_static_step.py`` checks the ops), allocate buffers after
construction, know about requests, or draw randomness (the uniforms come from the host,
``sampling.request_uniform``).

Invariants:
  * a step runs a padded batch of ``rows`` (a bucket, ``asyncrl.engine.native.step_graphs``; the exact batch
    when nothing is captured or compiled, ``pad``) over an attention span of ``length`` positions; padding rows have ``live = False``, ``tok = pos = 0``, ``greedy`` on, write
    K/V only into their own unused rows (re-prefilled before use) and their outputs are never read;
  * the step feeds ``tok[r]`` at ``pos[r]``, then writes ``out[:, r]`` and, for live rows, ``tok[r] = next``
    and ``pos[r] += 1``: with the batch unchanged, the host only uploads the next uniforms;
  * grouped-query attention without copying K/V: the ``G = H / KV`` query heads of KV head ``j`` (HF's
    ``repeat_interleave`` order) are folded into the query-length axis, ``q: [rows, KV, G, hd]``, so SDPA runs
    without ``enable_gqa`` in the compute dtype, the mask ``[rows, 1, 1, length]`` broadcast over them;
  * the tokens and behaviour log-probs equal ``processed_logprobs`` + ``sample_tokens`` on the same logits;
  * one device-to-host copy per step: ``out[:, :n]``, into one of two host slots (pinned, with an event, on
    CUDA; ``fetch_start``), read by ``fetch_wait``: a step's copy can be waited on after the next step is
    launched without that step's copy landing on it;
  * ``build_all`` (every bucket's runner, built up front) runs idle rows only and leaves the K/V cache as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncrl.engine.native.decoder import (
    DecoderRunner,
    attend_one,
    decode_rope_tables,
    mlp_decode,
    qkv_decode,
)
from asyncrl.engine.native.sampling import sample_static
from asyncrl.engine.native.step_graphs import (
    StepGraphs,
    batch_bucket,
    batch_buckets,
    length_bucket,
    length_buckets,
)

log = logging.getLogger(__name__)
_FIELDS = ("tok", "pos", "temp", "greedy", "live", "top_k", "top_p", "trunc", "u", "plen")
_F = {name: i for i, name in enumerate(_FIELDS)}


@dataclass(frozen=True, slots=True)
class RowState:
    """What the host knows of one row: the token fed next, its position, and the row's sampling params."""

    token: int
    position: int
    temperature: float
    greedy: bool
    top_k: int
    top_p: float


def row_truncates(temperature: float, top_k: int, top_p: float, vocab: int) -> bool:
    """``processed_logprobs``'s rule: a sampled row with top-k (below V) or top-p (below 1) on."""
    return temperature > 0 and (top_k != -1 and top_k < vocab or top_p < 1.0)


class StaticStep:
    """Static buffers + step body for a ``DecoderRunner``'s model and cache (see module docstring)."""

    def __init__(self, runner: DecoderRunner, vocab_size: int, *, cuda_graphs: bool = False,
                 compile_body: bool | str | Callable[..., Any] | None = False, compile_fallback: bool = False) -> None:
        """``compile_body``: ``torch.compile`` backend of the body (``True``: inductor; falsy: not compiled).
        ``compile_fallback``: a build of the compiled body that fails logs an error and the step runs the
        uncompiled body from then on (``compile_failure`` says why); off, the failure is raised naming the fix."""
        self.runner = runner
        self.cache = runner.cache
        self.vocab = vocab_size
        self.device = runner.device
        self.max_rows = n = runner.cache.max_rows
        dev = self.device
        self.tok = torch.zeros(n, dtype=torch.long, device=dev)
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.temp = torch.ones(n, dtype=torch.float32, device=dev)
        self.greedy = torch.ones(n, dtype=torch.bool, device=dev)
        self.live = torch.zeros(n, dtype=torch.bool, device=dev)
        self.top_k = torch.full((n,), vocab_size, dtype=torch.long, device=dev)
        self.top_p = torch.ones(n, dtype=torch.float32, device=dev)
        self.trunc = torch.zeros(n, dtype=torch.bool, device=dev)
        self.u = torch.zeros(n, dtype=torch.float64, device=dev)
        self.plen = torch.zeros(n, dtype=torch.long, device=dev)
        self.out = torch.zeros(2, n, dtype=torch.float64, device=dev)
        self._state = torch.zeros(len(_FIELDS), n, dtype=torch.float64, device=dev)
        pinned = dev.type == "cuda"
        self._stage = torch.zeros(len(_FIELDS), n, dtype=torch.float64, pin_memory=pinned)
        self._stage_np = self._stage.numpy()
        # two slots: the step whose results the host reads, and the step launched after it (``fetch_start``)
        self._out_host = torch.zeros(2, 2, n, dtype=torch.float64, pin_memory=pinned)
        self._events = (torch.cuda.Event(), torch.cuda.Event()) if pinned else None
        self._slot = 0
        self.dirty = True
        """The host's rows differ from the device state (a join, a leave, an eager step): upload them all."""
        body: Callable[[int, int, bool], None] = self.body
        self.compiled: str | None = None
        """The backend the body is compiled with (None: the body runs uncompiled)."""
        self.compile_failure: str | None = None
        """Why compiling failed, when the step fell back to the uncompiled body (``compile_fallback``)."""
        self.compile_fallback = bool(compile_body) and compile_fallback
        if compile_body:
            from torch._dynamo import config as dynamo_config

            # one compiled graph per (rows, length, truncate) key: every bucket of the largest cache, and the
            # capacities a growing cache passes through
            keys = 2 * len(batch_buckets(n)) * (len(length_buckets(self.cache.max_len)) + 16)
            dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, keys)
            dynamo_config.accumulated_cache_size_limit = max(dynamo_config.accumulated_cache_size_limit, keys)
            backend = compile_body if not isinstance(compile_body, bool) else "inductor"
            self.compiled = backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))
            body = torch.compile(self.body, fullgraph=True, dynamic=False, backend=backend)
        self.graphs = StepGraphs(body, self.device, use_graphs=cuda_graphs)
        self.pad = bool(cuda_graphs or compile_body)
        """Run buckets (padded rows, power-of-two spans) through ``graphs``: what graphs and a compiled body
        need. Off (a plain CPU engine), a step runs its exact shape eagerly, as padding would only add work."""
        self._generation = self.cache.generation

    # ----------------------------------------------------------------- host side

    def upload(self, rows: Sequence[RowState], joining: Sequence[RowState], uniforms: Sequence[float]) -> None:
        """Stage the step's inputs and copy them in: every field when ``dirty``, else only the uniforms.

        ``rows``: the live rows ``0..B-1`` before this step's joins; ``joining``: rows that join at ``B..``
        (``position`` = prompt length, ``token`` unused: they become live in ``sample_joined``);
        ``uniforms``: one per row that samples in this step (``rows``, then ``joining``).
        """
        st = self._stage_np
        if joining:
            self.dirty = True
        if not self.dirty:
            st[_F["u"], : len(uniforms)] = uniforms
            self.u.copy_(self._stage[_F["u"]], non_blocking=True)
            return
        st[:, :] = 0.0
        st[_F["temp"]] = 1.0
        st[_F["greedy"]] = 1.0
        st[_F["top_k"]] = self.vocab
        st[_F["top_p"]] = 1.0
        st[_F["u"], : len(uniforms)] = uniforms
        for r, row in enumerate(rows):
            st[_F["tok"], r] = row.token
            st[_F["pos"], r] = row.position
            st[_F["live"], r] = 1.0
            self._stage_params(r, row)
        for r, row in enumerate(joining, start=len(rows)):
            st[_F["plen"], r] = row.position
            self._stage_params(r, row)
        self._state.copy_(self._stage, non_blocking=True)
        for name in _FIELDS:
            getattr(self, name).copy_(self._state[_F[name]])
        self.dirty = False

    def _stage_params(self, r: int, row: RowState) -> None:
        st = self._stage_np
        st[_F["temp"], r] = row.temperature if row.temperature > 0 else 1.0
        st[_F["greedy"], r] = float(row.greedy)
        trunc = row_truncates(row.temperature, row.top_k, row.top_p, self.vocab)
        st[_F["trunc"], r] = float(trunc)
        st[_F["top_k"], r] = row.top_k if trunc and row.top_k != -1 else self.vocab
        st[_F["top_p"], r] = row.top_p if trunc else 1.0

    @torch.inference_mode()
    def decode(self, n: int, max_pos: int, truncate: bool) -> None:
        """One decode step of live rows ``0..n-1`` (contexts up to ``max_pos + 1``); outputs in ``out[:, :n]``."""
        cache = self.cache
        if cache.kv is None or max_pos + 1 > cache.cap_len:
            raise ValueError(f"the K/V cache holds {cache.cap_len} positions and a row is at {max_pos}; reserve "
                             "before decoding")
        if cache.generation != self._generation:
            self.graphs.invalidate()
            self._generation = cache.generation
        if not self.pad:
            self.body(n, max_pos + 1, truncate)
            return
        rows = batch_bucket(n, self.max_rows)
        self._run_bucket(rows, length_bucket(max_pos + 1, cache.cap_len), truncate)

    def _run_bucket(self, rows: int, length: int, truncate: bool) -> None:
        """``graphs.run`` of one key; the first build of a compiled body that fails falls back or names the fix."""
        key = (rows, length, truncate)
        if self.compiled is None or key in self.graphs.runners:
            self.graphs.run(*key)
            return
        tok, pos = self.tok.clone(), self.pos.clone()  # all a step changes that it reads again (K/V at pos aside)
        try:
            self.graphs.run(*key)
        except Exception as exc:
            if not self.compile_fallback:
                raise RuntimeError(f"building the decode step compiled with torch.compile (backend "
                                   f"{self.compiled}) failed: {type(exc).__name__}: {exc}; set rollout.compile=false "
                                   "(NativeEngine(compile_step=False)) to run it uncompiled") from exc
            self.compile_failure = f"{type(exc).__name__}: {exc}"[:2000]
            log.error("building the decode step compiled with torch.compile (backend %s) failed, so it runs "
                      "uncompiled from now on (set rollout.compile=false to skip compiling): %s",
                      self.compiled, self.compile_failure)
            self.compiled, self.compile_fallback = None, False
            self.graphs.invalidate()
            self.graphs.body = self.body
            self.tok.copy_(tok)
            self.pos.copy_(pos)
            self.graphs.run(*key)

    def bucket_keys(self) -> list[tuple[int, int, bool]]:
        """Every ``(rows, length, truncate)`` key a step can run on the cache as sized now (none off buckets)."""
        if not self.pad or self.cache.kv is None:
            return []
        spans = length_buckets(self.cache.cap_len)
        return [(rows, length, truncate) for truncate in (False, True)
                for rows in batch_buckets(self.max_rows) for length in spans]

    @torch.inference_mode()
    def build_all(self) -> int:
        """Build the runner of every bucket key not built yet (``bucket_keys``); return how many builds it ran.

        The steps it runs are idle rows only: every row is staged as padding (not live, token 0 at position
        0, greedy), so the one K/V position they write, 0 of each row, is saved before and put back after,
        and ``dirty`` makes the next step upload every row's real state. Safe between any two steps.
        """
        cache = self.cache
        if cache.generation != self._generation:
            self.graphs.invalidate()
            self._generation = cache.generation
        keys = [k for k in self.bucket_keys() if k not in self.graphs.runners]
        if not keys:
            return 0
        assert cache.kv is not None
        saved = cache.kv[..., :1, :].clone()  # position 0 of every row: all the idle steps write
        for buf in (self.tok, self.pos, self.u):
            buf.zero_()
        self.live.fill_(False)
        self.greedy.fill_(True)
        self.trunc.fill_(False)
        self.temp.fill_(1.0)
        self.top_p.fill_(1.0)
        self.top_k.fill_(self.vocab)
        built = self.graphs.warmups
        for _ in range(2):  # a second pass when a compile failure dropped the runners built before it
            for key in self.bucket_keys():
                if key not in self.graphs.runners:
                    self._run_bucket(*key)
        cache.kv[..., :1, :].copy_(saved)
        self.dirty = True
        return self.graphs.warmups - built

    @torch.inference_mode()
    def sample_joined(self, row0: int, logits: torch.Tensor, truncate: bool) -> None:
        """Sample the first token of rows ``row0..row0+J-1`` from their prefill ``logits: [J, V]`` and make
        them live at their prompt length (``plen``); outputs in ``out[:, row0:row0+J]``."""
        sl = slice(row0, row0 + logits.shape[0])
        extra = (self.top_k[sl], self.top_p[sl], self.trunc[sl]) if truncate else ()
        tokens, behav = sample_static(logits, self.temp[sl], self.greedy[sl], self.u[sl], *extra)
        self.out[0, sl].copy_(tokens)
        self.out[1, sl].copy_(behav)
        self.tok[sl].copy_(tokens)
        self.pos[sl].copy_(self.plen[sl])
        self.live[sl] = True

    def fetch_start(self, n: int) -> int:
        """Start the one device-to-host copy of a step, ``out[:, :n]``, into a host slot (pinned, non-blocking,
        an event after it, on CUDA); return the slot for ``fetch_wait``. Two slots alternate, so the step after
        this one can be launched and copied before this one is read."""
        slot, self._slot = self._slot, self._slot ^ 1
        self._out_host[slot, :, :n].copy_(self.out[:, :n], non_blocking=True)
        if self._events is not None:
            self._events[slot].record()
        return slot

    def fetch_wait(self, slot: int, n: int) -> tuple[list[int], list[float]]:
        """Tokens and behaviour log-probs of rows ``0..n-1`` of the step whose copy went into ``slot``, once
        it has landed (the event's wait; on a CPU the copy is already done)."""
        if self._events is not None:
            self._events[slot].synchronize()
        out = self._out_host[slot, :, :n].numpy()
        return out[0].astype(np.int64).tolist(), out[1].astype(np.float32).tolist()

    def fetch(self, n: int) -> tuple[list[int], list[float]]:
        """The one device-to-host copy of a step, waited on at once: tokens and log-probs of rows ``0..n-1``."""
        return self.fetch_wait(self.fetch_start(n), n)

    # ----------------------------------------------------------------- device side

    def body(self, rows: int, length: int, truncate: bool) -> None:
        """The step on static shapes: ``rows`` padded rows, attention over ``length`` cached positions.

        Reads ``tok, pos, temp, greedy, u`` (and ``top_k, top_p, trunc`` when ``truncate``) ``[:rows]``;
        writes K/V at ``pos``, ``out[:, :rows]``, and advances ``tok``/``pos`` of live rows.
        """
        runner = self.runner
        base = runner.model.model
        kv = self.cache.kv
        assert kv is not None
        tok, pos = self.tok[:rows], self.pos[:rows]
        x = base.embed_tokens(tok[:, None])
        cos, sin = decode_rope_tables(*base.rotary_emb(x, pos[:, None]))  # once for every layer
        mask = (torch.arange(length, device=x.device)[None, :] <= pos[:, None])[:, None, None, :]
        index = torch.arange(rows, device=x.device)
        span = kv[:, :, :rows, :, :length]  # the rows and positions this step reads and writes, once for every layer
        H, KV, hd = runner.n_heads, runner.n_kv_heads, runner.head_dim
        for li, layer in enumerate(base.layers):
            q, k, v = qkv_decode(layer, layer.input_layernorm(x), cos, sin, H, KV, hd)
            kb, vb = span[li]
            kb[index, :, pos] = k[:, :, 0]
            vb[index, :, pos] = v[:, :, 0]
            x = x + layer.self_attn.o_proj(attend_one(q, kb, vb, mask, runner.scaling))
            x = x + mlp_decode(layer, layer.post_attention_layernorm(x))
        logits = base.norm(x[:, 0])
        logits = runner.model.lm_head(logits).float()
        extra = (self.top_k[:rows], self.top_p[:rows], self.trunc[:rows]) if truncate else ()
        tokens, behav = sample_static(logits, self.temp[:rows], self.greedy[:rows], self.u[:rows], *extra)
        self.out[0, :rows].copy_(tokens)
        self.out[1, :rows].copy_(behav)
        live = self.live[:rows]
        self.tok[:rows].copy_(torch.where(live, tokens, torch.zeros_like(tokens)))
        self.pos[:rows].add_(live.long())
