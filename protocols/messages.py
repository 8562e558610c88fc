"""The asyncrl wire messages: msgspec Structs, one tagged union per socket kind.

Owns: the shape of every message that crosses a process boundary.
Never: imports torch, numpy or zmq (a client in another project speaks this protocol with msgspec
alone); holds behaviour beyond validation of its own fields.

Evolution rules (msgspec schema evolution, enforced in review):
  1. Fields are only ever *appended* to a Struct, and every appended field has a default.
  2. A field's type and position never change; a field is never removed or renamed (deprecate it by
     ignoring it, keep it on the wire).
  3. Tags (the ``tag=`` string of each Struct) never change and are never reused.
  4. Any change that breaks rules 1-3 bumps ``PROTOCOL_MAJOR``; appending fields bumps ``PROTOCOL_MINOR``.
  5. Every connection starts with ``Hello``; a server refuses a peer whose major version differs, or
     whose minor is below ``PROTOCOL_FLOOR_MINOR``, with a ``Reject`` that states both versions and the
     fix. Minors from the floor up interoperate (old peers ignore new fields, new peers see defaults for
     fields old peers do not send).
  6. Protocol 1.4 is the floor: no peer reads or writes an older form of the same information (the
     string ``Welcome.config``, control flags among ``VersionUpdate.metrics``, a version among
     ``Heartbeat.stats``). Such a field stays on the wire, unread and empty (rule 2).
  7. The fields (name, type, default, order) and tag of every Struct are checked against the table of
     ``PROTOCOL_VERSION`` in tests/unit/protocols/wire_schema.json (tests/unit/protocols/test_schema.py,
     which also checks rules 1-3 between the tables): a change bumps the version per rule 4 and adds
     that version's table.

Arrays travel as ``Array`` (raw bytes + dtype + shape, ``protocols.arrays``), never as Python lists. Validation happens at
decode time (``__post_init__`` runs inside msgspec's decoder), so a decoded message is well-formed.
"""

from __future__ import annotations

import math

import msgspec

from protocols.arrays import Array, check_token_arrays, check_vectors
from protocols.setup import RunSetup, WorkerSetup
from protocols.values import FINISH_REASONS

PROTOCOL_MAJOR = 1
# 1.1: TensorSpec.digest; 1.2: WeightAnnounce.aqn_resample; 1.3: Hello.version, Welcome.setup/run,
# VersionUpdate.checkpoint/checkpointed/done, Heartbeat.version (typed, instead of string/float dicts);
# 1.4: WorkerSetup.group_size; 1.5: WeightFetch.base_version/base_checksum, WeightDelta (a worker of 1.4 never
# asks for a delta, and a server of 1.4 ignores the base and sends the full version)
PROTOCOL_MINOR = 5
PROTOCOL_VERSION = f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"
PROTOCOL_FLOOR_MINOR = 4
"""The oldest minor a peer may speak (evolution rule 5); older peers are refused at ``Hello``."""

ROLES = ("controller", "generator", "learner", "client")


class _Base(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=False):
    """Common options: keyword-only construction, defaults omitted on the wire."""


# ----------------------------------------------------------------------------------------- handshake
def _check_version(owner: str, version: int) -> None:
    if version < -1:
        raise ValueError(f"{owner}.version must be a weights version >= 0 (or -1: none yet), got {version}")


class Hello(_Base, tag="hello"):
    """First message on every control connection.

    ``version``: the newest weights version the peer holds; the learner's is the version it starts at
    (0, or a resumed checkpoint's), -1 when it has none."""

    protocol_version: str
    role: str
    peer_id: str
    capabilities: dict[str, str] = {}
    version: int = -1

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; expected one of {ROLES}")
        if not self.peer_id:
            raise ValueError("peer_id must be a non-empty string")
        _check_version("Hello", self.version)


class Welcome(_Base, tag="welcome"):
    """Handshake accepted. ``latest_version`` lets a late joiner fetch the newest weights at once.

    ``setup``: a generation worker's ``WorkerSetup``; ``run``: the ``RunSetup`` a learner that asked
    where the run is gets. ``config``: unused and empty (evolution rule 6), kept on the wire (rule 2).
    Read a Welcome with ``worker_setup()`` / ``run_setup()``: a ``ValueError`` names the fix when the
    setup is missing."""

    protocol_version: str
    server_id: str
    latest_version: int = -1
    config: dict[str, str] = {}
    setup: WorkerSetup | None = None
    run: RunSetup | None = None

    def worker_setup(self) -> WorkerSetup:
        """The worker setup; ``ValueError`` naming the fix when this Welcome carries none."""
        if self.setup is None:
            raise ValueError(self._missing("worker setup"))
        return self.setup

    def run_setup(self) -> RunSetup:
        """The run setup; ``ValueError`` naming the fix when this Welcome carries none."""
        if self.run is None:
            raise ValueError(self._missing("run setup"))
        return self.run

    def _missing(self, what: str) -> str:
        return (f"the Welcome of {self.server_id!r} (protocol {self.protocol_version}) carries no {what}; "
                f"run a controller of protocol {PROTOCOL_MAJOR}.{PROTOCOL_FLOOR_MINOR} or newer (upgrade asyncrl there)")


class Reject(_Base, tag="reject"):
    """Handshake refused; ``reason`` says what to change."""

    reason: str
    server_version: str = PROTOCOL_VERSION


# --------------------------------------------------------------------------------------------- work
class SamplingParams(_Base, tag="sampling_params"):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop_token_ids: list[int] = []
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


