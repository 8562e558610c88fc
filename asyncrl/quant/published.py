"""A published policy version as data: `PublishedWeights` and its verification.

Owns: the container a publication lives in (codes + scales + untouched full-precision tensors, a manifest and
a checksum: layout and checksum rules in publish.py's docstring), its conversion to and from raw buffers for
a transport, `verify()` (format, manifest vs tensors, digests, checksum, finiteness, scales) and the value
checks a loader runs on any published tensor (`check_values`).

Must never: pickle anything, or modify a tensor it checks.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from protocols import TensorSpec

from .errors import ChecksumMismatchError, ManifestMismatchError, NonFiniteWeightError
from .formats import ROLE_GLOBAL_SCALE, ROLE_SCALE, check_format
from .fp4 import E8M0_DTYPE, E8M0_NAN
from .int8 import AMINMAX_DTYPES, all_finite
from .wire import (
    DTYPES,
    RawTensor,
    checksum_of,
    digest_matches,
    dtype_name,
    entry_from_dict,
    header_dict,
    raw_bytes,
    tensor_from_bytes,
)


@dataclass
class PublishedWeights:
    """A published policy version. `tensors` are contiguous CPU tensors keyed by manifest name."""

    version: int
    fmt: str
    tensors: dict[str, Tensor]
    manifest: list[TensorSpec]
    checksum: str
    aqn_seed: int | None = None
    aqn_sigma: float = 0.0
    aqn_resample: str = "publication"
    """``forward``: the gains are clean and the sampler perturbs them at every forward with
    (aqn_seed, aqn_sigma) (``aqn.ForwardAqn``); ``publication``: the noise is already in the gains."""

    def total_bytes(self) -> int:
        """Bytes of all tensors (what a transport moves, headers aside)."""
        return sum(e.nbytes for e in self.manifest)

    def header(self) -> dict[str, Any]:
        """JSON/msgpack-able description: everything except the tensor bytes."""
        return header_dict(
            self.version, self.fmt, self.aqn_seed, self.aqn_sigma, self.manifest, self.aqn_resample
        ) | {"checksum": self.checksum}

    def to_raw(self) -> list[RawTensor]:
        """Raw buffers in manifest order (zero-copy views that keep the tensors alive)."""
        return [RawTensor(e.name, raw_bytes(self.tensors[e.name]), e.dtype, e.shape) for e in self.manifest]

    @classmethod
    def from_raw(cls, header: Mapping[str, Any], raw: Sequence[RawTensor | tuple], *,
                 copy: bool = True) -> PublishedWeights:
        """Rebuild from `header()` and `to_raw()` output (copies each buffer once; ``copy=False``:
        tensors are views of the buffers, `wire.tensor_from_bytes`). Only the layout is checked
        here; `verify()` / `load_published` check manifest, digests and checksum."""
        tensors = _tensors_of(raw, copy=copy)
        try:
            return cls(
                version=int(header["version"]),
                fmt=str(header["fmt"]),
                tensors=tensors,
                manifest=[entry_from_dict(d) for d in header["manifest"]],
                checksum=str(header["checksum"]),
                aqn_seed=None if header.get("aqn_seed") is None else int(header["aqn_seed"]),
                aqn_sigma=float(header.get("aqn_sigma", 0.0)),
                aqn_resample=str(header.get("aqn_resample", "publication")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestMismatchError(
                f"malformed publication header ({exc!r}); send PublishedWeights.header() unchanged"
            ) from exc

    @classmethod
    def from_manifest(cls, manifest: Sequence[TensorSpec], buffers: Sequence[Any], *, version: int, fmt: str,
                      checksum: str, aqn_seed: int | None = None, aqn_sigma: float = 0.0,
                      aqn_resample: str = "publication", copy: bool = True) -> PublishedWeights:
        """Rebuild from a manifest and one raw buffer per entry, in manifest order (what a transport
        received); the entries' dtype and shape lay the bytes out. Checked as `from_raw`."""
        if len(buffers) != len(manifest):
            raise ManifestMismatchError(f"{len(buffers)} buffers for a manifest of {len(manifest)} entries")
        raw = [RawTensor(e.name, buf, e.dtype, tuple(e.shape)) for e, buf in zip(manifest, buffers, strict=True)]
        return cls(version=int(version), fmt=fmt, tensors=_tensors_of(raw, copy=copy), manifest=list(manifest),
                   checksum=checksum, aqn_seed=aqn_seed, aqn_sigma=float(aqn_sigma), aqn_resample=aqn_resample)

    def verify(self, skip: Collection[str] = ()) -> None:
        """Check format, manifest vs tensors, per-tensor digests, checksum, finiteness and scales.
        Raises a QuantError subclass naming the tensor at fault. ``skip``: entries whose bytes are not read
        (a loader that holds them already, bit for bit): their digests and values are not checked."""
        check_format(self.fmt)
        names = [e.name for e in self.manifest]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ManifestMismatchError("listed twice in the manifest", tensor_name=dup)
        listed = set(names)
        for name in self.tensors:
            if name not in listed:
                raise ManifestMismatchError("present in tensors but not in the manifest", tensor_name=name)
        for e in self.manifest:
            t = self.tensors.get(e.name)
            if t is None:
                raise ManifestMismatchError("listed in the manifest but missing", tensor_name=e.name)
            got = (dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size())
            if got != (e.dtype, e.shape, e.nbytes):
                raise ManifestMismatchError(
                    f"manifest says dtype/shape/nbytes {(e.dtype, e.shape, e.nbytes)}, tensor has {got}",
                    tensor_name=e.name,
                )
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ManifestMismatchError("must be a contiguous CPU tensor", tensor_name=e.name)
            if e.name not in skip and not digest_matches(t, e.digest):
                raise ChecksumMismatchError(
                    "bytes do not match the manifest digest (corrupted in transit?); refetch the version",
                    tensor_name=e.name,
                )
        expected = checksum_of(
            header_dict(self.version, self.fmt, self.aqn_seed, self.aqn_sigma, self.manifest, self.aqn_resample)
        )
        if expected != self.checksum:
            raise ChecksumMismatchError(
                f"publication checksum {self.checksum[:16]}... does not match its manifest "
                f"({expected[:16]}...); refetch the version"
            )
        for e in self.manifest:
            if e.name not in skip:
                check_values(e, self.tensors[e.name])


