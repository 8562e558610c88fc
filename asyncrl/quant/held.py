"""What a worker's converted model holds: the per-tensor digests of the last publication loaded into it.

Owns: the record (``HELD_DIGESTS``, beside ``publish.HELD_CHECKSUM``: every manifest digest of the version
loaded, set by `load_published`, `apply_delta` and `load_buckets` once the version is in) and `holds` (a tensor
the model already holds bit for bit: its recorded digest is the new one and its bytes still hash to it).

A whole version after the one before repeats much of it: under LoRA every full-precision tensor (the token
embedding, the norms), and the scales of a layer a step left alone. `load_published` uses the record to skip
what the model holds already: no check of received bytes it does not use, no copy, no cache rebuilt.

Exactness: the record is a hint, never trusted alone: a tensor is skipped only when its own bytes hash to the
new manifest digest (the check a received tensor gets), so a model written some other way since its last load
is loaded as before. Must never: skip a tensor whose bytes were not hashed against the new digest.
"""

from __future__ import annotations

from torch import Tensor, nn

from protocols import TensorSpec

from .wire import digest_matches

HELD_DIGESTS = "_asyncrl_published_digests"
"""Attribute of a worker's model: {manifest name: digest} of the last publication loaded into it."""


def held_digests(model: nn.Module) -> dict[str, str]:
    """{manifest name: digest} of the last publication loaded into ``model`` ({} if none, or if a load of it
    was interrupted)."""
    held = vars(model).get(HELD_DIGESTS)
    return held if isinstance(held, dict) else {}


def forget_held(model: nn.Module) -> None:
    """Drop the record (a load is writing the model)."""
    vars(model).pop(HELD_DIGESTS, None)


def record_held(model: nn.Module, manifest: list[TensorSpec] | tuple[TensorSpec, ...]) -> None:
    """Record the digests of the version ``manifest`` describes, now held by ``model`` (every tensor checked)."""
    vars(model)[HELD_DIGESTS] = {e.name: e.digest for e in manifest}


def holds(model: nn.Module, e: TensorSpec, dest: Tensor) -> bool:
    """Whether ``dest`` (the model's tensor of entry ``e``) holds ``e``'s bytes already: its recorded digest is
    ``e``'s and its bytes hash to it (a host tensor; one on an accelerator is never skipped)."""
    return (held_digests(model).get(e.name) == e.digest and dest.device.type == "cpu" and dest.is_contiguous()
            and digest_matches(dest, e.digest))
