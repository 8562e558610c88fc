"""Weight-update payloads for an SGLang server.

Owns: turning what ``SGLangEngine.update_weights`` accepts into SGLang 0.5.23 request bodies --
  * a full-precision HF state dict, or an ``asyncrl.quant.PublishedWeights`` in ``fp32``/``bf16``
    -> ``/update_weights_from_tensor`` bodies, in the names of the model's checkpoint files (what SGLang's
    ``load_weights`` reads, ``checkpoint_named_tensors``: transformers' fused expert tensors split back into
    one tensor per expert, a tied ``lm_head.weight`` left out, q/k norms and everything else as named): ``serialized_named_tensors`` is one base64 string per
    tensor-parallel rank holding a pickled ``[(hf_name, tensor), ...]`` list. The tensors are pickled
    *by value* (plain ``pickle``, not SGLang's ``ForkingPickler``, whose CPU tensors travel as shared-memory
    handles that another process on another machine cannot open). SGLang's ``SafeUnpickler`` accepts
    exactly these globals (``torch._utils._rebuild_tensor_v2``, ``torch.storage._load_from_bytes``);
  * a folder (``str``/``Path``) -> ``/update_weights_from_disk`` with ``model_path``.

Must never: quantize (SGLang quantizes on load in ``--quantization fp8 --load-format flash_rl``), send a
quantized publication (its ``qweight``/``weight_scale`` names and per-row scales match no SGLang 0.5.23
loader that can be re-loaded in place, see docs/sglang.md), or mutate the caller's tensors.

Invariants: the checkpoint names of an update are exactly the keys ``save_pretrained`` writes for the model
(minus a tied head); chunks keep the (renamed) tensor order; every tensor is in exactly one chunk; a chunk exceeds
``max_chunk_bytes`` only when one tensor alone does.
"""

from __future__ import annotations

import base64
import json
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FULL_PRECISION_PUBLICATIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class TensorUpdate:
    """A validated tensor update: ``named`` is ``[(hf_name, cpu tensor)]`` in the order given."""

    named: list[tuple[str, Any]] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.named)


