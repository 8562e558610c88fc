"""Delta publication: a version sent as what changed since the version a worker holds.

Owns: `PublishedDelta` (a version's full manifest and checksum, plus for every manifest entry how it travels:
``same``, ``sparse`` changed elements, or ``dense``), `make_delta(prev, cur)` on the learner side and
`apply_delta(model, delta)` on a worker.

At the rollout's precision almost nothing changes from one version to the next (an RL step moves a weight
far less than one int8 or fp4 quantization step, so a few percent of the codes flip), and a tensor whose
bytes did not change at all travels as nothing. A changed tensor travels as the flat int32 indices of its
changed elements followed by their new values (elements compared by their bits: an integer view of the
same width, so -0.0, NaN patterns and E8M0 bytes compare exactly), or whole when that is smaller.

Exactness: `apply_delta` refuses a delta whose base is not what the model holds (``base_checksum`` against
the checksum of the last publication loaded, recorded on the model), checks the new manifest against the
version's checksum, checks the new values (finite, scales > 0, E8M0 not NaN) and every dense part's bytes
against its manifest digest before writing, writes the sparse parts and checks each of their tensors against
its manifest digest once written, and only then copies the dense parts in (a copy of checked bytes cannot
fail: they need no undo record, which for a moved fp32 tensor would be a copy of it); on any failure every
written element is restored and a QuantError names the tensor. So the model after any chain of deltas holds exactly the bytes
of the full publication of that version. The quantised linears' compute caches are then rebuilt only at the
elements the delta wrote (`QuantLinear.refresh` with ``changed``; whole where that is not cheaper), the same
bits as the rebuild after a full load.

Must never: apply a delta to a model that holds another base, or leave a model half-updated.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor, nn

from protocols import DeltaPart, TensorSpec

from .errors import ChecksumMismatchError, FormatMismatchError, ManifestMismatchError
from .held import forget_held, record_held
from .linear import QuantLinear
from .model import model_format
from .publish import HELD_CHECKSUM
from .published import PublishedWeights, check_values
from .wire import DTYPES, checksum_of, digest_matches, header_dict, raw_bytes

INDEX_DTYPE = torch.int32
INDEX_BYTES = 4
_T = TypeVar("_T")
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def element_bits(t: Tensor) -> Tensor:
    """A flat integer view of ``t``'s elements (same width), so equal bits compare equal."""
    return t.reshape(-1).view(_INT_VIEW[t.element_size()])


UNDO_WHOLE_FRAC = 16
"""A sparse part that writes more than 1/16 of its tensor's elements is recorded for the undo as a copy of the whole
tensor (a memcpy) rather than a gather of its old elements (on a 2-core Zen 3, a gather of a fifth of an int8
tensor's elements costs ~4x its copy)."""

COMPARE_WORDS = 1 << 19
"""8-byte words compared at a time by `changed_elements` (its mask is this many bytes)."""


def changed_elements(old: np.ndarray, new: np.ndarray, limit: int) -> np.ndarray | None:
    """The flat indices (int64, ascending) of the elements where ``new`` differs from ``old`` (1-D, the same
    integer dtype, so elements compare by their bits), or None when more than ``limit`` do.

    An RL step flips a few codes in a thousand, so the arrays are compared 8 bytes at a time (a chunk of
    words at a time into one mask) and only the words that differ are looked into, element by element: the
    bytes of the words' XOR that are not zero. A chunk where more than a quarter of the words differ (an fp32
    tensor the optimiser moved everywhere) is only counted, element by element, and its indices are found at
    the end if the count stays within ``limit``: a tensor that travels whole costs one comparison."""
    size = old.itemsize
    per = 8 // size if size < 8 else 1
    head = old.size - old.size % per
    words_old, words_new = old[:head].view(np.uint64), new[:head].view(np.uint64)
    mask = np.empty(min(COMPARE_WORDS, words_old.size), dtype=bool)
    parts: list[tuple[int, np.ndarray]] = []
    dense: list[tuple[int, int]] = []  # element ranges counted, their indices found at the end
    count = 0
    for a in range(0, words_old.size, COMPARE_WORDS):
        b = min(words_old.size, a + COMPARE_WORDS)
        m = mask[: b - a]
        np.not_equal(words_old[a:b], words_new[a:b], out=m)
        words = np.flatnonzero(m)
        if not words.size:
            continue
        if 4 * words.size > b - a:
            count += int(np.count_nonzero(old[a * per:b * per] != new[a * per:b * per]))
            dense.append((a * per, b * per))
        else:
            words += a
            xor = (words_old[words] ^ words_new[words]).view(old.dtype).reshape(-1, per)
            row, col = np.nonzero(xor)
            parts.append((a * per, words[row] * per + col))
            count += row.size
        if count > limit:
            return None
    tail = np.flatnonzero(old[head:] != new[head:]) + head
    if count + tail.size > limit:
        return None
    parts += [(lo, np.flatnonzero(old[lo:hi] != new[lo:hi]) + lo) for lo, hi in dense]
    parts.sort(key=lambda p: p[0])
    return np.concatenate([p for _, p in parts] + [tail]).astype(np.int64, copy=False)


