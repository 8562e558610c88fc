"""Per-publication diagnostics of the quantised actor.

Owns:
  * `code_change_frac(prev, cur, delta)`: fraction of quantised weight codes (per element: fp4 nibbles,
    int8/fp8 codes, bf16/fp32 bit patterns of the target linears) that differ between two
    publications; the quantity behind QuRL's "weight updates vanish under quantisation". Padding
    columns of fp4 blocks are excluded. Returned as `quant/code_change_frac` (docs/algorithms.md §7
    calls it `uaq/code_change_frac`). Given the delta from `prev` to `cur` (delta.py), the codes its
    sparse parts list are the changed ones (and a `same` part has none), so only its dense parts are
    compared again: the same count, without a second comparison of the versions.
  * `quantization_error(state_dict, published)`: per target weight ||W - dequant(Q(W))||_F / ||W||_F,
    as `quant/rel_error_mean` (mean over weights) and `quant/rel_error_max`.
  * `kl_vs_full_precision(model_q, model_fp, probe_input_ids)`: mean over probe positions of
    KL(pi_q || pi_fp) = sum_v p_q (log p_q - log p_fp), fp32 log-softmax of logits / temperature.
  * `publication_metrics(...)`: the dict to log with each published version.

Must never: change a model or a publication.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor, nn

from protocols import DeltaPart

from .delta import PublishedDelta, changed_elements, element_bits, sparse_frame
from .errors import FormatMismatchError, ManifestMismatchError
from .formats import ROLE_CODES, ROLE_FULL, ROLE_WEIGHT, dequantize_weight, weight_suffixes
from .model import EMBED
from .publish import PublishedWeights


def _code_entries(pub: PublishedWeights) -> dict[str, tuple[int, ...]]:
    return {
        e.name: e.logical_shape
        for e in pub.manifest
        if e.role in (ROLE_CODES, ROLE_WEIGHT) and e.logical_shape
    }


def _changed_codes(old: Tensor, new: Tensor, fmt: str, in_features: int) -> int:
    """How many code elements differ between two code tensors of one weight ([N, in_features] logical):
    the bit patterns of their elements, or for fp4 the nibbles of the packed bytes, padding columns left out.
    Only the elements `changed_elements` finds differing are looked into."""
    a, b = element_bits(old).numpy(), element_bits(new).numpy()
    idx = changed_elements(a, b, a.size)  # never None: the limit is every element
    if idx is None or not idx.size or fmt not in ("nvfp4", "mxfp4"):
        return 0 if idx is None else int(idx.size)
    return _changed_nibbles(idx, a[idx] ^ b[idx], old.shape[-1], in_features)


def _changed_nibbles(idx: np.ndarray, xor: np.ndarray, row_bytes: int, in_features: int) -> int:
    """The nibbles that differ in the packed fp4 bytes at flat indices ``idx`` (rows of ``row_bytes``), given the
    XOR of their old and new bytes, padding columns (``>= in_features``) left out."""
    first = (idx % row_bytes) * 2  # the code of the low nibble; the high nibble holds the next one
    return int(np.count_nonzero(((xor & 0x0F) != 0) & (first < in_features))
               + np.count_nonzero(((xor >> 4) != 0) & (first + 1 < in_features)))


def _sparse_changed_codes(old: Tensor, part: DeltaPart, frame: Tensor, fmt: str, in_features: int) -> int:
    """`_changed_codes` of a code tensor from its sparse delta part: the elements it lists (exactly those that
    differ), for fp4 the nibbles of their bytes that differ from ``old``'s."""
    if fmt not in ("nvfp4", "mxfp4"):
        return part.count
    idx, new = sparse_frame(frame, part.count, torch.uint8)  # packed fp4 codes: uint8, like ``old``
    return _changed_nibbles(idx.numpy(), element_bits(old).numpy()[idx.numpy()] ^ new.numpy(), old.shape[-1],
                            in_features)


def code_change_frac(prev: PublishedWeights, cur: PublishedWeights, delta: PublishedDelta | None = None) -> float:
    """Fraction in [0, 1] of code elements that changed from `prev` to `cur` (same format and names).
    ``delta``: `make_delta(prev, cur)` (or the same from a `DeltaStream`), when one was made: its sparse and
    ``same`` parts give their tensors' counts, only its dense parts are compared (the same fraction)."""
    if prev.fmt != cur.fmt:
        raise FormatMismatchError(f"cannot compare codes of {prev.fmt!r} and {cur.fmt!r} publications")
    a, b = _code_entries(prev), _code_entries(cur)
    if a.keys() != b.keys():
        name = sorted(a.keys() ^ b.keys())[0]
        raise ManifestMismatchError("present in only one of the two publications", tensor_name=name)
    parts = {} if delta is None else _parts_of(delta, prev, cur)
    changed = total = 0
    for name, logical in sorted(b.items()):
        part, frame = parts.get(name, (None, None))
        if part is None or part.kind == "dense":
            changed += _changed_codes(prev.tensors[name], cur.tensors[name], cur.fmt, logical[1])
        elif part.kind == "sparse":
            assert frame is not None
            changed += _sparse_changed_codes(prev.tensors[name], part, frame, cur.fmt, logical[1])
        total += logical[0] * logical[1]  # a ``same`` part: none changed
    return changed / total if total else 0.0


