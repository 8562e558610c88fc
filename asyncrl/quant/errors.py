"""Error types of asyncrl.quant.

Owns: the `QuantError` hierarchy. Every error raised for bad user input (a weight, a publication, a
format name) is a `QuantError`, which is a `ValueError`, and names the offending tensor in
`tensor_name` (or None when no single tensor is to blame) and says how to fix it in the message.

Must never: be raised for internal invariants (those use `assert`).
"""

from __future__ import annotations


class QuantError(ValueError):
    """Base class: bad input to asyncrl.quant. `tensor_name` names the tensor at fault, if any."""

    def __init__(self, message: str, *, tensor_name: str | None = None) -> None:
        self.tensor_name = tensor_name
        prefix = f"tensor {tensor_name!r}: " if tensor_name is not None else ""
        super().__init__(prefix + message)


class UnknownFormatError(QuantError):
    """A format name outside `asyncrl.quant.FORMATS`."""


class NonFiniteWeightError(QuantError):
    """A NaN or +-inf in a weight, a scale or a full-precision tensor."""


class BlockShapeError(QuantError):
    """A tensor the format cannot block (not 2-D, empty, or too wide for exact int32 accumulation)."""


class ManifestMismatchError(QuantError):
    """Manifest, tensors and model disagree (missing/extra name, dtype, shape or byte count)."""


class ChecksumMismatchError(QuantError):
    """The bytes of a tensor, or the manifest, do not hash to the published digest."""


class FormatMismatchError(QuantError):
    """A publication of one format offered to a model converted to another."""