@dataclass
class PublishedDelta:
    """Version ``version`` of format ``fmt`` as the changes from ``base_version``: ``manifest`` and
    ``checksum`` are the full version's, ``parts`` one per manifest entry (in order) and ``payloads`` the
    frames of the parts that are not ``same`` (uint8 CPU tensors), in order."""

    version: int
    fmt: str
    base_version: int
    base_checksum: str
    manifest: list[TensorSpec]
    checksum: str
    parts: list[DeltaPart]
    payloads: list[Tensor] = field(default_factory=list)
    aqn_seed: int | None = None
    aqn_sigma: float = 0.0
    aqn_resample: str = "publication"

    def total_bytes(self) -> int:
        """Bytes of the payloads (what the delta moves)."""
        return sum(p.nbytes for p in self.parts)

    def full_bytes(self) -> int:
        """Bytes of the full version."""
        return sum(e.nbytes for e in self.manifest)

    def changed_frac(self) -> float:
        """Changed elements over all elements of the version (a dense part counts every element)."""
        total = changed = 0
        for e, p in zip(self.manifest, self.parts, strict=True):
            n = e.nbytes // max(1, torch.empty((), dtype=DTYPES[e.dtype]).element_size())
            total += n
            changed += n if p.kind == "dense" else p.count
        return changed / total if total else 0.0


def make_delta(prev: PublishedWeights, cur: PublishedWeights) -> PublishedDelta:
    """``cur`` as the changes from ``prev`` (same format, the same tensors); ManifestMismatchError or
    FormatMismatchError when they cannot be compared (send ``cur`` whole then)."""
    stream = DeltaStream(prev, cur.version, cur.fmt)
    for e in cur.manifest:
        stream.add(e, cur.tensors[e.name])
    return stream.finish(cur)


class DeltaStream:
    """A delta made entry by entry while the new version is being published (``publish(on_entry=...)``): each
    ``add`` returns the entry's part and frame at once (a streamed publication sends them from there), and
    ``finish`` puts them together, in manifest order, as the ``PublishedDelta`` ``make_delta`` would make."""

    def __init__(self, prev: PublishedWeights, version: int, fmt: str) -> None:
        if prev.fmt != fmt:
            raise FormatMismatchError(f"no delta from a {prev.fmt!r} publication to a {fmt!r} one")
        if version <= prev.version:
            raise ManifestMismatchError(f"no delta from version {prev.version} to the older version {version}")
        self.prev, self.version = prev, version
        self._before = {e.name: e for e in prev.manifest}
        self._made: dict[str, tuple[DeltaPart, Tensor | None]] = {}

    def add(self, e: TensorSpec, new_t: Tensor) -> tuple[DeltaPart, Tensor | None]:
        """The part of entry ``e`` (whose published tensor is ``new_t``) and its frame (None for ``same``)."""
        old = self._before.get(e.name)
        if old is None or (old.dtype, tuple(old.shape)) != (e.dtype, tuple(e.shape)):
            raise ManifestMismatchError("differs in name, dtype or shape from the base version", tensor_name=e.name)
        made = _part(e, old, self.prev.tensors[e.name], new_t)
        self._made[e.name] = made
        return made

    def finish(self, cur: PublishedWeights) -> PublishedDelta:
        """The delta to ``cur`` (every one of its entries added)."""
        missing = [e.name for e in cur.manifest if e.name not in self._made]
        if missing or len(self._made) != len(cur.manifest):
            raise ManifestMismatchError(f"the delta lacks parts for {missing[:3]} (or has parts of no entry)")
        parts = [self._made[e.name][0] for e in cur.manifest]
        payloads = [f for e in cur.manifest if (f := self._made[e.name][1]) is not None]
        return PublishedDelta(version=cur.version, fmt=cur.fmt, base_version=self.prev.version,
                              base_checksum=self.prev.checksum, manifest=list(cur.manifest), checksum=cur.checksum,
                              parts=parts, payloads=payloads, aqn_seed=cur.aqn_seed, aqn_sigma=cur.aqn_sigma,
                              aqn_resample=cur.aqn_resample)


