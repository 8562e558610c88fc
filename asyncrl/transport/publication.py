"""Bridge between ``asyncrl.quant`` publications and the weight wire messages.

Owns: the mapping ``PublishedWeights`` <-> (``WeightAnnounce``, raw buffers), ``PublishedDelta`` <->
(``WeightDelta``, payload frames), and ``publish_streamed``: quantise-on-send straight into a weight server's
bucketed stream (each tensor, and its delta part, served while the next is quantised). Both sides hold the same
manifest entries (``protocols.TensorSpec``, the one manifest type), so nothing is converted: a worker
rebuilds exactly what the learner published (the checksum is verified by ``load_published``).
Never: copies tensor bytes on the sending side (buffers are zero-copy views of the published tensors),
nor, by default, on the receiving side (the rebuilt tensors view the received frames).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, overload

from torch import Tensor

from asyncrl.quant.delta import DeltaStream, PublishedDelta, delta_from_frames, delta_raw
from asyncrl.quant.publish import PublishedWeights, publish
from asyncrl.quant.wire import raw_bytes
from asyncrl.transport.weights import WeightServer
from protocols import TensorSpec, WeightAnnounce, WeightDelta


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


def publish_streamed(server: WeightServer, state_dict: Mapping[str, Tensor], fmt: str, *, version: int,
                     prev: PublishedWeights | None = None, **publish_kwargs: Any) -> tuple[PublishedWeights,
                                                                                           PublishedDelta | None]:
    """``asyncrl.quant.publish`` of ``version`` in ``fmt`` on ``server`` while it is made: announced at once, each
    tensor added to the server's stream as soon as it is quantised (bucketed fetches get each bucket once its bytes
    are there), and, with ``prev`` (the previous publication of ``fmt``), the delta from it made and streamed
    alongside. The publication, and the delta (or None), as ``publish``/``make_delta`` make them; a failure
    aborts the version on the server (every fetch of it is refused: workers keep what they hold) and propagates.
    ``publish_kwargs``: ``publish``'s own (AQN, UAQ, head, pool)."""
    sigma, seed = float(publish_kwargs.get("aqn_sigma", 0.0)), publish_kwargs.get("aqn_seed")
    noisy = sigma != 0.0 and seed is not None  # what publish records (its checksum covers it)
    live = server.begin(version, fmt, aqn_seed=int(seed) if noisy and seed is not None else -1,
                        aqn_sigma=sigma if noisy else 0.0,
                        aqn_resample=publish_kwargs.get("aqn_resample", "publication") if noisy else "publication",
                        delta_base=None if prev is None else (prev.version, prev.checksum))
    stream = None if prev is None else DeltaStream(prev, version, fmt)

    def on_entry(spec: TensorSpec, t: Tensor) -> None:
        live.add(spec, raw_bytes(t))
        if stream is not None:
            part, frame = stream.add(spec, t)
            live.add_delta(spec, part, None if frame is None else raw_bytes(frame))

    try:
        pub = publish(state_dict, fmt, version=version, on_entry=on_entry, **publish_kwargs)
        delta = None if stream is None else stream.finish(pub)
        live.finish(*to_wire(pub), *(delta_to_wire(delta) if delta is not None else (None, None)))
    except BaseException as e:
        live.abort(f"{type(e).__name__}: {e}")
        raise
    return pub, delta
