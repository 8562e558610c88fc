"""The rollout-engine contract: request/result dataclasses and the ``RolloutEngine`` Protocol.

Owns: the plain data types every engine speaks (``SamplingParams``, ``GenRequest``, ``GenResult``),
the Protocol that the native torch engine and the SGLang engine both implement (docs/architecture.md §3),
and ``EngineClosedError``, the one error every engine raises for work handed to it after ``close``.

Must never: import zmq, transformers or any engine implementation, or encode anything (the value lists it
shares with the wire, ``FINISH_REASONS``, come from ``protocols.values``). Wire encoding of these
types belongs to ``protocols/`` and ``workers/``; this module is plain Python + numpy.

Invariants of a ``GenResult`` (checked by ``GenResult.__post_init__``):
  * ``len(response_ids) == behav_logp.shape[0] == versions.shape[0]``;
  * ``behav_logp`` is float32, ``versions`` is int32, both 1-D;
  * ``finish_reason`` is one of ``FINISH_REASONS``; a ``"stop"`` result ends with a stop token.

Behaviour log-prob (docs/algorithms.md §2.1): for a sampled token ``y_t`` it is the log-probability of ``y_t``
under the distribution the engine actually drew from, computed in fp32 over the full vocabulary:
``log_softmax(logits.float() / temperature)[y_t]``. Greedy decoding (``temperature == 0``) reports the raw
``log_softmax(logits.float())[y_t]``. With truncation enabled (``top_k > 0`` or ``top_p < 1``) the drawn-from
distribution is the renormalised truncated one, and that is what is reported (docs/algorithms.md §2.1: the
learner's prox log-probs are not truncated, so truncation biases the mismatch upward; training rollouts keep
``top_p=1, top_k=-1``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from protocols.values import FINISH_REASONS


class EngineClosedError(RuntimeError):
    """Raised by an engine's ``submit``/``update_weights`` after its ``close()``: build a new engine."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """How one request is decoded.

    ``max_new_tokens`` counts response tokens (the stop token, when one is sampled, is included).
    ``stop_token_ids=None`` means "the engine's default stop tokens" (the model's EOS ids); an explicit
    tuple, possibly empty, is used exactly. ``seed`` together with the request's ``sample_id`` fixes the
    random stream of that request (see docs/engine.md, "Reproducibility").
    """

    max_new_tokens: int
    """Upper bound on response tokens; reaching it ends the sample with finish_reason ``"length"``."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus truncation in (0, 1]; 1 disables it."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 disables it."""
    stop_token_ids: tuple[int, ...] | None = None
    """Tokens that end the sample (included in the response); None = the engine's EOS ids."""
    seed: int = 0
    """Run-level seed; combined with ``sample_id`` to give each request its own random stream."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 disables nucleus truncation), got {self.top_p!r}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not all(
                isinstance(t, int) and t >= 0 for t in self.stop_token_ids
            ):
                raise ValueError(
                    f"stop_token_ids must be a tuple of non-negative ints or None, got {self.stop_token_ids!r}"
                )
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class GenRequest:
    """One sample to generate. ``sample_id`` must be unique among the engine's live requests."""

    sample_id: str
    prompt_ids: list[int]
    params: SamplingParams

    def __post_init__(self) -> None:
        if not isinstance(self.sample_id, str) or not self.sample_id:
            raise ValueError(f"sample_id must be a non-empty str, got {self.sample_id!r}")
        if len(self.prompt_ids) == 0:
            raise ValueError(f"request {self.sample_id!r}: prompt_ids is empty; give at least one token")


@dataclass(slots=True)
class GenResult:
    """One finished sample.

    Shapes: ``response_ids`` has T entries, ``behav_logp: [T] float32``, ``versions: [T] int32``
    (``versions[t]`` is the policy version of the weights whose logits produced token t).
    ``timings`` holds wall-clock durations in seconds: ``queue_s`` (submit -> admitted into the batch),
    ``ttft_s`` (submit -> first token; absent if none was produced), ``total_s`` (submit -> finished).
    """

    sample_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    behav_logp: np.ndarray
    versions: np.ndarray
    finish_reason: str
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.finish_reason in FINISH_REASONS, self.finish_reason
        assert self.behav_logp.dtype == np.float32 and self.behav_logp.ndim == 1
        assert self.versions.dtype == np.int32 and self.versions.ndim == 1
        assert len(self.response_ids) == self.behav_logp.shape[0] == self.versions.shape[0]

    @property
    def num_tokens(self) -> int:
        return len(self.response_ids)


@runtime_checkable
class RolloutEngine(Protocol):
    """What a generation worker needs from an engine (docs/architecture.md §3).

    Thread-safety contract (every engine): ``submit``, ``update_weights``, ``abort``, ``pause``,
    ``resume``, ``close``, ``capabilities`` and the read-only properties may be called from any thread at
    any time. ``generate`` is driven by one thread at a time (the engine thread). Requests submitted from
    other threads while ``generate`` runs join the running batch and are yielded by that same ``generate``.
    Weight updates, aborts and pauses take effect at the next decode-step boundary. See docs/engine.md.
    """

    def submit(self, requests: Sequence[GenRequest]) -> None:
        """Queue requests; they join the running batch at the next step boundary. Any thread."""
        ...

    def generate(self, requests: Sequence[GenRequest] = ()) -> Iterator[GenResult]:
        """Submit ``requests`` and yield every result as it finishes, until no request is live."""
        ...

    def poll(self, timeout: float) -> list[GenResult]:
        """Engine thread, non-blocking beyond ``timeout`` seconds: advance the engine and return the results
        that finished since the last call (possibly none). A streaming worker calls it in a loop instead of
        ``generate``, which returns once no request is live. Raises what ``generate`` would raise (e.g. a
        weight update or a request the engine's server rejected); the engine stays usable afterwards."""
        ...

    def update_weights(self, version: int, weights: Any) -> None:
        """Swap to policy ``version`` at the next step boundary (latest pending update wins). Any thread."""
        ...

    def pause(self) -> None:
        """Stop decoding after the current step; in-flight samples keep their state. Any thread."""
        ...

    def resume(self) -> None:
        """Undo ``pause``. Any thread."""
        ...

    def abort(self, sample_ids: Sequence[str]) -> None:
        """Finish these samples with ``finish_reason="abort"`` at the next boundary. Any thread."""
        ...

    def close(self) -> None:
        """Abort everything live and release the model. Idempotent. Any thread."""
        ...

    def capabilities(self) -> dict[str, Any]:
        """Static facts about the engine (name, quant format, device, limits, features)."""
        ...

    @property
    def version(self) -> int:
        """Policy version of the weights the engine serves now (pending updates not counted)."""
        ...