def _part(e: TensorSpec, old: TensorSpec, old_t: Tensor, new_t: Tensor) -> tuple[DeltaPart, Tensor | None]:
    if old.digest == e.digest:
        return DeltaPart(name=e.name, kind="same"), None
    a, b = element_bits(old_t), element_bits(new_t)
    size = new_t.element_size()
    # whole when that is smaller (an fp32 tensor an optimiser step moved everywhere), and never an index
    # list of most of a tensor; a digest that changed over identical bytes cannot happen: whole, to be safe
    limit = (e.nbytes - 1) // (INDEX_BYTES + size)
    if a.device.type == "cpu":
        found = changed_elements(a.numpy(), b.numpy(), limit)
        idx = None if found is None else torch.from_numpy(found)
    else:
        changed = torch.ne(a, b)
        idx = changed.nonzero().reshape(-1) if int(torch.count_nonzero(changed)) <= limit else None
    count = 0 if idx is None else idx.numel()
    if count == 0:
        return DeltaPart(name=e.name, kind="dense", count=a.numel(), nbytes=e.nbytes), new_t.reshape(-1).view(
            torch.uint8)
    assert idx is not None
    frame = torch.empty(count * (INDEX_BYTES + size), dtype=torch.uint8)
    frame[: count * INDEX_BYTES].view(INDEX_DTYPE).copy_(idx)
    frame[count * INDEX_BYTES:].view(b.dtype).copy_(b[idx])
    return DeltaPart(name=e.name, kind="sparse", count=count, nbytes=int(frame.numel())), frame


def delta_from_frames(header: Any, frames: Sequence[Any]) -> PublishedDelta:
    """Rebuild a delta from a ``protocols.WeightDelta`` and its payload frames (views, no copy)."""
    parts = list(header.parts)
    moving = [p for p in parts if p.kind != "same"]
    if len(frames) != len(moving):
        raise ManifestMismatchError(f"{len(frames)} frames for a delta with {len(moving)} parts that carry one")
    payloads = []
    for p, f in zip(moving, frames, strict=True):
        view = memoryview(f).cast("B")
        if view.nbytes != p.nbytes:
            raise ManifestMismatchError(f"frame of {view.nbytes} bytes, the delta says {p.nbytes}", tensor_name=p.name)
        payloads.append(torch.frombuffer(bytearray(view), dtype=torch.uint8) if view.readonly
                        else torch.frombuffer(view, dtype=torch.uint8))
    return PublishedDelta(version=header.version, fmt=header.fmt, base_version=header.base_version,
                          base_checksum=header.base_checksum, manifest=list(header.manifest),
                          checksum=header.checksum, parts=parts, payloads=payloads,
                          aqn_seed=None if header.aqn_seed < 0 else header.aqn_seed, aqn_sigma=header.aqn_sigma,
                          aqn_resample=header.aqn_resample)


def held_checksum(model: nn.Module) -> str:
    """The checksum of the last publication loaded into ``model`` ("" if none was)."""
    return str(getattr(model, HELD_CHECKSUM, ""))