class WorkRequest(_Base, tag="work_request"):
    """A worker asks for up to ``credits`` more samples (its free generation slots). ``version`` is the
    weights version its engine has applied (-1: unknown; then heartbeats tell), never one handed over and
    not applied yet: the controller assigns only groups admitted at or before it, so every token of the work
    it gets comes from weights at least as new as its group's admission."""

    worker_id: str
    credits: int
    version: int = -1

    def __post_init__(self) -> None:
        if self.credits < 0:
            raise ValueError(f"credits must be >= 0, got {self.credits}")


class RolloutAssignment(_Base, tag="rollout_assignment"):
    """Generate ``n_samples`` responses to one prompt; ``sample_ids[i]`` names response i."""

    group_id: str
    sample_ids: list[str]
    prompt_ids: Array
    params: SamplingParams
    n_samples: int

    def __post_init__(self) -> None:
        if self.n_samples != len(self.sample_ids) or self.n_samples < 1:
            raise ValueError(f"n_samples={self.n_samples} but {len(self.sample_ids)} sample ids")
        check_vectors((("prompt_ids", self.prompt_ids, "int32"),))


class NoWork(_Base, tag="no_work"):
    """No work can be admitted now (staleness gate closed, or fewer credits than a group); ask again
    after ``retry_after_s``."""

    retry_after_s: float = 0.05

    def __post_init__(self) -> None:
        if not (math.isfinite(self.retry_after_s) and self.retry_after_s >= 0):
            raise ValueError(f"NoWork.retry_after_s must be a finite number of seconds >= 0, got {self.retry_after_s!r}")


class FinishedSample(_Base, tag="finished_sample", gc=False):
    """One finished response. ``behav_logp[t]`` and ``versions[t]`` belong to ``response_ids[t]``.

    ``gc=False`` (untracked by the garbage collector; not a wire change): its fields are strings,
    Arrays and a dict of floats, none of which can point back to it. Do not store cyclic objects on it."""

    sample_id: str
    group_id: str
    prompt_ids: Array
    response_ids: Array
    behav_logp: Array
    versions: Array
    finish_reason: str
    worker_id: str
    engine: str = "native"
    quant_format: str = "fp32"
    timings: dict[str, float] = {}

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason {self.finish_reason!r} not in {FINISH_REASONS}")
        check_token_arrays(self)


# ------------------------------------------------------------------------------------------ weights
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
    """Version ``version`` is published; fetch it by ``WeightFetch``. Sent on PUB and on request."""

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
    Its name, dtype, shape and byte count are those of manifest entry ``index`` (``for_entry``/``describes``)."""

    version: int
    index: int
    count: int
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

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


# ---------------------------------------------------------------------------------------- learning
class TrainSample(_Base, tag="train_sample", gc=False):
    """A scored sample as the learner consumes it (``gc=False`` as ``FinishedSample``)."""

    sample_id: str
    group_id: str
    prompt_ids: Array
    response_ids: Array
    behav_logp: Array
    versions: Array
    advantage: float
    reward: float
    finish_reason: str = "stop"

    def __post_init__(self) -> None:
        check_token_arrays(self)


class BatchRequest(_Base, tag="batch_request"):
    """The learner (rank 0) asks for the batch of training step ``step``."""

    step: int


class TrainBatch(_Base, tag="train_batch"):
    step: int
    samples: list[TrainSample]
    metrics: dict[str, float] = {}


class VersionUpdate(_Base, tag="version_update"):
    """The learner finished step ``version - 1`` and published ``version``; ``metrics`` are numbers only.

    Control (typed flags, never ``metrics`` entries):
    ``checkpoint``: learner -> controller, save your state for ``version`` and acknowledge (the learner
    writes its own checkpoint of ``version`` only after the acknowledgement); ``checkpointed``:
    controller -> learner, that acknowledgement; ``done``: learner -> controller, training is finished."""

    version: int
    metrics: dict[str, float] = {}
    checkpoint: bool = False
    checkpointed: bool = False
    done: bool = False

    def __post_init__(self) -> None:
        if self.version < 0:
            raise ValueError(f"VersionUpdate.version must be >= 0, got {self.version}")
        if self.checkpoint and self.checkpointed:
            raise ValueError("a VersionUpdate is a checkpoint request (learner) or its acknowledgement "
                             "(controller), not both; set one of checkpoint / checkpointed")


class Heartbeat(_Base, tag="heartbeat"):
    """A worker is alive. ``version``: the weights version its engine uses for new work (-1: none yet).
    ``stats`` are numbers."""

    peer_id: str
    time: float
    stats: dict[str, float] = {}
    version: int = -1

    def __post_init__(self) -> None:
        _check_version("Heartbeat", self.version)


class Goodbye(_Base, tag="goodbye"):
    """A worker leaves. ``unfinished`` lists the assigned samples it did not finish: reissue them."""

    peer_id: str
    unfinished: list[str] = []
    reason: str = ""


class Shutdown(_Base, tag="shutdown"):
    reason: str = ""


class Error(_Base, tag="error"):
    """A request was refused or could not be parsed; ``message`` names the fix."""

    code: str
    message: str


Message = (
    Hello
    | Welcome
    | Reject
    | WorkRequest
    | RolloutAssignment
    | NoWork
    | FinishedSample
    | WeightAnnounce
    | WeightFetch
    | WeightChunk
    | WeightDelta
    | TrainSample
    | BatchRequest
    | TrainBatch
    | VersionUpdate
    | Heartbeat
    | Goodbye
    | Shutdown
    | Error
)

MESSAGE_TYPES: tuple[type, ...] = Message.__args__
