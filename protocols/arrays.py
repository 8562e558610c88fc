"""The n-d array on the wire: ``Array`` (raw little-endian bytes, dtype name, shape) and its size check.

Owns: ``DTYPE_SIZES`` (the dtype names an ``Array`` may carry, with their item sizes), ``Array``,
``check_array`` (dtype known, rank bounded, byte length = numel x itemsize), ``check_vectors`` (1-d of
a given dtype) and ``check_token_arrays`` (the four token arrays of a sample message agree).
Never: imports numpy, torch or zmq at import time (``to_numpy``/``from_numpy`` use numpy lazily); holds
a message (``protocols.messages`` does, and checks its arrays in each message's ``__post_init__``).
Invariant: an ``Array`` inside a decoded message has passed ``check_array``.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

# dtype name -> item size in bytes. The names are numpy's (``np.dtype(name)`` round-trips them).
DTYPE_SIZES: dict[str, int] = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e8m0fnu": 1,
}

MAX_ARRAY_RANK = 8


class Array(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """An n-d array as raw little-endian bytes. ``len(data) == prod(shape) * itemsize(dtype)``.

    The size rule is checked by every message that carries arrays (``check_array`` in its
    ``__post_init__``), at construction and at decode; one check per message is cheaper than a
    ``__post_init__`` per nested array on the hot path of sample streaming. ``gc=False``: an Array
    holds only a str, a tuple of ints and bytes, so it can never be part of a reference cycle, and the
    garbage collector need not track the thousands a batch decodes (not a wire change).
    """

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def from_numpy(cls, a) -> Array:  # noqa: ANN001 - duck-typed so this module never imports numpy
        """Wrap a numpy array (made C-contiguous, little-endian by the caller's dtype)."""
        if not a.flags["C_CONTIGUOUS"]:
            a = a.copy(order="C")
        return cls(dtype=str(a.dtype), shape=tuple(int(d) for d in a.shape), data=a.tobytes())

    def to_numpy(self):  # noqa: ANN201 - numpy is imported lazily
        """A read-only numpy view over ``data`` (no copy)."""
        import numpy as np

        if self.dtype == "bfloat16":
            raise ValueError("bfloat16 has no numpy dtype; decode it with torch (asyncrl.transport.tensors)")
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)


def check_array(name: str, a: Array) -> int:
    """Validate ``a`` (dtype known, dims >= 0, byte length = numel x itemsize); returns numel."""
    shape = a.shape
    size = DTYPE_SIZES.get(a.dtype)
    if size is None:
        raise ValueError(f"{name}: unknown array dtype {a.dtype!r}; expected one of {sorted(DTYPE_SIZES)}")
    if len(shape) == 1:
        n = shape[0]
    elif len(shape) > MAX_ARRAY_RANK:
        raise ValueError(f"{name}: invalid array shape {shape}: rank must be <= {MAX_ARRAY_RANK}")
    else:
        n = math.prod(shape)
    if n * size != len(a.data) or (shape and min(shape) < 0):
        raise ValueError(
            f"{name}: array byte length {len(a.data)} does not match dtype {a.dtype} x shape "
            f"{tuple(shape)} = {n * size} bytes"
        )
    return n


def check_vectors(specs: tuple) -> None:
    """Each (name, array, dtype) must be a valid 1-d array of that dtype."""
    for name, arr, dtype in specs:
        check_array(name, arr)
        if arr.dtype != dtype or len(arr.shape) != 1:
            raise ValueError(f"{name} must be a 1-d {dtype} array, got {arr.dtype}{list(arr.shape)}")


def check_token_arrays(m: Any) -> None:
    """The token arrays of a sample message (``FinishedSample``, ``TrainSample``): int32 prompt and response
    ids, one float32 ``behav_logp`` and one int32 ``versions`` entry per response token, all 1-d."""
    p, r, b, v = m.prompt_ids, m.response_ids, m.behav_logp, m.versions
    np_, nr = len(p.data), len(r.data)
    if (  # fast path for the common, valid case: 1-d, right dtypes, 4-byte items, sizes agree. Shapes
        # are compared as whole tuples against the byte lengths (no per-dimension Python arithmetic).
        p.dtype == "int32" and r.dtype == "int32" and v.dtype == "int32" and b.dtype == "float32"
        and not (np_ & 3 or nr & 3) and len(b.data) == nr and len(v.data) == nr
        and p.shape == (np_ >> 2,) and r.shape == b.shape == v.shape == (nr >> 2,)
    ):
        return
    check_vectors((("prompt_ids", p, "int32"), ("response_ids", r, "int32"), ("behav_logp", b, "float32"),
                    ("versions", v, "int32")))
    n = r.shape[0]
    if b.shape[0] != n or v.shape[0] != n:
        raise ValueError(
            f"response has {n} tokens but behav_logp has {b.shape[0]} and versions "
            f"{v.shape[0]}: every response token needs one log-prob and one version"
        )
