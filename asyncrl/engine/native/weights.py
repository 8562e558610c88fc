"""Weight handling for the native engine: quantizing the actor once, validating and loading updates.

Owns: the bridge between the engine and ``asyncrl.quant`` (the only native-engine module that imports it)
and the loading of plain state dicts.

Must never: quantize on the hot path of a weight update when a ``PublishedWeights`` is given (those are
loaded as published, ``asyncrl.quant.load_published``), or replace parameter tensors (loads copy in
place, so the decoder's references and the KV cache stay valid).

Contract with asyncrl.quant: ``quantize_model(model, fmt) -> model`` swaps Linear layers in place;
``publish(state_dict, fmt, version=v) -> PublishedWeights``; ``load_published(model, published)``;
``apply_delta(model, delta)`` for a ``PublishedDelta`` from the version the model holds;
``load_buckets(model, buckets)`` for a version (or delta) streamed in buckets, loaded as it arrives.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from asyncrl.quant import (
    LoadedVersion,
    PublishedDelta,
    PublishedWeights,
    apply_delta,
    load_buckets,
    load_published,
    publish,
    quantize_model,
    quantizes_embedding,
    quantizes_head,
)
from protocols.values import FORMATS as QUANT_FORMATS


def quantize_actor(model: torch.nn.Module, fmt: str, *, head: bool = False,
                   embedding: bool = False) -> torch.nn.Module:
    """Return the actor for ``fmt``: the model itself for fp32, else ``asyncrl.quant.quantize_model``
    (``head``: the output head too, ``quant.lm_head``; ``embedding``: the token embedding as int8 codes,
    ``quant.embedding``; fp32 converts nothing)."""
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"quant_format must be one of {QUANT_FORMATS}, got {fmt!r}")
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if fmt != "fp32":
        model = quantize_model(model, fmt, head=head, embedding=embedding)
    vars(model)["_asyncrl_hf_shapes"] = shapes  # a plain attribute (nn.Module.__setattr__ types it as a tensor)
    return model


def check_weights(weights: Any, fmt: str, model: torch.nn.Module) -> None:
    """Cheap checks before an update is queued (any thread); raises ``ValueError`` with the fix.

    A plain state dict must name exactly the model's HF parameters (a tied ``lm_head.weight`` may be
    absent) with matching shapes; a ``PublishedWeights`` must be of the engine's format.
    """
    if isinstance(weights, Mapping):
        bad = [k for k, v in weights.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise ValueError(f"state dict values must be tensors; not tensors: {bad[:5]}")
        expected = _hf_shapes(model)
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        missing = [k for k in expected if k not in weights and not (tied and k == "lm_head.weight")]
        unexpected = [k for k in weights if k not in expected]
        wrong = [k for k in expected if k in weights and tuple(weights[k].shape) != expected[k]]
        if missing or unexpected or wrong:
            raise ValueError(
                f"state dict does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}, "
                f"wrong shape {wrong[:5]}; send the learner's full HF state dict"
            )
        return
    if not isinstance(weights, (PublishedWeights, PublishedDelta)):
        raise ValueError("weights must be a state dict or an asyncrl.quant.PublishedWeights or PublishedDelta, got "
                         f"{type(weights).__name__}")
    if weights.fmt != fmt:
        raise ValueError(f"published weights are {weights.fmt!r} but this engine runs {fmt!r}; publish in {fmt!r}")


def _hf_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the full-precision HF parameters the model was built from.

    Recorded on the model by ``quantize_actor`` before any Linear is swapped, so it is the learner's view
    even for a quantized actor.
    """
    shapes = getattr(model, "_asyncrl_hf_shapes", None)
    if shapes is None:
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    return shapes


def apply_weights(model: torch.nn.Module, weights: Any, fmt: str, version: int) -> None:
    """Load ``weights`` into ``model`` in place (engine thread, at a step boundary)."""
    if isinstance(weights, Mapping):
        if fmt == "fp32":
            load_plain_state_dict(model, weights)
            return
        load_published(model, publish(dict(weights), fmt, version=version, head=quantizes_head(model),
                                      embedding=quantizes_embedding(model)))
        return
    if isinstance(weights, PublishedDelta):
        apply_delta(model, weights)
        return
    load_published(model, weights)


@torch.no_grad()
def load_plain_state_dict(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy a full-precision HF state dict into ``model``; a tied ``lm_head.weight`` may be absent."""
    missing, unexpected = model.load_state_dict(dict(state_dict), strict=False)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    allowed = {"lm_head.weight"} if tied else set()
    missing = [k for k in missing if k not in allowed]
    if missing or unexpected:
        raise ValueError(
            f"state dict does not match the model: missing {missing[:5]}, unexpected {list(unexpected)[:5]}; "
            "send the learner's full HF state dict"
        )


def stream_weights(model: torch.nn.Module, buckets: Iterable[Any], version: int) -> LoadedVersion:
    """Load ``version`` into ``model`` bucket by bucket as the buckets arrive (``asyncrl.quant.load_buckets``):
    all or nothing, in place. The caller holds the engine's step boundary for the whole load."""
    return load_buckets(model, buckets, version=version)
