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
from protocols.weights import (
    WeightAnnounce,
    WeightBucket,
    WeightChunk,
    WeightDelta,
    WeightFetch,
)

PROTOCOL_MAJOR = 1
# 1.1: TensorSpec.digest; 1.2: WeightAnnounce.aqn_resample; 1.3: Hello.version, Welcome.setup/run,
# VersionUpdate.checkpoint/checkpointed/done, Heartbeat.version (typed, instead of string/float dicts);
# 1.4: WorkerSetup.group_size; 1.5: WeightFetch.base_version/base_checksum, WeightDelta (a worker of 1.4 never
# asks for a delta, and a server of 1.4 ignores the base and sends the full version); 1.6: WeightFetch.bucket_bytes/
# bucket, WeightChunk.offset, WeightBucket (a worker of 1.5 never asks for buckets, and a server of 1.5 ignores
# bucket_bytes and answers in one piece, which a worker of 1.6 takes as before); 1.7: WorkerSetup.actor_format, and a
# worker's Hello names its own quant.fmt, not the fetched one (the controller decides both; 1.6 named one it serves);
# 1.8: WorkerSetup.quantize_embedding (a worker of 1.7 ignores it and its load names quant.embedding)
PROTOCOL_MINOR = 8
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
# protocols/weights.py: TensorSpec, WeightAnnounce, WeightFetch, DeltaPart, WeightDelta, WeightChunk,
# WeightBucket (imported above)


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
    | WeightBucket
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
