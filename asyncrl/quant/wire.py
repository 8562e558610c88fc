"""Wire form of a publication: dtype names, raw bytes, digests, manifest entries, header checksum.

Owns: how a tensor becomes (name, raw bytes, dtype string, shape) and back, the per-tensor integrity
digests, and the canonical header whose sha256 is a publication's checksum. Manifest entries are
`protocols.TensorSpec` (the one manifest type; this module builds them, `manifest_entry`, and writes them
into the canonical header, `entry_dict`).

Raw bytes are the tensor's memory in C order, little-endian (the byte order of every platform torch
supports here). The header is canonical JSON (sorted keys, no spaces, no NaN) of version, fmt,
aqn_seed, aqn_sigma and the manifest; every manifest entry holds the digest of its tensor's bytes.

Digests are integrity checks against corruption in transit, not identities: XXH3-128 (the `xxhash`
package, tens of GB/s, written "xxh3_128:<32 hex>"), so hashing never costs more than the copy it
guards. "sha256:<64 hex>" digests (older publishers) are still verified. The header checksum stays
sha256: it is the version's fingerprint, over a few kB of JSON. Identities of whole states
(`state_dict_sha256` in checkpoints) are sha256 and live elsewhere.

Must never: pickle, or accept a dtype outside `DTYPES`.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import xxhash
from torch import Tensor

from protocols import TensorSpec

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
    return t.reshape(-1).view(torch.uint8).numpy().data


DIGEST_ALGO = "xxh3_128"


def digest(t: Tensor) -> str:
    """Integrity digest of a contiguous CPU tensor's raw bytes: ``"xxh3_128:<hex>"``."""
    return f"{DIGEST_ALGO}:{xxhash.xxh3_128_hexdigest(raw_bytes(t))}"


def digest_matches(t: Tensor, expected: str) -> bool:
    """Whether ``t``'s bytes have the digest ``expected`` ("xxh3_128:..." or "sha256:...").
    Raises ManifestMismatchError for any other algorithm (a manifest this version cannot check)."""
    algo, _, hexdigest = expected.partition(":")
    if algo == DIGEST_ALGO:
        return xxhash.xxh3_128_hexdigest(raw_bytes(t)) == hexdigest
    if algo == "sha256":
        return hashlib.sha256(raw_bytes(t)).hexdigest() == hexdigest
    raise ManifestMismatchError(
        f"digest {expected[:24]!r} names no known algorithm (xxh3_128, sha256); publish with this asyncrl version"
    )


def manifest_entry(name: str, t: Tensor, fmt: str, role: str, logical: tuple[int, ...] | None = None) -> TensorSpec:
    """The manifest entry of a contiguous CPU tensor about to be published (digest of its bytes included).
    `role`: full | weight | codes | scale | global_scale; `logical`: the [N, K] a codes/weight entry encodes."""
    return TensorSpec(name=name, dtype=dtype_name(t.dtype), shape=tuple(t.shape), nbytes=t.numel() * t.element_size(),
                      role=role, fmt=fmt, digest=digest(t), logical_shape=tuple(logical or ()))


def entry_dict(e: TensorSpec) -> dict[str, Any]:
    """An entry as the canonical header writes it (the checksum covers exactly these keys; ``sha256``
    appears only as a ``digest`` of that algorithm)."""
    return {"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "fmt": e.fmt, "role": e.role,
            "nbytes": int(e.nbytes), "digest": e.digest, "logical_shape": list(e.logical_shape) or None}


def entry_from_dict(d: Mapping[str, Any]) -> TensorSpec:
    """Inverse of `entry_dict` (an entry with a ``sha256`` key instead of ``digest`` is a 1.0 one)."""
    return TensorSpec(name=str(d["name"]), dtype=str(d["dtype"]), shape=tuple(int(s) for s in d["shape"]),
                      nbytes=int(d["nbytes"]), role=str(d["role"]), fmt=str(d["fmt"]),
                      digest=str(d["digest"]) if "digest" in d else f"sha256:{d['sha256']}",
                      logical_shape=tuple(int(s) for s in d.get("logical_shape") or ()))


class RawTensor(NamedTuple):
    """What a transport ships per tensor: raw little-endian C-order bytes plus dtype and shape."""

    name: str
    data: memoryview | bytes | bytearray
    dtype: str
    shape: tuple[int, ...]


def tensor_from_bytes(name: str, data: Any, dtype: torch.dtype, shape: tuple[int, ...], *,
                      copy: bool = True) -> Tensor:
    """A tensor of `dtype` and `shape` over raw bytes; the byte count must match.

    ``copy=True``: a new tensor owning a copy. ``copy=False``: a view of ``data`` itself (kept alive by
    the tensor; a read-only buffer, such as a received zmq frame, is fine as long as nobody writes to
    the tensor), copied only when the buffer is not aligned to the item size. For a publication that
    is loaded into a model and dropped, this saves one full copy of the received bytes."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for s in shape:
        numel *= s
    buf: bytearray | memoryview
    if copy:
        buf = bytearray(data)
        nbytes, readonly = len(buf), False
    else:
        view = memoryview(data).cast("B") if memoryview(data).format != "B" else memoryview(data)
        buf, nbytes, readonly = view, view.nbytes, view.readonly
    if nbytes != numel * itemsize:
        raise ManifestMismatchError(
            f"{nbytes} bytes cannot hold shape {shape} of {dtype}", tensor_name=name
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if not readonly:
        u8 = torch.frombuffer(buf, dtype=torch.uint8)
    else:
        with warnings.catch_warnings():  # torch warns that it cannot make the tensor read-only
            warnings.simplefilter("ignore", UserWarning)
            u8 = torch.frombuffer(buf, dtype=torch.uint8)
    if u8.data_ptr() % itemsize:
        u8 = u8.clone()
    return u8.view(dtype).reshape(shape)


def header_dict(
    version: int,
    fmt: str,
    aqn_seed: int | None,
    aqn_sigma: float,
    manifest: Sequence[TensorSpec],
    aqn_resample: str = "publication",
) -> dict[str, Any]:
    """The canonical header (without the checksum itself). ``aqn_resample`` appears only when it is
    ``forward`` (clean gains; the sampler draws the noise per forward), so older headers are unchanged."""
    out = {
        "version": int(version),
        "fmt": fmt,
        "aqn_seed": aqn_seed,
        "aqn_sigma": float(aqn_sigma),
        "manifest": [entry_dict(e) for e in manifest],
    }
    if aqn_resample != "publication":
        out["aqn_resample"] = aqn_resample
    return out


def checksum_of(header: Mapping[str, Any]) -> str:
    blob = json.dumps(header, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(blob.encode()).hexdigest()
