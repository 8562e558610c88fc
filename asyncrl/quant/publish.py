"""Quantise-on-send weight publication: `publish` on the learner, `load_published` on a worker.

Owns: turning a state dict into a `PublishedWeights` (published.py: the container, its raw-buffer form and
its verification), optionally reporting each tensor as soon as it is ready (``on_entry``: a streamed
publication sends it while the next is quantised), and the validated, all-or-nothing load into a model
converted with `quantize_model`.

Publication layout: every target linear weight `P.weight` (selection rule in model.py) is replaced by
its format tensors `P.qweight`, `P.weight_scale`, ... (formats.py); every other state-dict entry is
copied untouched. With ``embedding=True`` (``quant.embedding``) the token embedding
`model.embed_tokens.weight` is replaced by its int8 row codes `model.embed_tokens.qweight` and
`model.embed_tokens.weight_scale` (embedding.py; manifest entries of format "int8" without a logical shape:
they are not a linear's). Names showing the same memory published the same way (tied embeddings:
`lm_head.weight` and `model.embed_tokens.weight`; a tied int8 head and a quantised embedding) are published
once, under the first name in sorted order; the loader fills the other name through the model's own tie. Tensor names are exactly the state-dict keys of
the converted model. Manifest entries (`protocols.TensorSpec`, built by wire.manifest_entry) follow the
sorted tensor names and record name, dtype, shape, format, role, byte count, per-tensor digest and, for
codes, the logical [N, K]; the transport ships the same entries unchanged.

Checksum: sha256 (hex) of the canonical JSON header (version, fmt, AQN record, manifest; sorted keys,
no spaces), and the header embeds every tensor's own integrity digest (XXH3-128, wire.py) over its
raw bytes (little-endian, C order). So the checksum covers manifest and bytes, and a byte mismatch is
reported by tensor name.

Device and buffers: every published tensor lands in a send buffer of buffers.py, the one home of the
host memory a publication lives in (`Blocks`, `BufferPool`) and of the staging of a quantised weight into
it (`quantize_for_send`: quantised on the device that holds it, copied to the host once).

Cost: each published tensor is read a bounded number of times (quantisation reads the weight once
for its scale and once for its codes; finiteness of a quantised weight is read off its row/block
amax, not a separate pass; the digest runs at memory speed). The loader verifies and copies in
place into the model's existing tensors (references held by an engine stay valid).

Must never: mutate the state dict it publishes (every published tensor is a fresh CPU copy), pickle
anything, or let `load_published` change the model unless every check has passed.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from protocols import TensorSpec
from protocols.values import AQN_RESAMPLE, require_choice

from . import aqn as aqn_mod
from .buffers import Blocks, BufferPool, quantize_for_send
from .embedding import EMBED_FORMAT, EMBED_SUFFIXES
from .errors import FormatMismatchError, ManifestMismatchError, NonFiniteWeightError, QuantError
from .formats import ROLE_CODES, ROLE_FULL, ROLE_WEIGHT, check_format, weight_suffixes
from .held import forget_held, holds, record_held
from .int8 import all_finite
from .linear import QuantLinear
from .model import (
    DEFAULT_KEEP_FULL_PRECISION,
    EMBED,
    HEAD,
    SHARED_TABLE_FORMATS,
    is_target_weight,
    model_format,
    module_or_none,
)
from .published import PublishedWeights
from .wire import DTYPES, checksum_of, header_dict, manifest_entry

HELD_CHECKSUM = "_asyncrl_published_checksum"
"""Attribute of a worker's model: the checksum of the last publication loaded into it (full or delta)."""
HEAD_WEIGHT = HEAD + ".weight"
EMBED_WEIGHT = EMBED + ".weight"