def checkpoint_named_tensors(named: Sequence[tuple[str, Any]], config: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``[(name, tensor)]`` in the model's runtime names (``state_dict()`` of transformers 5) -> the names of its
    checkpoint files, which SGLang's ``load_weights`` reads: transformers' own reverse conversion (the one
    ``save_pretrained`` applies) splits fused expert tensors (``mlp.experts.gate_up_proj [E, 2I, H]``) into
    ``mlp.experts.{e}.gate_proj.weight`` / ``up_proj.weight`` (Mixtral: ``block_sparse_moe.experts.{e}.w1/w3``)
    and renames what it renamed on load. With ``tie_word_embeddings`` the ``lm_head.weight`` copy is left out
    (SGLang ties it to the embedding); an untied model's update must carry it. ``config``: config.json values."""
    from asyncrl.models.names import checkpoint_state_dict

    tied = bool(config.get("tie_word_embeddings", False))
    names = [n for n, _ in named]
    if not tied and "lm_head.weight" not in names and "model.embed_tokens.weight" in names:
        raise ValueError("the model's head is not tied to its embedding, so an update must carry lm_head.weight; "
                         "send the learner's full state dict")
    state = {n: t for n, t in named if not (tied and n == "lm_head.weight")}
    return list(checkpoint_state_dict(config, state).items())


def served_config(model_path: str | Path | None) -> dict[str, Any] | None:
    """The config.json values of the folder an SGLang server serves, when that folder is on this host."""
    if not model_path or not (Path(model_path) / "config.json").is_file():
        return None
    return json.loads((Path(model_path) / "config.json").read_text())


def prepare_update(weights: Any, model_path: str | Path | None = None) -> TensorUpdate | Path:
    """Validate what ``update_weights`` was given (any thread, before queueing); ``ValueError`` with the fix.
    ``model_path``: the served folder; when its config.json is readable here, tensor updates travel in its
    checkpoint names (``checkpoint_named_tensors``), else in the names given."""
    if isinstance(weights, (str, Path)):
        folder = Path(weights)
        if not folder.is_dir():
            raise ValueError(
                f"weights folder {str(folder)!r} does not exist; save the HF checkpoint there first"
            )
        return folder
    import torch

    if isinstance(weights, Mapping):
        bad = [k for k, v in weights.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
        if bad or not weights:
            raise ValueError(f"a state dict update needs str -> tensor entries; bad entries: {bad[:5]}")
        named = [(k, v) for k, v in weights.items()]
    else:
        named = _published_named(weights)
    config = served_config(model_path)
    if config is not None:
        named = checkpoint_named_tensors(named, config)
    return TensorUpdate([(k, _detached(v)) for k, v in named])


def _published_named(weights: Any) -> list[tuple[str, Any]]:
    """The tensors of an fp32/bf16 ``PublishedWeights`` (verified), in manifest order."""
    from asyncrl.quant import PublishedWeights

    if isinstance(weights, PublishedWeights):
        if weights.fmt not in FULL_PRECISION_PUBLICATIONS:
            raise ValueError(
                f"SGLang takes full-precision updates; got a {weights.fmt!r} publication. Publish in 'fp32' or "
                "'bf16' (a server started with quant_format='fp8' quantizes them on load)"
            )
        weights.verify()
        return [(e.name, weights.tensors[e.name]) for e in weights.manifest]
    raise ValueError(
        "weights must be a state dict, an asyncrl.quant.PublishedWeights (fp32/bf16) or a checkpoint folder; "
        f"got {type(weights).__name__}"
    )


def _detached(t: Any) -> Any:
    """A CPU tensor owning exactly its bytes (pickling a view would ship its whole storage)."""
    t = t.detach().to("cpu")
    if t.storage_offset() != 0 or not t.is_contiguous() or t.untyped_storage().nbytes() != t.nbytes:
        t = t.contiguous().clone()
    return t


def chunk_update(update: TensorUpdate, max_chunk_bytes: int) -> list[list[tuple[str, Any]]]:
    """Split into consecutive chunks of at most ``max_chunk_bytes`` (one oversized tensor = own chunk)."""
    chunks: list[list[tuple[str, Any]]] = []
    size = 0
    for name, t in update.named:
        n = t.numel() * t.element_size()
        if not chunks or (size + n > max_chunk_bytes and chunks[-1]):
            chunks.append([])
            size = 0
        chunks[-1].append((name, t))
        size += n
    return chunks


def serialize_named_tensors(named: Sequence[tuple[str, Any]]) -> str:
    """Base64 of a by-value pickle of ``[(name, tensor)]`` (what SGLang's ``MultiprocessingSerializer``
    deserializes for one tensor-parallel rank)."""
    return base64.b64encode(pickle.dumps(list(named), protocol=4)).decode("ascii")


def tensor_bodies(
    update: TensorUpdate, version: int, *, tp_size: int = 1, max_chunk_bytes: int = 256 << 20
) -> list[dict[str, Any]]:
    """``/update_weights_from_tensor`` bodies; only the last carries ``weight_version`` (the version moves
    once every chunk is loaded). ``flush_cache`` is off: the engine pauses in place, and SGLang refuses
    (fails the update) to flush while requests are running."""
    bodies = []
    chunks = chunk_update(update, max_chunk_bytes)
    for i, chunk in enumerate(chunks):
        payload = serialize_named_tensors(chunk)
        body: dict[str, Any] = {"serialized_named_tensors": [payload] * tp_size, "flush_cache": False}
        if i == len(chunks) - 1:
            body["weight_version"] = str(version)
        bodies.append(body)
    return bodies


def disk_body(folder: Path, version: int) -> dict[str, Any]:
    """``/update_weights_from_disk`` body (needs no ``/begin_weight_update`` ... ``/end_weight_update`` around it in SGLang 0.5.23)."""
    return {"model_path": str(folder), "weight_version": str(version), "flush_cache": False}
