"""Bridge between ``asyncrl.quant`` publications and the weight wire messages.

Owns: the mapping ``PublishedWeights`` <-> (``WeightAnnounce``, raw buffers), field for field, so a
worker rebuilds exactly what the learner published (the checksum is verified by ``load_published``).
Never: copies tensor bytes on the sending side (buffers are zero-copy views of the published tensors),
nor, by default, on the receiving side (the rebuilt tensors view the received frames).
"""

from __future__ import annotations

from asyncrl.quant.publish import ManifestEntry, PublishedWeights, RawTensor
from protocols import TensorSpec, WeightAnnounce


def to_wire(published: PublishedWeights) -> tuple[WeightAnnounce, list[memoryview]]:
    specs = [
        TensorSpec(name=e.name, dtype=e.dtype, shape=tuple(e.shape), nbytes=e.nbytes, role=e.role, fmt=e.fmt,
                   sha256=e.digest.removeprefix("sha256:") if e.digest.startswith("sha256:") else "",
                   digest=e.digest, logical_shape=tuple(e.logical_shape or ()))
        for e in published.manifest
    ]
    announce = WeightAnnounce(
        version=published.version, fmt=published.fmt, manifest=specs, checksum=published.checksum,
        total_bytes=published.total_bytes(),
        aqn_seed=-1 if published.aqn_seed is None else int(published.aqn_seed), aqn_sigma=published.aqn_sigma,
        aqn_resample=published.aqn_resample,
    )
    return announce, [r.data for r in published.to_raw()]


def from_wire(announce: WeightAnnounce, buffers: list, *, copy: bool = False) -> PublishedWeights:
    """Rebuild the publication. By default its tensors are views of the received buffers (no copy:
    ``load_published`` copies them once, into the model); ``copy=True`` gives it its own memory.
    Verification happens in ``load_published``."""
    manifest = [
        ManifestEntry(name=s.name, dtype=s.dtype, shape=tuple(s.shape), fmt=s.fmt, role=s.role, nbytes=s.nbytes,
                      digest=s.digest or (f"sha256:{s.sha256}" if s.sha256 else ""),
                      logical_shape=tuple(s.logical_shape) if s.logical_shape else None)
        for s in announce.manifest
    ]
    header = {"version": announce.version, "fmt": announce.fmt, "checksum": announce.checksum,
              "aqn_seed": None if announce.aqn_seed < 0 else announce.aqn_seed, "aqn_sigma": announce.aqn_sigma,
              "aqn_resample": announce.aqn_resample, "manifest": [e.to_dict() for e in manifest]}
    raw = [RawTensor(s.name, buf, s.dtype, tuple(s.shape)) for s, buf in zip(announce.manifest, buffers, strict=True)]
    return PublishedWeights.from_raw(header, raw, copy=copy)
