"""The two ways one engine step turns live and joining rows into sampled tokens: static and eager.

Owns: ``static_forward`` (the static step of ``asyncrl.engine.native.static_step`` for the live rows, one eager
prefill forward for all the joining rows plus static sampling of their first tokens, no host sync before the
step's one device-to-host copy, which it starts and leaves to the caller to wait on), ``static_forward_ahead``
(the static step launched while the one before it is still in flight) and ``eager_forward`` (the reference:
``DecoderRunner.decode`` + prefill, ``sampling.processed_logprobs`` + ``sampling.sample_tokens``; forward
AQN runs here).

Must never: change the batch other than through ``join`` (the engine's, which appends the joining rows to
``active`` and sizes the cache), or draw randomness other than ``sampling.request_uniform``.

Invariant: the tokens of rows ``0..len(active)-1`` after the join (``eager_forward``'s return, the copy
``static_forward`` starts) are equal token for token (and log-prob to float rounding) for the same weights and rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from asyncrl.engine.native.decoder import DecoderRunner
from asyncrl.engine.native.rows import Seq
from asyncrl.engine.native.sampling import processed_logprobs, request_uniform, sample_tokens
from asyncrl.engine.native.static_step import RowState, StaticStep, row_truncates

Join = Callable[[list[Seq]], int]


class EagerCache(Protocol):
    need_len: int

    def move_row(self, src: int, dst: int, length: int) -> None: ...

    def release(self) -> None: ...


class EagerRunner(Protocol):
    """What the eager path needs of a runner: ``DecoderRunner``, or any runner of another architecture."""

    @property
    def cache(self) -> EagerCache: ...

    def prefill(self, row0: int, prompts: list[list[int]], live_rows: int) -> torch.Tensor:
        """K/V of ``prompts`` into rows ``row0..``; next-token logits ``[n, V] float32``."""
        ...

    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One token per live row at its position; logits ``[B, V] float32``."""
        ...


def _row_state(s: Seq, token: int, position: int) -> RowState:
    p = s.req.params
    return RowState(token, position, p.temperature, p.greedy, p.top_k, p.top_p)


def _truncates(s: Seq, vocab: int) -> bool:
    p = s.req.params
    return row_truncates(p.temperature, p.top_k, p.top_p, vocab)


def static_forward(st: StaticStep, runner: DecoderRunner, active: list[Seq], admitted: list[Seq],
                   join: Join) -> int:
    """Static step for the live rows, one prefill forward + static sampling for the joining ones; starts the
    step's one device-to-host copy and returns its slot (``StaticStep.fetch_wait`` reads it)."""
    live = list(active)
    # the rows' full state only when it is uploaded (after a join, a leave, an eager step); else the uniforms
    rows = [_row_state(s, s.response[-1], s.cache_len) for s in live] if st.dirty or admitted else []
    joining = [_row_state(s, 0, len(s.req.prompt_ids)) for s in admitted]
    uniforms = [request_uniform(s.req.params.seed, s.req.sample_id, len(s.response)) for s in live + admitted]
    st.upload(rows, joining, uniforms)
    if live:
        max_pos = max(s.cache_len for s in live)
        cache = runner.cache
        assert cache.dtype is not None, "live rows were prefilled"
        cache.reserve(len(live), max_pos + 1, cache.dtype, st.device)
        st.decode(len(live), max_pos, any(_truncates(s, st.vocab) for s in live))
    if admitted:
        row0 = join(admitted)
        logits = runner.prefill(row0, [s.req.prompt_ids for s in admitted], len(active))
        st.sample_joined(row0, logits, any(_truncates(s, st.vocab) for s in admitted))
    return st.fetch_start(len(active))


def static_forward_ahead(st: StaticStep, runner: DecoderRunner, active: list[Seq]) -> int:
    """The static step of the live rows launched while the step before it is in flight (its results not read
    yet): the same rows (no join or leave since), each one token further than the host has recorded, so it
    feeds that token (already on the device) at ``prompt + len(response)`` and samples token ``len(response) + 1``;
    only those uniforms go up. Starts the step's copy and returns its slot."""
    if st.dirty:
        raise RuntimeError("a step launched ahead needs the device rows of the step in flight; drain it first")
    uniforms = [request_uniform(s.req.params.seed, s.req.sample_id, len(s.response) + 1) for s in active]
    st.upload([], [], uniforms)
    max_pos = max(len(s.req.prompt_ids) + len(s.response) for s in active)
    cache = runner.cache
    assert cache.dtype is not None, "live rows were prefilled"
    cache.reserve(len(active), max_pos + 1, cache.dtype, st.device)
    st.decode(len(active), max_pos, any(_truncates(s, st.vocab) for s in active))
    return st.fetch_start(len(active))


def eager_forward(runner: EagerRunner, active: list[Seq], admitted: list[Seq], join: Join,
                  aqn: Any) -> tuple[list[int], list[float]]:
    """The reference path: eager decode + prefill, ``processed_logprobs`` + ``sample_tokens``."""
    parts = []
    if active:
        tokens = [s.response[-1] for s in active]
        positions = [s.cache_len for s in active]
        if aqn is not None:  # the noise of the forward that samples token len(response) of each row
            aqn.set_rows([(s.req.sample_id, len(s.response)) for s in active])
        parts.append(runner.decode(tokens, positions))
    if admitted:
        row0 = join(admitted)
        if aqn is not None:
            aqn.set_rows([(s.req.sample_id, 0) for s in admitted])
        parts.append(runner.prefill(row0, [s.req.prompt_ids for s in admitted], len(active)))
    if aqn is not None:
        aqn.set_rows(None)
    logits = parts[0] if len(parts) == 1 else torch.cat(parts)
    params = [s.req.params for s in active]
    logp = processed_logprobs(
        logits, [p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params]
    )
    uniforms = [
        request_uniform(p.seed, s.req.sample_id, len(s.response))
        for p, s in zip(params, active, strict=True)
    ]
    tokens_t, behav_t = sample_tokens(logp, uniforms, [p.greedy for p in params])
    return tokens_t.tolist(), behav_t.tolist()