def apply_delta(model: nn.Module, delta: PublishedDelta) -> None:
    """Write ``delta`` into ``model`` (a worker's converted model that holds its base) in place; see the
    module docstring for the checks. On a QuantError the model is unchanged."""
    fmt = model_format(model)
    if delta.fmt != fmt:
        raise FormatMismatchError(f"delta is {delta.fmt!r} but the model was converted to {fmt!r}")
    held = held_checksum(model)
    if not held or held != delta.base_checksum:
        raise ChecksumMismatchError(
            f"delta to version {delta.version} is from version {delta.base_version} "
            f"(checksum {delta.base_checksum[:16]}...), the model holds {held[:16] or 'no publication'}...; "
            "fetch the version whole")
    expected = checksum_of(header_dict(delta.version, delta.fmt, delta.aqn_seed, delta.aqn_sigma, delta.manifest,
                                       delta.aqn_resample))
    if expected != delta.checksum:
        raise ChecksumMismatchError(f"delta checksum {delta.checksum[:16]}... does not match its manifest; refetch")
    modules = dict(model.named_modules())
    plan = []
    frames = iter(delta.payloads)
    for e, p in zip(delta.manifest, delta.parts, strict=True):
        if p.name != e.name:
            raise ManifestMismatchError(f"delta part {p.name!r} out of manifest order", tensor_name=e.name)
        mod_name, _, leaf = e.name.rpartition(".")
        dest = state_tensor(modules.get(mod_name), leaf)
        if dest is None:
            raise ManifestMismatchError("the model has no such tensor (wrong architecture?)", tensor_name=e.name)
        if (dest.dtype, tuple(dest.shape)) != (DTYPES[e.dtype], tuple(e.shape)) or not dest.is_contiguous():
            raise ManifestMismatchError(f"model has {dest.dtype} {tuple(dest.shape)}, the delta {e.dtype} "
                                        f"{tuple(e.shape)}", tensor_name=e.name)
        if p.kind == "same":
            continue
        plan.append((e, dest, *part_update(e, p, dest, next(frames))))
    undo: list[tuple[Tensor, Tensor | None, Tensor]] = []
    with torch.no_grad():
        try:  # the sparse parts first: each is checked against its digest once written, and undone on a failure
            for e, dest, flat, idx, values in plan:
                if idx is not None:
                    write_update(e, dest, flat, idx, values, undo)
        except BaseException:
            restore(undo)
            raise
        try:  # then the dense parts, whose frames were checked against their digests before anything was written
            for _, _, flat, idx, values in plan:
                if idx is None:
                    flat.copy_(values)
        except BaseException:  # (an interrupt between copies) the model holds no known version: fetch one whole
            vars(model)[HELD_CHECKSUM] = ""
            forget_held(model)
            raise
        # only the linears whose tensors changed rebuild their caches, each once, at the elements written (from
        # the values written: no second gather)
        written = by_module((e.name, v) for e, _, _, _, v in plan)
        for name, changed in by_module((e.name, idx) for e, _, _, idx, _ in plan).items():
            mod = modules.get(name)
            if isinstance(mod, QuantLinear):
                mod.refresh(changed, written[name])
    vars(model)[HELD_CHECKSUM] = delta.checksum
    record_held(model, delta.manifest)


def by_module(written: Iterable[tuple[str, _T]]) -> dict[str, dict[str, _T]]:
    """(tensor name, x) pairs -> {module name: {tensor suffix: x}}: with x the flat indices written (or None),
    what each module's ``QuantLinear.refresh(changed)`` takes; with x the values written, its ``values``."""
    out: dict[str, dict[str, _T]] = {}
    for name, x in written:
        mod_name, _, suffix = name.rpartition(".")
        out.setdefault(mod_name, {})[suffix] = x
    return out


def state_tensor(mod: nn.Module | None, leaf: str) -> Tensor | None:
    """The tensor ``model.state_dict()`` holds under ``mod``'s name + ``"." + leaf`` (a parameter or a persistent
    buffer of ``mod``, detached), found without building the whole state dict; None where it holds none."""
    if mod is None:
        return None
    t: Tensor | None = mod._parameters.get(leaf)
    if t is None and leaf not in mod._non_persistent_buffers_set:
        t = mod._buffers.get(leaf)
    return None if t is None else t.detach()