def publish(
    state_dict: Mapping[str, Tensor],
    fmt: str,
    *,
    version: int,
    keep_full_precision: Sequence[str] = DEFAULT_KEEP_FULL_PRECISION,
    aqn_sigma: float = 0.0,
    aqn_seed: int | None = None,
    aqn_sites: Sequence[str] = aqn_mod.DEFAULT_AQN_SITES,
    uaq_s: float = 1.0,
    uaq_sites: Sequence[str] = (),
    aqn_resample: str = "publication",
    head: bool = False,
    embedding: bool = False,
    pool: BufferPool | None = None,
    on_entry: Callable[[TensorSpec, Tensor], None] | None = None,
) -> PublishedWeights:
    """Quantise-on-send: turn the learner's full-precision state dict into a publication.

    state_dict: HF names -> tensors (any device; the dict is not modified). fmt: one of FORMATS.
    AQN (§9): with aqn_sigma > 0, fresh noise (seed `aqn_seed`, required) is added to copies of the
    RMSNorm gains named by `aqn_sites`; gains folded by UAQ (`uaq_sites`, factor `uaq_s`) get
    sigma * uaq_s. The (seed, sigma) pair is recorded in the publication and its checksum.
    With ``aqn_resample="forward"`` the gains are published clean and (seed, sigma) tell the sampler
    to draw fresh noise at every forward (``aqn.ForwardAqn``; not combined with UAQ-folded sites).
    ``head=True`` (``quant.lm_head``) also quantises ``lm_head.weight``, for workers converted with
    ``quantize_model(..., head=True)``; a tied embedding is then published too, in full precision unless
    ``embedding=True`` (``quant.embedding``), which publishes the embedding as int8 row codes, for workers
    converted with ``quantize_model(..., embedding=True)``. Like ``quantize_model``, fp32 converts nothing,
    so an fp32 publication is the same with or without either.
    ``pool``: where the buffers come from (`BufferPool`; a publisher that publishes one format every
    version keeps one, so a version reuses the memory of versions nothing views any more instead of
    faulting in fresh pages); without one, fresh mappings. The bytes are the same either way.
    ``on_entry(entry, tensor)``: called with each published tensor and its manifest entry as soon as it is
    ready, in the order they are made (not the manifest's sorted order); the tensor is the publication's own
    (read it, never write it). A streamed publication sends it from there while the next one is quantised.
    Raises a QuantError naming the tensor on non-finite or unquantisable input.
    """
    check_format(fmt)
    head = head and fmt != "fp32"
    embedding = embedding and fmt != "fp32"
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise QuantError(f"version must be an integer >= 0, got {version!r}")
    tensors_in = state_dict  # read name by name: a lazy mapping (merged LoRA weights) yields one tensor at a time
    record = None
    require_choice("aqn_resample", aqn_resample, AQN_RESAMPLE, QuantError)
    if aqn_sigma != 0.0 and aqn_seed is None:
        raise QuantError("aqn_sigma > 0 needs aqn_seed (record it with the version to reproduce)")
    if aqn_sigma != 0.0 and aqn_seed is not None and aqn_resample == "forward":  # seed: checked above
        if uaq_sites:
            raise QuantError("aqn_resample='forward' does not scale sigma for UAQ-folded gains; "
                             "use aqn_resample='publication' with UAQ")
        if not (math.isfinite(aqn_sigma) and aqn_sigma > 0):
            raise QuantError(f"AQN sigma must be finite and >= 0, got {aqn_sigma}")
        record = aqn_mod.AqnRecord(seed=int(aqn_seed), sigma=float(aqn_sigma), sites=tuple(aqn_sites))
    elif aqn_sigma != 0.0 and aqn_seed is not None:
        tensors_in, record = aqn_mod.add_aqn_noise(
            tensors_in, sigma=aqn_sigma, seed=aqn_seed, sites=aqn_sites, uaq_s=uaq_s, uaq_sites=uaq_sites
        )
    out: dict[str, Tensor] = {}
    blocks = Blocks(pool)
    entries: list[TensorSpec] = []
    roles = weight_suffixes(fmt)
    # A tied weight (the same memory as an earlier name, published the same way) is published once. The
    # earlier tensor is held weakly: a freed one (a lazily merged weight, already quantized) cannot alias
    # one built later at its address. A quantised head is not published the way its tied embedding is, so
    # both go out; a state dict without lm_head.weight (the tied duplicate left out) has the embedding as head.
    seen: dict[tuple, weakref.ref] = {}
    names = sorted(tensors_in)
    tied_head = head and HEAD_WEIGHT not in tensors_in and EMBED_WEIGHT in tensors_in
    if tied_head:
        names = sorted([*names, HEAD_WEIGHT])
    if embedding and EMBED_WEIGHT not in tensors_in:
        raise QuantError(f"quant.embedding quantises {EMBED_WEIGHT!r}, which this state dict does not have; "
                         "set quant.embedding=false for this model")
    for name in names:
        t = tensors_in[EMBED_WEIGHT if tied_head and name == HEAD_WEIGHT else name]
        if not isinstance(t, Tensor):
            raise QuantError(f"state dict values must be tensors, got {type(t).__name__}", tensor_name=name)
        # how it is published: the format's rule (a target linear), int8 rows (the embedding) or as it is
        rule = (fmt if is_target_weight(name, keep_full_precision, head=head)
                else EMBED_FORMAT if embedding and name == EMBED_WEIGHT else None)
        # the int8 formats publish a tied head with the embedding's own codes: one table (model.py)
        key = ("int8" if rule in SHARED_TABLE_FORMATS else rule, *_alias_key(t))
        earlier = seen.get(key)
        if earlier is not None and earlier() is not None:
            continue
        seen[key] = weakref.ref(t)
        if rule is not None:
            prefix = name[: -len("weight")]
            rule_roles = roles if rule == fmt else EMBED_SUFFIXES
            for suffix, q in quantize_for_send(t, rule, name=name, blocks=blocks).items():
                qname = prefix + suffix
                logical = tuple(t.shape) if rule == fmt and roles[suffix] in (ROLE_CODES, ROLE_WEIGHT) else None
                out[qname] = blocks.snapshot(q, t)
                entries.append(manifest_entry(qname, out[qname], rule, rule_roles[suffix], logical))
                if on_entry is not None:
                    on_entry(entries[-1], out[qname])
        else:
            if t.is_floating_point() and not all_finite(t):
                raise NonFiniteWeightError(
                    "non-finite value(s); fix the learner update before publishing", tensor_name=name
                )
            out[name] = blocks.snapshot(t, t)
            entries.append(manifest_entry(name, out[name], fmt, ROLE_FULL))
            if on_entry is not None:
                on_entry(entries[-1], out[name])
    entries.sort(key=lambda e: e.name)
    seed = None if record is None else record.seed
    sigma = 0.0 if record is None else record.sigma
    mode = aqn_resample if record is not None else "publication"
    checksum = checksum_of(header_dict(version, fmt, seed, sigma, entries, mode))
    if pool is not None:
        pool.trim(blocks.mapped)
    return PublishedWeights(
        version, fmt, out, entries, checksum, aqn_seed=seed, aqn_sigma=sigma, aqn_resample=mode
    )