def _tensors_of(raw: Sequence[RawTensor | tuple], *, copy: bool) -> dict[str, Tensor]:
    tensors: dict[str, Tensor] = {}
    for item in raw:
        name, data, dtype, shape = item
        if dtype not in DTYPES:
            raise ManifestMismatchError(f"unknown dtype {dtype!r}", tensor_name=name)
        if name in tensors:
            raise ManifestMismatchError("sent twice", tensor_name=name)
        tensors[name] = tensor_from_bytes(name, data, DTYPES[dtype], tuple(shape), copy=copy)
    return tensors


def check_values(e: TensorSpec, t: Tensor) -> None:
    if t.dtype == E8M0_DTYPE:
        if bool((t.view(torch.uint8) == E8M0_NAN).any()):
            raise NonFiniteWeightError(f"E8M0 scale byte {E8M0_NAN} (NaN)", tensor_name=e.name)
        return
    # int8/fp8 row scales and the nvfp4 global scale are > 0 by construction; nvfp4 block scales may be 0 (a
    # flushed block)
    positive = e.role in (ROLE_SCALE, ROLE_GLOBAL_SCALE) and e.fmt in ("int8", "int8_wo", "fp8", "nvfp4") and (
        e.role == ROLE_GLOBAL_SCALE or e.fmt != "nvfp4")
    if t.dtype in AMINMAX_DTYPES and t.numel():  # one reduction answers both (NaN and inf reach min and max)
        lo, hi = (float(x) for x in torch.aminmax(t.detach()))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise NonFiniteWeightError("non-finite value(s) in a published tensor", tensor_name=e.name)
        if positive and not lo > 0:
            raise NonFiniteWeightError("scale must be > 0", tensor_name=e.name)
        return
    if t.is_floating_point() and not all_finite(t):
        raise NonFiniteWeightError("non-finite value(s) in a published tensor", tensor_name=e.name)
    if positive and not bool((t.float() > 0).all()):
        raise NonFiniteWeightError("scale must be > 0", tensor_name=e.name)
