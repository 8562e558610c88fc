"""The mapping of asyncrl requests and results onto SGLang 0.5.23's native ``/generate`` API.

Owns: one request's client-side record (``Pending``), its ``rid`` and ``sampling_seed``, the stop set and
how it is sent (``stop_token_ids`` or ``ignore_eos`` plus a client-side cut), the request body, the
parsing of the answer into (tokens, behaviour log-probs, versions, finish reason), and the EOS ids SGLang
stops on by default. Every field below was read in SGLang 0.5.23's source (entrypoints/http_server.py,
managers/io_struct.py, layers/sampler.py, utils/weight_versions.py); docs/sglang.md is the long form.

Must never: send anything, hold a lock or touch engine state (``asyncrl.engine.sglang.engine`` owns the request
life cycle); every function here is a pure mapping of its arguments (``model_eos_ids`` reads files).

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
    version string is one the engine set (``str(int)``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.engine.base import FINISH_REASONS, GenRequest


@dataclass(slots=True)
class Pending:
    """A request the engine holds: queued, or in flight as one ``/generate`` call (``t_sent`` set)."""

    req: GenRequest
    rid: str
    t_submit: float
    t_sent: float | None = None


def request_rid(token: str, sample_id: str) -> str:
    """The ``rid`` of a sample: ``<engine token>-<len(sample_id)>:<sample_id>``. The length prefix makes
    the encoding prefix-free, so SGLang's abort-by-prefix never hits another sample."""
    return f"{token}-{len(sample_id)}:{sample_id}"


def request_seed(seed: int, sample_id: str) -> int:
    """Per-request ``sampling_seed`` in [0, 2**63): distinct sample ids (GRPO group members) get distinct
    streams under one run seed; SGLang hashes it with the token position."""
    h = hashlib.blake2b(f"{seed}\x00{sample_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


def stop_set(req: GenRequest, default: Collection[int] | None) -> frozenset[int] | None:
    """The exact stop tokens of a request (``default``: the engine's ``eos_token_ids``); None = whatever
    the server's default EOS is."""
    if req.params.stop_token_ids is not None:
        return frozenset(req.params.stop_token_ids)
    return None if default is None else frozenset(default)


def request_body(p: Pending, stop: frozenset[int] | None, model_eos: frozenset[int] | None) -> dict[str, Any]:
    """The ``/generate`` body of ``p`` with stop set ``stop`` (``stop_set``).

    SGLang 0.5.23 stops on the model's EOS (``model_eos``) unless ``ignore_eos``, and ``ignore_eos`` also
    disables ``stop_token_ids`` (schedule_batch.py ``_check_token_based_finish``). So an explicit stop set
    that contains the model's EOS ids is sent as ``stop_token_ids``; any other explicit set is sent with
    ``ignore_eos`` and applied by ``cut_at_stop`` (exact, since sampling is causal; the tokens after the
    first stop token are wasted compute)."""
    sp = p.req.params
    params: dict[str, Any] = {
        "max_new_tokens": sp.max_new_tokens,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k,
        "sampling_seed": request_seed(sp.seed, p.req.sample_id),
    }
    if stop is not None:
        if model_eos is not None and model_eos <= stop:
            params["stop_token_ids"] = sorted(stop)
        else:
            params["ignore_eos"] = True
    return {
        "input_ids": list(p.req.prompt_ids),
        "rid": p.rid,
        "return_logprob": True,
        "sampling_params": params,
    }


def cut_at_stop(
    ids: list[int], logps: list[float], versions: list[int], reason: str, stop: frozenset[int] | None
) -> tuple[list[int], list[float], list[int], str]:
    """Cut a parsed answer after its first token in ``stop`` (finish reason ``"stop"``); unchanged when
    ``stop`` is None or holds none of its tokens. The three lists have one entry per token."""
    if stop is None:
        return ids, logps, versions, reason
    cut = next((i for i, t in enumerate(ids) if t in stop), None)
    if cut is None:
        return ids, logps, versions, reason
    return ids[: cut + 1], logps[: cut + 1], versions[: cut + 1], "stop"


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
    disagree, a version string the engine did not set).
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
