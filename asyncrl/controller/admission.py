"""The admission step: how the controller answers one work request, in one function.

Owns: ``admit_and_assign``, the rule that turns a worker's free credits into groups admitted under the
staleness gate and assigned to that worker. ``ControllerCore._work`` calls it for every ``WorkRequest``
and the scale simulator (``asyncrl/sim``) calls it for every simulated one, so the system and its model
admit work the same way.

Must never: read a clock, touch a socket, build a protocol message, or import outside the standard
library and the controller's systems logic (``gate``, ``buffer``). Not thread-safe: one event loop calls it.

Invariants:
- A request for ``credits`` samples asks for ``credits // group_size`` whole groups; fewer credits than
  one group admit nothing and assign nothing.
- Groups already PENDING (admitted, no worker yet) count towards the request, so repeated requests do
  not admit groups nobody can take; what is admitted is further capped by ``StalenessGate.capacity()``.
- Only the gate decides admission and only ``GroupBuffer.assign`` decides which pending group a worker's
  weights may serve (admission version <= the worker's version); this function only sizes the request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncrl.controller.buffer import Assignment, GroupBuffer


def admit_and_assign(buffer: GroupBuffer, worker_id: str, *, credits: int, worker_version: int,
                     make_meta: Callable[[], Any]) -> list[Assignment]:
    """Admit what the gate allows for a request of ``credits`` samples and hand ``worker_id`` up to
    ``credits // group_size`` pending groups whose admission version is ``<= worker_version``.

    ``make_meta`` is called once per admitted group (the controller's dataset cursor). Returns the
    assignments, oldest group first; an empty list is a NoWork.
    """
    n_groups = credits // buffer.group_size
    if n_groups <= 0:
        return []
    gate = buffer.gate
    pending = gate.counts().issued  # == the buffer's PENDING groups (GroupBuffer keeps the gate in step)
    want = min(max(0, n_groups - pending), gate.capacity())
    if want:
        buffer.admit(make_meta, want)
    if not gate.counts().issued:
        return []
    return buffer.assign(worker_id, worker_version=worker_version, max_groups=n_groups)