def _alias_key(t: Tensor) -> tuple:
    """Identity of the memory a tensor shows: equal keys mean the same values under two names."""
    if t.numel() == 0:
        return ("empty", id(t))
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def load_published(model: nn.Module, published: PublishedWeights) -> None:
    """Load a publication into a model converted with `quantize_model(model, published.fmt)`,
    without re-quantising. Everything is validated first (format, manifest, digests, checksum,
    finiteness, names/dtypes/shapes against the model); on any QuantError the model is unchanged.
    A name the model holds twice (tied embeddings) may be absent from the publication.

    What the model holds already is not loaded again (held.py): a tensor whose bytes hash to its new digest
    (and that the last load recorded with it) is neither checked nor copied, and a linear none of whose
    tensors was copied keeps its compute caches.
    """
    fmt = model_format(model)
    if published.fmt != fmt:
        raise FormatMismatchError(
            f"publication is {published.fmt!r} but the model was converted to {fmt!r}; publish in {fmt!r}"
        )
    state = model.state_dict()
    held = {e.name for e in published.manifest
            if (dest := state.get(e.name)) is not None and (dest.dtype, tuple(dest.shape)) == (
                DTYPES.get(e.dtype), tuple(e.shape)) and holds(model, e, dest)}
    published.verify(skip=held)
    aliases = _aliased_names(state)
    for name in published.tensors:
        if name not in state:
            raise ManifestMismatchError(
                "the model has no such tensor (wrong architecture?)" + _head_hint(name), tensor_name=name
            )
    for name, dest in state.items():
        src = published.tensors.get(name)
        if src is None:
            if name in aliases and any(a in published.tensors for a in aliases[name]):
                continue
            raise ManifestMismatchError(
                "the model expects this tensor but it was not published" + _head_hint(name), tensor_name=name
            )
        if src.dtype != dest.dtype or src.shape != dest.shape:
            raise ManifestMismatchError(
                f"model has {dest.dtype} {tuple(dest.shape)}, publication {src.dtype} {tuple(src.shape)}",
                tensor_name=name,
            )
    for e in published.manifest:
        if not e.logical_shape:
            continue
        mod = module_or_none(model, e.name.rpartition(".")[0])
        if isinstance(mod, QuantLinear) and e.logical_shape != (mod.out_features, mod.in_features):
            raise ManifestMismatchError(
                f"published weight is {e.logical_shape}, the module is {(mod.out_features, mod.in_features)}",
                tensor_name=e.name,
            )
    forget_held(model)  # until every tensor is in
    written: set[str] = set()  # the modules whose tensors were written
    with torch.no_grad():
        for e in published.manifest:
            if e.name not in held:
                state[e.name].copy_(published.tensors[e.name])
                written.update(n.rpartition(".")[0] for n in (e.name, *aliases.get(e.name, ())))
        # only the linears whose tensors were written rebuild their caches (the others' match their buffers, as
        # after every load)
        for name, mod in model.named_modules():
            if isinstance(mod, QuantLinear) and name in written:
                mod.refresh()
    vars(model)[HELD_CHECKSUM] = published.checksum  # what a delta to the next version must start from (delta.py)
    record_held(model, published.manifest)


def _head_hint(name: str) -> str:
    if name.startswith(EMBED + "."):
        return ("; the publication and the model disagree on holding the token embedding as int8 codes: set "
                "quant.embedding the same for the learner and every worker (workers of protocol 1.8 or newer)")
    if not name.startswith(HEAD + "."):
        return ""
    return ("; the publication and the model disagree on quantising the output head: set quant.lm_head the same "
            "for the learner and every worker")


def _aliased_names(state: Mapping[str, Tensor]) -> dict[str, list[str]]:
    """Names sharing storage with another name (tied weights) -> the other names."""
    by_ptr: dict[tuple[int, int | torch.SymInt, tuple[int, ...]], list[str]] = {}
    for name, t in state.items():
        by_ptr.setdefault((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)), []).append(
            name
        )
    return {n: [m for m in group if m != n] for group in by_ptr.values() if len(group) > 1 for n in group}