def _parts_of(delta: PublishedDelta, prev: PublishedWeights,
              cur: PublishedWeights) -> dict[str, tuple[DeltaPart, Tensor | None]]:
    """{name: (part, frame or None)} of a delta from ``prev`` to ``cur`` (ManifestMismatchError for another one)."""
    if (delta.base_checksum, delta.checksum) != (prev.checksum, cur.checksum):
        raise ManifestMismatchError(f"the delta is from version {delta.base_version} to {delta.version}, not from "
                                    f"{prev.version} to {cur.version}")
    frames = iter(delta.payloads)
    return {p.name: (p, None if p.kind == "same" else next(frames)) for p in delta.parts}


def quantization_error(state_dict: Mapping[str, Tensor], published: PublishedWeights) -> dict[str, float]:
    """Relative Frobenius error of every published target weight against the full-precision one."""
    errs = []
    suffixes = weight_suffixes(published.fmt)
    for name, logical in sorted(_code_entries(published).items()):
        prefix = name.rpartition(".")[0] + "."
        w = state_dict.get(prefix + "weight")
        if w is None:
            raise ManifestMismatchError(
                "no full-precision weight to compare with", tensor_name=prefix + "weight"
            )
        parts = {s: published.tensors[prefix + s] for s in suffixes}
        deq = dequantize_weight(parts, published.fmt, logical[1])
        wf = w.detach().float().cpu()
        denom = float(torch.linalg.vector_norm(wf))
        errs.append(float(torch.linalg.vector_norm(wf - deq)) / denom if denom > 0 else 0.0)
    if not errs:
        return {"quant/rel_error_mean": 0.0, "quant/rel_error_max": 0.0}
    return {"quant/rel_error_mean": sum(errs) / len(errs), "quant/rel_error_max": max(errs)}


@torch.no_grad()
def kl_vs_full_precision(
    model_q: nn.Module,
    model_fp: nn.Module,
    probe_input_ids: Tensor,
    *,
    attention_mask: Tensor | None = None,
    temperature: float = 1.0,
) -> float:
    """Mean KL(pi_q || pi_fp) over the (unmasked) positions of a fixed probe batch.

    probe_input_ids: [B, T] int64; attention_mask: [B, T] (1 = real token) or None.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
    lq = torch.log_softmax(model_q(probe_input_ids, **kwargs).logits.float() / temperature, dim=-1)
    lf = torch.log_softmax(model_fp(probe_input_ids, **kwargs).logits.float() / temperature, dim=-1)
    kl = (lq.exp() * (lq - lf)).sum(-1)  # [B, T]
    if attention_mask is None:
        return float(kl.mean())
    m = attention_mask.to(kl.dtype)
    return float((kl * m).sum() / m.sum().clamp_min(1))


def publication_metrics(
    published: PublishedWeights,
    *,
    previous: PublishedWeights | None = None,
    state_dict: Mapping[str, Tensor] | None = None,
) -> dict[str, float]:
    """Metrics to log with a published version: bytes, bytes per target-weight element, AQN
    sigma, code change vs `previous` and quantisation error vs `state_dict` when given."""
    n_weight = sum(
        e.logical_shape[0] * e.logical_shape[1]
        for e in published.manifest
        if e.role in (ROLE_CODES, ROLE_WEIGHT) and e.logical_shape
    )
    linear_bytes = sum(e.nbytes for e in published.manifest  # (an int8 embedding, quant.embedding, is no linear)
                       if e.role != ROLE_FULL and not e.name.startswith(EMBED + "."))
    out = {
        "quant/version": float(published.version),
        "quant/bytes": float(published.total_bytes()),
        "quant/linear_bytes_per_param": linear_bytes / n_weight if n_weight else 0.0,
        "aqn/sigma": float(published.aqn_sigma),
    }
    if previous is not None:
        out["quant/code_change_frac"] = code_change_frac(previous, published)
    if state_dict is not None:
        out.update(quantization_error(state_dict, published))
    return out
