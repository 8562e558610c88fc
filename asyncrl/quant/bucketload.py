"""Loading a version bucket by bucket as it arrives, into a worker's converted model, all or nothing.

Owns: `load_buckets(model, buckets)`: the worker's side of a bucketed publication (`protocols.WeightBucket`;
the stream and its buckets are described in `asyncrl.transport.buckets`). Each bucket's entries are checked
against the model as they are listed (name, dtype, shape, logical shape; a delta's base checksum with its first
bucket), its bytes are written into the model's own tensors at once (a whole version's tensors and a delta's
dense parts piece by piece; a sparse part once its frame is complete), and the bucket is released before the
next one is read, so the receive buffers a load holds are one bucket's.

Checks, as `load_published` and `apply_delta` make them: each tensor, once complete, against its manifest
digest (hashed from the bytes as they arrive; a sparse part's tensor after it is applied) and its values
(finite, scales > 0); at the end, every tensor of the model published (a whole version) and the manifest
collected from all buckets against the version's checksum (from the last bucket). Only then are the quantised
linears' caches rebuilt (after a delta only those of the linears it wrote, and only at the elements its sparse
parts wrote: `QuantLinear.refresh` with ``changed``) and the model marked as holding the version.

All or nothing: every element written is first recorded (its old bytes: only the ones that change, or the
whole range when more than 1/9 of them do), and any failure, of a check or of the stream itself (a torn
transfer: the iterator raises), puts every one back before the error propagates; the model then holds its
previous version, bit for bit. The record is the price of loading in place: its size is what changes (for a
quantised version after the one before, the codes that flipped and the full-precision tensors the optimiser
moved, such as a trained embedding; for a first load, up to the model), reported as ``undo_bytes``.

Must never: let a forward see a half-loaded model (the caller holds the engine's step boundary), keep a
reference to a released bucket's bytes, or leave the model changed after an error.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import xxhash
from torch import Tensor, nn

from protocols import DeltaPart, TensorSpec, WeightBucket

from .delta import INDEX_BYTES, by_module, changed_elements, held_checksum, part_update, restore, write_update
from .errors import ChecksumMismatchError, FormatMismatchError, ManifestMismatchError
from .held import held_digests, record_held
from .linear import QuantLinear
from .model import model_format, module_or_none
from .publish import HELD_CHECKSUM, _aliased_names, _head_hint
from .published import check_values
from .wire import DTYPES, checksum_of, header_dict

SPARSE_UNDO_BYTES = 9
"""Bytes the record of one changed byte takes (an int64 index and the old byte): a range where more than
1/9 of the bytes change is recorded whole instead."""


class Bucket(Protocol):
    """What `load_buckets` takes (``asyncrl.transport.buckets.ReceivedBucket``): a checked bucket's header and
    pieces (entry name, offset in that entry's bytes, bytes), and ``release()`` to drop the pieces."""

    header: WeightBucket
    pieces: list[tuple[str, int, memoryview]]

    def release(self) -> None: ...


@dataclass
class LoadedVersion:
    """What a bucketed load put into the model (the engine reads the AQN fields as from a publication)."""

    version: int
    fmt: str
    checksum: str
    aqn_seed: int | None
    aqn_sigma: float
    aqn_resample: str
    is_delta: bool
    buckets: int
    stream_bytes: int
    undo_bytes: int
    """Bytes of the record of old values kept to undo the load (at its end)."""
    staged_peak: int
    """Most bytes of sparse delta parts held while their frames were completed (a part split across buckets)."""


class _Entry:
    __slots__ = ("spec", "part", "dest", "length", "received", "hasher", "staging", "changed")

    def __init__(self, spec: TensorSpec, part: DeltaPart | None, dest: Tensor, length: int) -> None:
        self.spec, self.part, self.dest, self.length = spec, part, dest, length
        self.received = 0
        self.changed = False  # whether any of the model's bytes of it were written
        algo = spec.digest.partition(":")[0]
        self.hasher: Any = hashlib.sha256() if algo == "sha256" else xxhash.xxh3_128()
        self.staging: Tensor | None = None

    def digest(self) -> str:
        algo = self.spec.digest.partition(":")[0]
        return f"{algo}:{self.hasher.hexdigest()}"


def load_buckets(model: nn.Module, buckets: Iterable[Bucket], *, version: int | None = None) -> LoadedVersion:
    """Load a version (or a delta from the version ``model`` holds) from its buckets, in order; see the module
    docstring. ``version``: the version expected (checked before anything is written). On any error (a
    ``QuantError`` of a check, or whatever the iterator raises) the model is unchanged and the error propagates."""
    load = BucketLoad(model, version)
    try:
        for bucket in buckets:
            load.add(bucket)
        return load.finish()
    except BaseException:
        load.rollback()
        raise


class BucketLoad:
    """One bucketed load in progress (`load_buckets` drives it): ``add`` each bucket, then ``finish``, or
    ``rollback``."""

    def __init__(self, model: nn.Module, version: int | None = None) -> None:
        self.model, self.version = model, version
        self.fmt = model_format(model)
        self.state = model.state_dict()
        self.entries: dict[str, _Entry] = {}
        self.manifest: list[TensorSpec] = []
        self.undo: list[tuple[Tensor, Tensor | None, Tensor]] = []
        self.undo_bytes = 0
        self.staged = self.staged_peak = 0
        self.first: WeightBucket | None = None
        self.last: WeightBucket | None = None
        self.touched: set[str] = set()
        self.written: dict[str, Tensor | None] = {}
        """The flat indices of the elements written into each tensor (a sparse part's; None: any element)."""
        self.pieces: dict[str, list[Tensor]] = {}
        """Of a tensor of 1-byte elements loaded whole whose changed bytes were found, their flat indices, piece
        by piece (the bytes are elements: its linear's caches are rebuilt at those only)."""
        self.held = held_digests(model)
        """The digests the model held at the start (a tensor that did not change need not be checked again)."""
        self.values: dict[str, Tensor] = {}
        """The values a sparse part wrote at those indices (its linear's caches are rebuilt from them)."""
        self.buckets = self.stream_bytes = 0

    def add(self, bucket: Bucket) -> None:
        h = bucket.header
        if self.first is None:
            self._begin(h)
        elif self.last is not None or _fields(h) != _fields(self.first) or h.index != self.buckets:
            raise ManifestMismatchError(f"bucket {h.index} does not follow the buckets before it (another version, "
                                        "form or order); refetch the version")
        parts: list[DeltaPart | None] = list(h.parts) or [None] * len(h.entries)
        for e, p in zip(h.entries, parts, strict=True):
            self._entry(e, p)
        with torch.no_grad():
            for name, offset, data in bucket.pieces:
                self._piece(name, offset, data)
        bucket.release()
        self.buckets += 1
        self.stream_bytes += h.nbytes
        if h.last:
            self.last = h

    def _begin(self, h: WeightBucket) -> None:
        if self.version is not None and h.version != self.version:
            raise ManifestMismatchError(f"the buckets are of version {h.version}, version {self.version} was expected")
        if h.fmt != self.fmt:
            raise FormatMismatchError(f"publication is {h.fmt!r} but the model was converted to {self.fmt!r}; "
                                      f"publish in {self.fmt!r}")
        if h.is_delta:
            held = held_checksum(self.model)
            if not held or held != h.base_checksum:
                raise ChecksumMismatchError(
                    f"delta to version {h.version} is from version {h.base_version} (checksum "
                    f"{h.base_checksum[:16]}...), the model holds {held[:16] or 'no publication'}...; fetch the "
                    "version whole")
        self.first = h

    def _entry(self, e: TensorSpec, p: DeltaPart | None) -> None:
        if e.name in self.entries:
            raise ManifestMismatchError("listed twice in the manifest", tensor_name=e.name)
        dest = self.state.get(e.name)
        if dest is None:
            raise ManifestMismatchError("the model has no such tensor (wrong architecture?)" + _head_hint(e.name),
                                        tensor_name=e.name)
        dtype = DTYPES.get(e.dtype)
        if (dtype, tuple(e.shape)) != (dest.dtype, tuple(dest.shape)) or not dest.is_contiguous() or \
                e.nbytes != dest.numel() * dest.element_size():
            raise ManifestMismatchError(f"model has {dest.dtype} {tuple(dest.shape)}, the publication {e.dtype} "
                                        f"{tuple(e.shape)} of {e.nbytes} bytes", tensor_name=e.name)
        if e.logical_shape:
            mod = module_or_none(self.model, e.name.rpartition(".")[0])
            if isinstance(mod, QuantLinear) and e.logical_shape != (mod.out_features, mod.in_features):
                raise ManifestMismatchError(f"published weight is {e.logical_shape}, the module is "
                                            f"{(mod.out_features, mod.in_features)}", tensor_name=e.name)
        if p is not None and ((p.kind == "dense" and p.nbytes != e.nbytes) or (
                p.kind == "sparse" and p.nbytes != p.count * (INDEX_BYTES + dest.element_size()))):
            raise ManifestMismatchError(f"{p.kind} part of {p.nbytes} bytes does not fit the tensor", tensor_name=e.name)
        ent = _Entry(e, p, dest, e.nbytes if p is None else p.nbytes)
        self.entries[e.name] = ent
        self.manifest.append(e)
        if ent.length == 0 and (p is None or p.kind != "same"):
            self._complete(ent, None)  # an empty tensor

    def _piece(self, name: str, offset: int, data: memoryview) -> None:
        ent = self.entries.get(name)
        if ent is None or offset != ent.received or offset + data.nbytes > ent.length or not data.nbytes:
            raise ManifestMismatchError(f"a piece of bytes [{offset}, +{data.nbytes}) that does not continue the "
                                        "entry (or of no entry listed)", tensor_name=name)
        src = _frombuffer(data)
        frame = None
        if ent.part is None or ent.part.kind == "dense":
            found = self._write_range(_bytes(ent.dest)[offset:offset + data.nbytes], src)
            ent.hasher.update(data)
            if found is None or found.numel():
                ent.changed = True
                self.touched.add(name.rpartition(".")[0])
                if found is not None and ent.dest.element_size() == 1 and name not in self.written:
                    self.pieces.setdefault(name, []).append(found + offset)  # bytes are elements: rebuilt there
                else:  # the rest rebuilds its linear's caches whole
                    self.written[name] = None
                    self.pieces.pop(name, None)
        elif offset == 0 and data.nbytes == ent.length:
            frame = src
        else:  # a sparse frame split across buckets: held until its last piece is here
            if ent.staging is None:
                ent.staging = torch.empty(ent.length, dtype=torch.uint8)
                self.staged += ent.length
                self.staged_peak = max(self.staged_peak, self.staged)
            ent.staging[offset:offset + data.nbytes].copy_(src)
            if offset + data.nbytes == ent.length:
                frame = ent.staging
        ent.received += data.nbytes
        if ent.received == ent.length:
            self._complete(ent, frame)

    def _write_range(self, dst: Tensor, src: Tensor) -> Tensor | None:
        """Copy ``src`` into ``dst`` (a byte range of a model tensor), recording the bytes that change; their
        offsets in the range (int64; empty: none changed), or None where the whole range was written."""
        if dst.device.type == "cpu":
            found = changed_elements(dst.numpy(), src.numpy(), dst.numel() // SPARSE_UNDO_BYTES)
            idx = None if found is None else torch.from_numpy(found)
        else:
            src = src.to(dst.device)
            changed = dst != src
            n_changed = int(torch.count_nonzero(changed))
            idx = None if n_changed * SPARSE_UNDO_BYTES >= dst.numel() else changed.nonzero().reshape(-1)
        if idx is not None and idx.numel() == 0:
            return idx  # nothing changed here
        if idx is not None:
            self.undo.append((dst, idx, dst[idx]))
            self.undo_bytes += idx.numel() * SPARSE_UNDO_BYTES
        else:
            self.undo.append((dst, None, dst.clone()))
            self.undo_bytes += dst.numel()
        dst.copy_(src)
        return idx

    def _complete(self, ent: _Entry, frame: Tensor | None) -> None:
        e, p = ent.spec, ent.part
        if p is None or p.kind == "dense":
            if ent.digest() != e.digest:
                raise ChecksumMismatchError("bytes do not match the manifest digest (corrupted in transit?); refetch "
                                            "the version", tensor_name=e.name)
            if ent.changed or self.held.get(e.name) != e.digest:  # else: the bytes checked when they were loaded
                check_values(e, ent.dest)
            return
        assert frame is not None
        before = len(self.undo)
        flat, idx, values = part_update(e, p, ent.dest, frame)
        if frame is not ent.staging and idx is not None:  # a view of the bucket's bytes, kept past its release
            values = values.clone()
        write_update(e, ent.dest, flat, idx, values, undo=self.undo)
        self.written[e.name] = idx
        if idx is not None:
            self.values[e.name] = values
        self.undo_bytes += sum(old.numel() * old.element_size() + (0 if idx is None else idx.numel() * 8)
                               for _, idx, old in self.undo[before:])
        self.touched.add(e.name.rpartition(".")[0])
        if ent.staging is not None:
            self.staged -= ent.length
            ent.staging = None

    def finish(self) -> LoadedVersion:
        first, last = self.first, self.last
        if first is None or last is None:
            raise ChecksumMismatchError("the version's buckets ended before its last one (a torn transfer); refetch "
                                        "the version")
        short = [n for n, ent in self.entries.items() if ent.received != ent.length]
        if short:
            raise ManifestMismatchError(f"the buckets ended before all bytes of {short[:3]} arrived; refetch the "
                                        "version", tensor_name=short[0])
        if not first.is_delta:
            aliases = _aliased_names(self.state)
            for name in self.state:
                if name not in self.entries and not any(a in self.entries for a in aliases.get(name, ())):
                    raise ManifestMismatchError("the model expects this tensor but it was not published"
                                                + _head_hint(name), tensor_name=name)
        seed = None if first.aqn_seed < 0 else first.aqn_seed
        manifest = sorted(self.manifest, key=lambda e: e.name)
        expected = checksum_of(header_dict(first.version, first.fmt, seed, first.aqn_sigma, manifest,
                                           first.aqn_resample))
        if expected != last.checksum:
            raise ChecksumMismatchError(f"publication checksum {last.checksum[:16]}... does not match the manifest "
                                        f"its buckets carried ({expected[:16]}...); refetch the version")
        written = dict(self.written)
        written.update((name, torch.cat(found)) for name, found in self.pieces.items())
        if not first.is_delta:  # the same memory under another name (a tied head): its linear rebuilt whole
            for name, others in _aliased_names(self.state).items():
                if name in written:
                    for other in others:
                        written[other] = None
                        self.touched.add(other.rpartition(".")[0])
        changed, values = by_module(written.items()), by_module(self.values.items())
        with torch.no_grad():
            # only the linears written rebuild their caches (the others' match their buffers, as after every
            # load), at the elements written where those are known
            for mod_name, mod in self.model.named_modules():
                if isinstance(mod, QuantLinear) and mod_name in self.touched:
                    mod.refresh(changed.get(mod_name, {}), values.get(mod_name))
        vars(self.model)[HELD_CHECKSUM] = last.checksum
        record_held(self.model, self.manifest)
        return LoadedVersion(version=first.version, fmt=first.fmt, checksum=last.checksum, aqn_seed=seed,
                             aqn_sigma=first.aqn_sigma, aqn_resample=first.aqn_resample, is_delta=first.is_delta,
                             buckets=self.buckets, stream_bytes=self.stream_bytes, undo_bytes=self.undo_bytes,
                             staged_peak=self.staged_peak)

    def rollback(self) -> None:
        """Put back every element written (the model holds its previous version again)."""
        with torch.no_grad():
            restore(self.undo)
        self.undo_bytes = 0


def _fields(h: WeightBucket) -> tuple:
    return (h.version, h.fmt, h.bucket_bytes, h.base_version, h.base_checksum, h.aqn_seed, h.aqn_sigma,
            h.aqn_resample)


def _bytes(t: Tensor) -> Tensor:
    return t.reshape(-1).view(torch.uint8)


def _frombuffer(data: memoryview) -> Tensor:
    """A uint8 tensor over ``data`` without a copy (a received frame is read-only: it is only read)."""
    with warnings.catch_warnings():  # torch warns that it cannot make the tensor read-only
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)
