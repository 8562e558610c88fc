"""The controller: everything between workers and the learner, without sockets (docs/architecture.md §1-2).

Two layers in one package:

* Systems logic, **standard library only** (``versions``, ``gate``, ``buffer``, ``assembler``,
  ``admission``; the layout test checks it per module): admission (``StalenessGate``; the step that
  answers a work request, ``admission.admit_and_assign``), group assembly and exactly-once
  result accounting (``GroupBuffer``), and learner batches with dynamic sampling and the staleness
  check (``BatchAssembler``). Clocks and version sources are injected, so all of it runs in unit
  tests without processes, sockets or torch. Nothing here is thread-safe; the controller drives it
  from one event loop. This package's ``__init__`` exports only these, so importing it loads neither
  torch, numpy nor zmq.
* The controller's logic on top (``core``: messages in, replies out; ``batches``: the learner's batch
  requests and the ``TrainBatch`` with its metrics; ``state``: the checkpointed state, saved and loaded;
  ``membership``, ``scoring``, ``prompts``, ``validation``, ``quarantine``, ``outbox``, ``recovery``; ``workers``: the worker registry, stdlib only; ``scored``:
  ``ScoredGroup``, a group with its rewards and advantages), imported by module.

Typical wiring (the controller's loop)::

    gate = StalenessGate(version_source, eta=2, groups_per_step=B)
    buffer = GroupBuffer(gate, group_size=G)
    assembler = BatchAssembler(gate, buffer, keep=lambda g: ScoredGroup.of(g).informative())

    admit_and_assign(buffer, worker_id, credits=c, worker_version=w,  # on a work request:
                     make_meta=cursor.next)                           # -> Assignments to send
    buffer.on_result(sample_id, worker_id=w_id, payload=p, min_version=v)
    batch = assembler.try_assemble()                                 # when the learner asks
"""

from asyncrl.controller.admission import admit_and_assign
from asyncrl.controller.assembler import Batch, BatchAssembler, KeepFn
from asyncrl.controller.buffer import (
    Assignment,
    CompleteGroup,
    GroupBuffer,
    GroupState,
    ResultStatus,
    SampleResult,
)
from asyncrl.controller.gate import GateCounts, StalenessGate
from asyncrl.controller.versions import (
    Clock,
    ManualVersion,
    VersionLike,
    VersionSource,
    make_group_id,
    make_sample_id,
    parse_sample_id,
    version_reader,
)

__all__ = [
    "Assignment",
    "Batch",
    "BatchAssembler",
    "Clock",
    "CompleteGroup",
    "GateCounts",
    "GroupBuffer",
    "GroupState",
    "KeepFn",
    "ManualVersion",
    "ResultStatus",
    "SampleResult",
    "StalenessGate",
    "VersionLike",
    "VersionSource",
    "admit_and_assign",
    "make_group_id",
    "make_sample_id",
    "parse_sample_id",
    "version_reader",
]
