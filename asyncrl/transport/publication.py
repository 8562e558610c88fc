"""Bridge between ``asyncrl.quant`` publications and the weight wire messages.

Owns: the mapping ``PublishedWeights`` <-> (``WeightAnnounce``, raw buffers). Both sides hold the same
manifest entries (``protocols.TensorSpec``, the one manifest type), so nothing is converted: a worker
rebuilds exactly what the learner published (the checksum is verified by ``load_published``).
Never: copies tensor bytes on the sending side (buffers are zero-copy views of the published tensors),
nor, by default, on the receiving side (the rebuilt tensors view the received frames).
"""

from __future__ import annotations

from asyncrl.quant.publish import PublishedWeights
from protocols import WeightAnnounce


def to_wire(published: PublishedWeights) -> tuple[WeightAnnounce, list[memoryview | bytes | bytearray]]:
    announce = WeightAnnounce(
        version=published.version, fmt=published.fmt, manifest=list(published.manifest), checksum=published.checksum,
        total_bytes=published.total_bytes(),
        aqn_seed=-1 if published.aqn_seed is None else int(published.aqn_seed), aqn_sigma=published.aqn_sigma,
        aqn_resample=published.aqn_resample,
    )
    frames: list[memoryview | bytes | bytearray] = [r.data for r in published.to_raw()]
    return announce, frames


def from_wire(announce: WeightAnnounce, buffers: list, *, copy: bool = False) -> PublishedWeights:
    """Rebuild the publication. By default its tensors are views of the received buffers (no copy:
    ``load_published`` copies them once, into the model); ``copy=True`` gives it its own memory.
    Verification happens in ``load_published``."""
    return PublishedWeights.from_manifest(
        announce.manifest, buffers, version=announce.version, fmt=announce.fmt, checksum=announce.checksum,
        aqn_seed=None if announce.aqn_seed < 0 else announce.aqn_seed, aqn_sigma=announce.aqn_sigma,
        aqn_resample=announce.aqn_resample, copy=copy)