def sparse_frame(frame: Tensor, count: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """A sparse part's uint8 frame as (its ``count`` int32 indices, its new values viewed as ``dtype``)."""
    return frame[: count * INDEX_BYTES].view(INDEX_DTYPE), frame[count * INDEX_BYTES:].view(dtype)


def part_update(e: TensorSpec, p: DeltaPart, dest: Tensor, frame: Tensor) -> tuple[Tensor, Tensor | None, Tensor]:
    """What part ``p`` of entry ``e`` writes into ``dest`` (the model's tensor): ``(flat, idx, values)``, a flat
    integer view of ``dest``, the changed indices (int64; None: every element) and their new values (the same
    integer view: the bits), checked (sizes, indices inside the tensor, values finite and scales > 0; a dense
    part's bytes against the entry's digest) before anything is written. ``frame``: the part's uint8 frame."""
    flat = element_bits(dest)
    idx: Tensor | None
    if p.kind == "dense":
        if frame.numel() != flat.numel() * flat.element_size():
            raise ManifestMismatchError("dense part of the wrong size", tensor_name=e.name)
        if not digest_matches(frame, e.digest):  # the tensor's bytes: checked here, before anything is written
            raise ChecksumMismatchError("the dense part's bytes do not match the version's digest (the delta was "
                                        "damaged); fetch the version whole", tensor_name=e.name)
        values = frame.view(flat.dtype)
        idx = None
    else:
        if frame.numel() != p.count * (INDEX_BYTES + flat.element_size()):
            raise ManifestMismatchError("sparse part of the wrong size", tensor_name=e.name)
        idx32, values = sparse_frame(frame, p.count, flat.dtype)
        idx = idx32.long()
        if p.count:
            lo, hi = torch.aminmax(idx)
            if int(lo) < 0 or int(hi) >= flat.numel():
                raise ManifestMismatchError("sparse part with indices outside the tensor", tensor_name=e.name)
    check_values(e, values.view(dest.dtype))
    if flat.device != values.device:  # a model on an accelerator: the frame arrived in host memory
        values = values.to(flat.device)
        idx = None if idx is None else idx.to(flat.device)
    return flat, idx, values


def write_update(e: TensorSpec, dest: Tensor, flat: Tensor, idx: Tensor | None, values: Tensor,
                 undo: list[tuple[Tensor, Tensor | None, Tensor]]) -> None:
    """Write one ``part_update`` into the model, recording in ``undo`` what ``restore`` puts back, then check
    the tensor against its digest (ChecksumMismatchError; the caller restores)."""
    if idx is None:
        undo.append((flat, None, flat.clone()))
        flat.copy_(values)
    elif idx.numel() * UNDO_WHOLE_FRAC > flat.numel():  # many elements: a copy of the tensor is the cheaper record
        undo.append((flat, None, flat.clone()))
        flat.scatter_(0, idx, values)
    else:  # gather / scatter_: flat[idx] without advanced indexing's overhead (of the index ops, the fastest on CPU)
        undo.append((flat, idx, torch.gather(flat, 0, idx)))
        flat.scatter_(0, idx, values)
    if not digest_matches(dest if dest.device.type == "cpu" else dest.cpu(), e.digest):
        raise ChecksumMismatchError(
            "after the delta the bytes do not match the version's digest (the model did not hold the "
            "base, or the delta was damaged); fetch the version whole", tensor_name=e.name)


def restore(undo: list[tuple[Tensor, Tensor | None, Tensor]]) -> None:
    """Put back every element ``write_update`` wrote, newest first."""
    for flat, idx, old in reversed(undo):
        if idx is None:
            flat.copy_(old)
        else:
            flat.scatter_(0, idx, old)
    undo.clear()


def delta_raw(delta: PublishedDelta) -> list[memoryview]:
    """The payload frames, zero-copy."""
    return [raw_bytes(p) for p in delta.payloads]
