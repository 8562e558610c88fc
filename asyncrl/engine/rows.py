"""The native engine's per-request row state and model helpers that hold no engine state.

Owns: ``Seq`` (one request from submission to result: its tokens, behaviour log-probs, versions, timings),
``own_memory`` and ``model_eos_ids``.

Must never: touch the KV cache, run a model, or lock anything (the engine thread owns every ``Seq``).

Invariant: ``Seq.cache_len`` is the number of positions whose K/V are in the cache, i.e. the position at
which the newest sampled token is fed next.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asyncrl.engine.base import GenRequest


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
