"""Wire form of a publication: dtype names, raw bytes, digests, manifest entries, header checksum.

Owns: how a tensor becomes (name, raw bytes, dtype string, shape) and back, the `ManifestEntry`
record, and the canonical header whose sha256 is a publication's checksum.

Raw bytes are the tensor's memory in C order, little-endian (the byte order of every platform torch
supports here). The header is canonical JSON (sorted keys, no spaces, no NaN) of version, fmt,
aqn_seed, aqn_sigma and the manifest; every manifest entry holds the sha256 of its tensor's bytes.

Must never: pickle, or accept a dtype outside `DTYPES`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .errors import ManifestMismatchError, QuantError

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e8m0fnu,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    """'float32', 'float8_e4m3fn', ...; raises QuantError for a dtype that cannot be published."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise QuantError(f"dtype {name} cannot be published; supported: {sorted(DTYPES)}")
    return name


def raw_bytes(t: Tensor) -> memoryview:
    """Zero-copy little-endian bytes of a contiguous CPU tensor."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def digest(t: Tensor) -> str:
    """sha256 hex of a contiguous CPU tensor's raw bytes."""
    return hashlib.sha256(raw_bytes(t)).hexdigest()


@dataclass(frozen=True)
class ManifestEntry:
    """One published tensor. `role`: weight | codes | scale | global_scale | full_precision."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    fmt: str
    role: str
    nbytes: int
    sha256: str
    logical_shape: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        d["logical_shape"] = None if self.logical_shape is None else list(self.logical_shape)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ManifestEntry:
        ls = d.get("logical_shape")
        return cls(
            name=str(d["name"]),
            dtype=str(d["dtype"]),
            shape=tuple(int(s) for s in d["shape"]),
            fmt=str(d["fmt"]),
            role=str(d["role"]),
            nbytes=int(d["nbytes"]),
            sha256=str(d["sha256"]),
            logical_shape=None if ls is None else tuple(int(s) for s in ls),
        )


class RawTensor(NamedTuple):
    """What a transport ships per tensor: raw little-endian C-order bytes plus dtype and shape."""

    name: str
    data: memoryview | bytes | bytearray
    dtype: str
    shape: tuple[int, ...]


def tensor_from_bytes(name: str, data: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
    """Copy raw bytes into a new tensor of `dtype` and `shape`; the byte count must match."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for s in shape:
        numel *= s
    buf = bytearray(data)
    if len(buf) != numel * itemsize:
        raise ManifestMismatchError(
            f"{len(buf)} bytes cannot hold shape {shape} of {dtype}", tensor_name=name
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)


def header_dict(
    version: int, fmt: str, aqn_seed: int | None, aqn_sigma: float, manifest: Sequence[ManifestEntry]
) -> dict[str, Any]:
    """The canonical header (without the checksum itself)."""
    return {
        "version": int(version),
        "fmt": fmt,
        "aqn_seed": aqn_seed,
        "aqn_sigma": float(aqn_sigma),
        "manifest": [e.to_dict() for e in manifest],
    }


def checksum_of(header: Mapping[str, Any]) -> str:
    blob = json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(blob.encode()).hexdigest()
