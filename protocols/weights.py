"""The weight-publication messages: manifest entries, announcements, fetches, deltas, chunks and buckets.

Owns: the shape of what crosses the weight sockets (``asyncrl.transport.weights``): ``TensorSpec`` (the one
manifest entry type), ``WeightAnnounce``, ``WeightFetch``, ``DeltaPart``/``WeightDelta``, ``WeightChunk`` and
``WeightBucket``. Part of ``protocols.messages``' ``Message`` union and its evolution rules (that module's
docstring); split out only to keep each file readable.
Never: imports torch, numpy or zmq; holds behaviour beyond validation of its own fields.

Wire forms of one version (details in each Struct's docstring):
  * whole, one piece: ``WeightAnnounce`` then one [``WeightChunk``, payload] per manifest entry;
  * as a delta: ``WeightDelta`` then one [``WeightChunk``, payload] per part that carries a frame (1.5);
  * in buckets (1.6): the version's bytes as one stream cut every ``bucket_bytes``; each bucket asked for by
    its own ``WeightFetch`` and answered by a ``WeightBucket`` then its pieces, [``WeightChunk``, payload].
"""

from __future__ import annotations

import msgspec


class _Base(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=False):
    """The options of every protocol Struct (``protocols.messages._Base``)."""


class TensorSpec(_Base, tag="tensor_spec"):
    """One entry of a weight manifest: the one manifest type of asyncrl (``asyncrl.quant`` builds and
    verifies publications from it, ``asyncrl.transport`` ships it in ``WeightAnnounce`` and checks every
    ``WeightChunk`` against it, the engines load what it describes).

    ``role``: ``full_precision`` (a tensor asyncrl.quant publishes untouched), ``weight``, ``codes``,
    ``scale``, ``global_scale`` (the format tensors of a quantized linear, asyncrl.quant.formats); the
    default ``full`` is what a publisher that never quantizes may leave.
    ``logical_shape``: the [N, K] of the linear a ``codes``/``weight`` entry encodes (``()``: none).
    ``digest`` ("xxh3_128:<hex>", since 1.1) is the integrity digest of the tensor's bytes; ``sha256`` is
    what 1.0 publishers sent instead. The two agree after construction and decoding: a sha256-only entry
    gets ``digest = "sha256:<hex>"``, and a ``sha256:`` digest is mirrored into ``sha256`` for 1.0 readers."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    role: str = "full"
    fmt: str = ""
    sha256: str = ""
    logical_shape: tuple[int, ...] = ()
    digest: str = ""

    def __post_init__(self) -> None:
        if not self.digest and self.sha256:
            self.digest = f"sha256:{self.sha256}"
        elif not self.sha256 and self.digest.startswith("sha256:"):
            self.sha256 = self.digest.removeprefix("sha256:")


class WeightAnnounce(_Base, tag="weight_announce"):
    """Version ``version`` is published; fetch it by ``WeightFetch``. Sent on PUB and on request.

    An announcement on PUB of a version still being published (a learner that streams its publication in
    buckets, since 1.6) has an empty ``manifest`` and ``checksum``: fetch it at once, the server answers each
    bucket as soon as its bytes are ready, and a one-piece fetch once the whole version is."""

    version: int
    fmt: str
    manifest: list[TensorSpec]
    checksum: str
    total_bytes: int
    aqn_seed: int = -1
    aqn_sigma: float = 0.0
    aqn_resample: str = "publication"
    """``forward``: clean gains; the sampler redraws the AQN noise at every forward (seed, sigma above)."""


class WeightFetch(_Base, tag="weight_fetch"):
    """Ask for every chunk of ``version`` (-1: the latest) in format ``fmt`` ("" = the primary format).

    ``base_version`` >= 0: the asker holds that version, whose publication checksum is ``base_checksum``, and
    takes a ``WeightDelta`` from it when the server has one (the version right after the base, not a version
    the server sends whole); otherwise the answer is the full version (``WeightAnnounce`` and its chunks)."""

    version: int = -1
    fmt: str = ""
    base_version: int = -1
    base_checksum: str = ""
    bucket_bytes: int = 0
    """Since 1.6. 0: the version in one piece (as above). > 0: in buckets of this many bytes; -1: in buckets of
    the server's size (``transport.bucket_mb``; one piece when the server's is 0). A bucketed answer is one
    ``WeightBucket`` and its pieces; a server of 1.5 ignores the field and answers in one piece."""
    bucket: int = 0
    """Which bucket of a bucketed fetch: 0 first, then each next one while the last bucket's ``last`` is false
    (``version`` then names the version bucket 0 said, ``bucket_bytes`` its size)."""

    def __post_init__(self) -> None:
        if self.bucket < 0 or self.bucket_bytes < -1:
            raise ValueError(f"WeightFetch asks for bucket {self.bucket} of {self.bucket_bytes} bytes: the bucket is "
                             ">= 0, its size > 0, -1 (the server's) or 0 (one piece)")


class DeltaPart(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """How manifest entry ``name`` of a ``WeightDelta`` travels: ``same`` (unchanged since the base: no
    frame), ``sparse`` (``count`` changed elements: one frame of ``count`` int32 flat indices then the
    ``count`` new elements, little-endian) or ``dense`` (the whole tensor: one frame of the entry's bytes).
    ``nbytes`` is the frame's size (0 for ``same``)."""

    name: str
    kind: str
    count: int = 0
    nbytes: int = 0


DELTA_KINDS = ("same", "sparse", "dense")


class WeightDelta(_Base, tag="weight_delta"):
    """Version ``version`` as the changes from ``base_version`` (publication checksum ``base_checksum``):
    the answer to a ``WeightFetch`` that named that base. ``manifest`` and ``checksum`` are those of the
    full version (so a worker checks every changed tensor against its digest after applying); ``parts`` say,
    entry by entry in manifest order, how each travels, and one ``WeightChunk`` (name, dtype ``delta``,
    shape ``(nbytes,)``) plus its payload frame follows for each part that is not ``same``."""

    version: int
    fmt: str
    base_version: int
    base_checksum: str
    manifest: list[TensorSpec]
    checksum: str
    parts: list[DeltaPart]
    total_bytes: int
    """Bytes of the payload frames (what the delta moves, headers aside)."""
    full_bytes: int
    """Bytes of the full version, for the ratio."""
    aqn_seed: int = -1
    aqn_sigma: float = 0.0
    aqn_resample: str = "publication"

    def __post_init__(self) -> None:
        if len(self.parts) != len(self.manifest) or any(
                p.name != e.name for p, e in zip(self.parts, self.manifest, strict=False)):
            raise ValueError("WeightDelta.parts must name the manifest entries, in order")
        for p in self.parts:
            if p.kind not in DELTA_KINDS or p.count < 0 or p.nbytes < 0 or (p.kind == "same") != (p.nbytes == 0):
                raise ValueError(f"WeightDelta part {p.name!r}: kind {p.kind!r} with {p.nbytes} bytes is not one of "
                                 f"{DELTA_KINDS} (same: 0 bytes)")
        if self.base_version < 0 or self.version <= self.base_version:
            raise ValueError(f"WeightDelta from {self.base_version} to {self.version}: the base must be an "
                             "earlier version")

    def payload_parts(self) -> list[DeltaPart]:
        """The parts that carry a frame, in order."""
        return [p for p in self.parts if p.kind != "same"]


class WeightChunk(_Base, tag="weight_chunk"):
    """Header of one tensor of a published version; its raw bytes travel in the next ZeroMQ frame.
    Its name, dtype, shape and byte count are those of manifest entry ``index`` (``for_entry``/``describes``).
    In a bucket (``for_piece``, since 1.6) it is piece ``index`` of the bucket's ``count``: ``nbytes`` bytes of
    entry ``name`` starting ``offset`` bytes into that entry's bytes (its tensor's, or its delta part's frame)."""

    version: int
    index: int
    count: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0

    @classmethod
    def for_entry(cls, spec: TensorSpec, *, version: int, index: int, count: int) -> WeightChunk:
        """The chunk header of manifest entry ``index`` (of ``count``) of ``version``."""
        return cls(version=version, index=index, count=count, name=spec.name, dtype=spec.dtype,
                   shape=tuple(spec.shape), nbytes=spec.nbytes)

    @classmethod
    def for_delta_part(cls, part: DeltaPart, *, version: int, index: int, count: int) -> WeightChunk:
        """The chunk header of a ``WeightDelta``'s payload part ``index`` (of ``count`` that carry a frame)."""
        return cls(version=version, index=index, count=count, name=part.name, dtype="delta",
                   shape=(part.nbytes,), nbytes=part.nbytes)

    def describes(self, spec: TensorSpec, *, version: int, index: int) -> bool:
        """Whether this header is manifest entry ``index`` of ``version`` (what a fetch expects next)."""
        return (self.version == version and self.index == index and self.name == spec.name
                and self.dtype == spec.dtype and tuple(self.shape) == tuple(spec.shape)
                and self.nbytes == spec.nbytes)

    @classmethod
    def for_piece(cls, name: str, *, version: int, index: int, count: int, offset: int, nbytes: int) -> WeightChunk:
        """The chunk header of piece ``index`` (of ``count``) of a bucket: ``nbytes`` bytes of entry ``name`` from
        ``offset`` on."""
        return cls(version=version, index=index, count=count, name=name, dtype=BUCKET_DTYPE, shape=(nbytes,),
                   nbytes=nbytes, offset=offset)


BUCKET_DTYPE = "bucket"
"""``WeightChunk.dtype`` of a bucket's piece (its bytes are a slice of an entry's, not a tensor)."""


class WeightBucket(_Base, tag="weight_bucket"):
    """Bucket ``index`` of version ``version`` sent in buckets of ``bucket_bytes`` (since 1.6): the answer to a
    ``WeightFetch`` with ``bucket_bytes`` != 0.

    The version travels as one byte stream: its items' bytes in stream order (a whole version: each manifest
    entry's tensor bytes; a delta from ``base_version``: each part's frame, a ``same`` part none), cut every
    ``bucket_bytes``; bucket ``index`` holds the ``nbytes`` stream bytes from ``index * bucket_bytes`` on, as
    ``pieces`` [``WeightChunk`` (``for_piece``), payload] messages that follow it, in order; ``digest`` is the
    XXH3-128 of those bytes ("xxh3_128:<hex>"). ``entries`` are the manifest entries whose bytes start in this
    bucket (every entry after them too on the last bucket), in stream order, with their ``parts`` for a delta
    (none for a whole version), so a worker can check and load each bucket as it comes. The version's fields
    (``fmt``, the base, AQN) are the same in every bucket; the last one also carries the version's ``checksum``,
    which the manifest collected from all buckets must match, ``buckets`` and ``total_bytes`` (the stream's)."""

    version: int
    fmt: str
    index: int
    bucket_bytes: int
    nbytes: int
    pieces: int
    digest: str
    entries: list[TensorSpec] = []
    parts: list[DeltaPart] = []
    base_version: int = -1
    base_checksum: str = ""
    last: bool = False
    checksum: str = ""
    buckets: int = 0
    total_bytes: int = 0
    full_bytes: int = 0
    """Bytes of the whole version (for a delta, the ratio; for a whole version, ``total_bytes``)."""
    aqn_seed: int = -1
    aqn_sigma: float = 0.0
    aqn_resample: str = "publication"

    def __post_init__(self) -> None:
        if self.index < 0 or self.bucket_bytes < 1 or not 0 <= self.nbytes <= self.bucket_bytes or self.pieces < 0:
            raise ValueError(f"WeightBucket {self.index}: {self.nbytes} bytes in {self.pieces} pieces does not fit "
                             f"buckets of {self.bucket_bytes} bytes")
        if self.parts and (len(self.parts) != len(self.entries) or any(
                p.name != e.name for p, e in zip(self.parts, self.entries, strict=False))):
            raise ValueError("WeightBucket.parts must name its entries, in order")
        if (self.base_version >= 0) != bool(self.parts) and self.entries:
            raise ValueError("a WeightBucket of a delta has one part per entry, one of a whole version none")
        for p in self.parts:
            if p.kind not in DELTA_KINDS or p.count < 0 or p.nbytes < 0 or (p.kind == "same") != (p.nbytes == 0):
                raise ValueError(f"WeightBucket part {p.name!r}: kind {p.kind!r} with {p.nbytes} bytes is not one of "
                                 f"{DELTA_KINDS} (same: 0 bytes)")
        if self.last and (self.buckets != self.index + 1
                          or self.total_bytes != self.index * self.bucket_bytes + self.nbytes):
            raise ValueError(f"last WeightBucket {self.index}: says {self.buckets} buckets and {self.total_bytes} "
                             "stream bytes, which it does not end")

    @property
    def is_delta(self) -> bool:
        return self.base_version >= 0
