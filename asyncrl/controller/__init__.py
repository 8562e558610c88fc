"""The controller: everything between workers and the learner, without sockets (docs/architecture.md §1-2).

Two layers in one package:

* Systems logic, **standard library only** (``versions``, ``gate``, ``buffer``, ``assembler``,
  ``admission``, ``scores``; the layout test checks it per module): admission (``StalenessGate``; the step that
  answers a work request, ``admission.admit_and_assign``), group assembly and exactly-once
  result accounting (``GroupBuffer``), and learner batches with dynamic sampling and the staleness
  check (``BatchAssembler``). Clocks and version sources are injected, so all of it runs in unit
  tests without processes, sockets or torch. Nothing here is thread-safe; the controller drives it
  from one event loop. This package's ``__init__`` exports only these, so importing it loads neither
  torch, numpy nor zmq.
* The controller's logic on top, imported by module: ``core`` (``ControllerCore``: messages in, replies
  out), composed of ``membership`` (``Membership``: the learner and the workers, with ``workers``, the
  registry, and ``quarantine``), ``batches`` (``BatchDesk``: the learner's batch requests, the time budget,
  the ``TrainBatch`` with its metrics) and ``report`` (``RunReport``: each learner version's metrics row and
  the health watch); ``state`` (the checkpointed state, saved and loaded), ``scores`` (``Scores`` of a
  complete group: the task's rewards, by ``asyncrl.tasks.scoring``, and their advantages), ``validation``,
  ``outbox``, ``recovery``.

Typical wiring (the controller's loop)::

    gate = StalenessGate(version_source, eta=2, groups_per_step=B)
    buffer = GroupBuffer(gate, group_size=G)
    assembler = BatchAssembler(gate, buffer, keep=lambda g: not g.scored().zero_variance)

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
