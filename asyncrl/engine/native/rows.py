"""The native engine's per-request row state, request admission, and model helpers that hold no engine state.

Owns: ``Seq`` (one request from submission to result: its tokens, behaviour log-probs, versions, timings,
the finish rule and the ``GenResult`` it becomes), ``new_rows`` (the checks a submitted request must pass
before it is queued), ``take_admissible`` (which queued requests join the batch at a step boundary),
``split_aborted`` (which queued requests an abort or ``close`` finishes), ``own_memory`` and
``model_eos_ids``.

Must never: touch the KV cache, run a model, or lock anything (callers hold the locks: ``new_rows`` runs
before anything is queued, ``take_admissible``/``split_aborted`` under the engine's ``_lock``, every other
use of a ``Seq`` on the engine thread).

Invariant: ``Seq.cache_len`` is the number of positions whose K/V are in the cache, i.e. the position at
which the newest sampled token is fed next.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from asyncrl.engine.base import GenRequest, GenResult


@dataclass(slots=True)
class Seq:
    req: GenRequest
    stop_ids: frozenset[int]
    limit: int
    t_submit: float
    response: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    t_admit: float | None = None
    t_first: float | None = None

    @property
    def cache_len(self) -> int:
        """Positions whose K/V are in the cache (the newest sampled token is not yet fed)."""
        return len(self.req.prompt_ids) + max(len(self.response) - 1, 0)

    def record(self, token: int, logp: float, version: int, now: float) -> str | None:
        """Append one sampled token with its behaviour log-prob and version; return the finish reason it
        causes (``"stop"`` for a stop token, ``"length"`` at the token limit) or None."""
        self.response.append(token)
        self.logps.append(logp)
        self.versions.append(version)
        if self.t_first is None:
            self.t_first = now
        if token in self.stop_ids:
            return "stop"
        if len(self.response) >= self.limit:
            return "length"
        return None

    def result(self, reason: str, now: float) -> GenResult:
        """The finished sample (``behav_logp: [T] float32``, ``versions: [T] int32``) with its timings."""
        timings = {"total_s": now - self.t_submit, "queue_s": (self.t_admit or now) - self.t_submit}
        if self.t_first is not None:
            timings["ttft_s"] = self.t_first - self.t_submit
        return GenResult(
            sample_id=self.req.sample_id,
            prompt_ids=list(self.req.prompt_ids),
            response_ids=list(self.response),
            behav_logp=np.asarray(self.logps, dtype=np.float32),
            versions=np.asarray(self.versions, dtype=np.int32),
            finish_reason=reason,
            timings=timings,
        )


def new_rows(
    requests: Sequence[GenRequest], *, max_seq_len: int, vocab_size: int, eos_ids: Collection[int], now: float
) -> list[Seq]:
    """One ``Seq`` per request, or ``ValueError`` naming the first bad one (a prompt of ``max_seq_len``
    tokens or more, a token outside ``[0, vocab_size)``, a sample id given twice). ``eos_ids`` are the
    stop tokens of a request with ``stop_token_ids=None``; a row may generate up to ``max_new_tokens``
    and never past ``max_seq_len``."""
    seqs = []
    ids = set()
    for req in requests:
        n = len(req.prompt_ids)
        if n >= max_seq_len:
            raise ValueError(
                f"request {req.sample_id!r}: prompt has {n} tokens but max_seq_len={max_seq_len}; "
                "shorten the prompt or raise max_seq_len"
            )
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"request {req.sample_id!r}: token ids {bad[:5]} outside vocab [0, {vocab_size})")
        if req.sample_id in ids:
            raise ValueError(f"sample_id {req.sample_id!r} appears twice in one submit; ids must be unique")
        ids.add(req.sample_id)
        p = req.params
        stop = frozenset(eos_ids) if p.stop_token_ids is None else frozenset(p.stop_token_ids)
        seqs.append(Seq(req, stop, min(p.max_new_tokens, max_seq_len - n), now))
    return seqs


def take_admissible(inbox: deque[Seq], active: int, max_batch_size: int, max_prefill_tokens: int) -> list[Seq]:
    """Pop from the front of ``inbox`` the requests that join a batch of ``active`` rows: while a slot is
    free and their prompts fit the prefill-token budget (the first one always goes, however long)."""
    out: list[Seq] = []
    budget = max_prefill_tokens
    while inbox and active + len(out) < max_batch_size:
        n = len(inbox[0].req.prompt_ids)
        if out and n > budget:
            break
        budget -= n
        out.append(inbox.popleft())
    return out


def own_memory(model: torch.nn.Module) -> None:
    """Give every parameter and buffer its own memory (``NativeEngine.from_pretrained``; an engine
    built around given tensors, like the learner's evaluation, uses them in place). ``from_pretrained``
    maps the safetensors file, and quantization reads every page of it; while one tensor still views
    the mapping (the embedding, the norms) all those pages stay resident, more than the engine's own
    tensors (docs/benchmarks.md §8, "Where the job's memory goes"). Tied weights stay tied (one
    parameter object, copied once)."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.data = t.data.clone()


def model_eos_ids(model: torch.nn.Module) -> list[int]:
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    return []


def split_aborted(inbox: deque[Seq], aborts: Collection[str], closed: bool) -> tuple[deque[Seq], list[Seq]]:
    """(kept, aborted): the queued requests that stay, in order, and those to finish as ``"abort"`` (the
    ones in ``aborts``, or all of them once the engine is ``closed``)."""
    keep: deque[Seq] = deque()
    gone: list[Seq] = []
    for s in inbox:
        (gone if closed or s.req.sample_id in aborts else keep).append(s)
    return keep, gone
