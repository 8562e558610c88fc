"""Bridge between ``asyncrl.quant`` publications and the weight wire messages.

Owns: the mapping ``PublishedWeights`` <-> (``WeightAnnounce``, raw buffers), and ``PublishedDelta`` <->
(``WeightDelta``, payload frames). Both sides hold the same
manifest entries (``protocols.TensorSpec``, the one manifest type), so nothing is converted: a worker
rebuilds exactly what the learner published (the checksum is verified by ``load_published``).
Never: copies tensor bytes on the sending side (buffers are zero-copy views of the published tensors),
nor, by default, on the receiving side (the rebuilt tensors view the received frames).
"""

from __future__ import annotations

from typing import overload

from asyncrl.quant.delta import PublishedDelta, delta_from_frames, delta_raw
from asyncrl.quant.publish import PublishedWeights
from protocols import WeightAnnounce, WeightDelta


def to_wire(published: PublishedWeights) -> tuple[WeightAnnounce, list[memoryview | bytes | bytearray]]:
    announce = WeightAnnounce(
        version=published.version, fmt=published.fmt, manifest=list(published.manifest), checksum=published.checksum,
        total_bytes=published.total_bytes(),
        aqn_seed=-1 if published.aqn_seed is None else int(published.aqn_seed), aqn_sigma=published.aqn_sigma,
        aqn_resample=published.aqn_resample,
    )
    frames: list[memoryview | bytes | bytearray] = [r.data for r in published.to_raw()]
    return announce, frames


def delta_to_wire(delta: PublishedDelta) -> tuple[WeightDelta, list[memoryview]]:
    """A ``PublishedDelta`` as its ``WeightDelta`` header and payload frames (zero-copy)."""
    header = WeightDelta(
        version=delta.version, fmt=delta.fmt, base_version=delta.base_version, base_checksum=delta.base_checksum,
        manifest=list(delta.manifest), checksum=delta.checksum, parts=list(delta.parts),
        total_bytes=delta.total_bytes(), full_bytes=delta.full_bytes(),
        aqn_seed=-1 if delta.aqn_seed is None else int(delta.aqn_seed), aqn_sigma=delta.aqn_sigma,
        aqn_resample=delta.aqn_resample)
    return header, delta_raw(delta)


@overload
def from_wire(announce: WeightAnnounce, buffers: list, *, copy: bool = False) -> PublishedWeights: ...


@overload
def from_wire(announce: WeightDelta, buffers: list, *, copy: bool = False) -> PublishedDelta: ...


@overload
def from_wire(announce: WeightAnnounce | WeightDelta, buffers: list, *,
              copy: bool = False) -> PublishedWeights | PublishedDelta: ...


def from_wire(announce: WeightAnnounce | WeightDelta, buffers: list, *,
              copy: bool = False) -> PublishedWeights | PublishedDelta:
    """What a fetch returned, rebuilt: a ``PublishedDelta`` for a ``WeightDelta``, else the publication."""
    if isinstance(announce, WeightDelta):
        return delta_from_frames(announce, buffers)
    return full_from_wire(announce, buffers, copy=copy)


def full_from_wire(announce: WeightAnnounce, buffers: list, *, copy: bool = False) -> PublishedWeights:
    """Rebuild the publication. By default its tensors are views of the received buffers (no copy:
    ``load_published`` copies them once, into the model); ``copy=True`` gives it its own memory.
    Verification happens in ``load_published``."""
    return PublishedWeights.from_manifest(
        announce.manifest, buffers, version=announce.version, fmt=announce.fmt, checksum=announce.checksum,
        aqn_seed=None if announce.aqn_seed < 0 else announce.aqn_seed, aqn_sigma=announce.aqn_sigma,
        aqn_resample=announce.aqn_resample, copy=copy)
