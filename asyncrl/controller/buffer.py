"""Group buffer: assembly of prompt groups from samples that stream back out of order.

Owns: every admitted group that the learner has not consumed yet (and that was not filtered), from
admission to completion; which worker holds which group and until when
(assignment deadlines from an injected clock); exactly-once accounting of sample results; the
completion order; the group/sample id scheme (``versions.make_group_id`` / ``make_sample_id``).

Must never: decide admission (the ``StalenessGate`` does), judge or batch groups (the
``BatchAssembler`` does), look inside payloads, read the wall clock, or import outside the
standard library. Not thread-safe: one controller event loop calls it.

Invariants:
- A group is in exactly one state: PENDING (admitted, no worker), ASSIGNED (one worker holds all
  its unfinished members) or COMPLETE (all ``group_size`` members returned). It keeps its id,
  sequence number and admission version through any number of reissues.
- A result is accepted at most once per sample id, and only from the worker that currently holds
  the group. Anything else is dropped and counted: DUPLICATE (that sample already returned), LATE
  (the group was taken from that worker, e.g. after a reissue), RETIRED (the group was already
  consumed or filtered), UNKNOWN (an id this buffer never issued).
- ``assign`` hands a group only to a worker whose weights version is at least the group's
  admission version, so every token of a group is at least as new as its admission (the gate's
  staleness guarantee depends on this; a result that breaks it raises ``ValueError``).
- Members that already returned survive a reissue: only the unfinished ones are regenerated.
- A group reissued because its worker returned a rejected sample (``reassign_group(avoid_s=...)``) is not
  handed back to that worker within ``avoid_s``: a bad worker cannot take the same group in a tight loop.
- Every transition is mirrored on the gate (started, reissued, finished), so the gate's
  issued/running/finished counters equal the number of PENDING/ASSIGNED/COMPLETE groups here.
- Checkpoints: ``state_dict`` holds groups with their payloads as given (the controller must pass
  payloads its checkpoint writer can serialise). After ``load_state_dict`` no group is ASSIGNED:
  the workers of the previous process are gone, so their groups are PENDING again.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.controller.gate import StalenessGate
from asyncrl.controller.scores import Scores
from asyncrl.controller.versions import Clock, make_group_id, make_sample_id, parse_sample_id


class GroupState(enum.Enum):
    PENDING = "pending"
    ASSIGNED = "assigned"
    COMPLETE = "complete"


class ResultStatus(enum.Enum):
    ACCEPTED = "accepted"
    """Recorded; the group still waits for other members."""
    COMPLETED = "completed"
    """Recorded, and it was the group's last missing member: the group is COMPLETE."""
    DUPLICATE = "duplicate"
    LATE = "late"
    RETIRED = "retired"
    UNKNOWN = "unknown"

    @property
    def accepted(self) -> bool:
        return self in (ResultStatus.ACCEPTED, ResultStatus.COMPLETED)


@dataclass(frozen=True, slots=True)
class SampleResult:
    """One returned member of a group."""

    sample_id: str
    index: int
    payload: Any
    min_version: int
    """Smallest behaviour version among the sample's tokens."""
    worker_id: str


@dataclass(frozen=True, slots=True)
class Assignment:
    """A group handed to a worker: generate ``sample_ids`` (its unfinished members) for ``meta``."""

    group_id: str
    worker_id: str
    sample_ids: tuple[str, ...]
    meta: Any
    admit_version: int
    deadline_s: float


@dataclass(slots=True)
class _Group:
    seq: int
    group_id: str
    admit_version: int
    meta: Any
    size: int
    state: GroupState = GroupState.PENDING
    results: dict[int, SampleResult] = field(default_factory=dict)
    worker_id: str | None = None
    deadline_s: float = 0.0
    completion: int = -1
    scores: Scores | None = None  # set once, when the group completes (GroupBuffer.score)
    avoid: str | None = None  # the worker that just returned it rejected: not handed back to it ...
    avoid_until: float = 0.0  # ... before this clock time (another worker may take it meanwhile)


@dataclass(frozen=True, slots=True)
class CompleteGroup:
    """Read-only snapshot of a COMPLETE group, with its ``Scores`` once the controller scored it."""

    group_id: str
    seq: int
    admit_version: int
    meta: Any
    samples: tuple[SampleResult, ...]
    completion: int
    scores: Scores | None

    def scored(self) -> Scores:
        if self.scores is None:
            raise ValueError(f"group {self.group_id} was never scored (ControllerCore scores a group when it completes)")
        return self.scores

    @property
    def sample_ids(self) -> tuple[str, ...]:
        return tuple(s.sample_id for s in self.samples)

    @property
    def min_version(self) -> int:
        return min(s.min_version for s in self.samples)


class GroupBuffer:
    """Tracks admitted groups until the learner consumes them.

    Args:
        gate: the staleness gate whose counters this buffer keeps in step.
        group_size: ``G``, members per group.
        clock: monotonic seconds, for assignment deadlines.
        assignment_timeout_s: how long a worker may hold a group, counted from the assignment,
            before ``overdue`` lists it. Neither heartbeats nor partial results extend it: a worker
            that is alive but never finishes cannot hold a group forever.
    """

    def __init__(
        self,
        gate: StalenessGate,
        *,
        group_size: int,
        clock: Clock = time.monotonic,
        assignment_timeout_s: float = 600.0,
    ) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if assignment_timeout_s <= 0:
            raise ValueError(f"assignment_timeout_s must be > 0, got {assignment_timeout_s}")
        self.gate = gate
        self.group_size = group_size
        self.clock = clock
        self.assignment_timeout_s = assignment_timeout_s
        self._groups: dict[str, _Group] = {}  # live groups, in admission (seq) order
        self._next_seq = 0
        self._next_completion = 0
        self.stats: dict[str, int] = {s.value: 0 for s in ResultStatus}

    # ---------------------------------------------------------------- admission
    def admit(self, make_meta: Callable[[], Any], n: int = 1) -> list[str]:
        """Ask the gate for ``n`` groups and add the admitted ones, oldest first.

        ``make_meta`` (for example ``cursor.next``) is called once per *admitted* group only, so a
        dataset cursor advances exactly as far as admission does. Returns the new group ids; fewer
        than ``n`` (possibly none) when the gate is shut.
        """
        granted, version = self.gate.admit(n)
        return [self._add(make_meta(), version) for _ in range(granted)]

    def _add(self, meta: Any, admit_version: int) -> str:
        group_id = make_group_id(self._next_seq)
        self._groups[group_id] = _Group(self._next_seq, group_id, admit_version, meta, self.group_size)
        self._next_seq += 1
        return group_id

    # --------------------------------------------------------------- assignment
    def assign(self, worker_id: str, *, worker_version: int, max_groups: int = 1) -> list[Assignment]:
        """Hand up to ``max_groups`` PENDING groups to ``worker_id``, oldest first.

        Only groups admitted at ``<= worker_version`` qualify: a worker with older weights must
        fetch the current version first (this keeps every token at least as new as admission).
        """
        out: list[Assignment] = []
        for group in self._groups.values():
            if len(out) >= max_groups:
                break
            if group.state is GroupState.PENDING and group.admit_version <= worker_version:
                if group.avoid == worker_id and self.clock() < group.avoid_until:
                    continue  # it returned this group rejected a moment ago: another worker first
                group.state = GroupState.ASSIGNED
                group.avoid = None
                group.worker_id = worker_id
                group.deadline_s = self.clock() + self.assignment_timeout_s
                self.gate.on_started()
                out.append(self._assignment(group))
        return out

    def _assignment(self, group: _Group) -> Assignment:
        assert group.worker_id is not None
        missing = tuple(
            make_sample_id(group.group_id, i) for i in range(group.size) if i not in group.results
        )
        return Assignment(
            group.group_id, group.worker_id, missing, group.meta, group.admit_version, group.deadline_s
        )

    def assignments(self, worker_id: str | None = None) -> list[Assignment]:
        """Groups currently held by ``worker_id`` (by any worker when ``None``), oldest first."""
        return [
            self._assignment(g)
            for g in self._groups.values()
            if g.state is GroupState.ASSIGNED and (worker_id is None or g.worker_id == worker_id)
        ]

    def overdue(self, now: float | None = None) -> list[Assignment]:
        """Assignments whose deadline has passed: candidates for ``reassign_from``/``reassign_group``."""
        t = self.clock() if now is None else now
        return [a for a in self.assignments() if a.deadline_s < t]

    def reassign_from(self, worker_id: str) -> list[str]:
        """Take every group from ``worker_id`` (dead or overdue) and put it back to PENDING.

        Returns the ids of the samples to regenerate (members that already returned are kept).
        Results that the worker sends afterwards are dropped as LATE.
        """
        out: list[str] = []
        for g in list(self._groups.values()):
            if g.state is GroupState.ASSIGNED and g.worker_id == worker_id:
                out.extend(self.reassign_group(g.group_id))
        return out

    def reassign_group(self, group_id: str, *, avoid_s: float = 0.0) -> list[str]:
        """Put one ASSIGNED group back to PENDING; returns its unfinished sample ids.

        ``avoid_s`` > 0: the worker that held it (it returned a sample that was rejected) is not handed it
        again for that many seconds, so another worker gets it first."""
        g = self._groups[group_id]
        if g.state is not GroupState.ASSIGNED:
            raise ValueError(f"group {group_id} is {g.state.value}, only an assigned group can be reissued")
        missing = list(self._assignment(g).sample_ids)
        if avoid_s > 0:
            g.avoid, g.avoid_until = g.worker_id, self.clock() + avoid_s
        g.state, g.worker_id = GroupState.PENDING, None
        self.gate.on_reissued()
        return missing

    # ------------------------------------------------------------------ results
    def on_result(self, sample_id: str, *, worker_id: str, payload: Any, min_version: int) -> ResultStatus:
        """Record one returned sample. ``min_version`` is the oldest behaviour version among its tokens."""
        status = self.classify(sample_id, worker_id)
        if status is not ResultStatus.ACCEPTED:
            self.stats[status.value] += 1
            return status
        parsed = parse_sample_id(sample_id)
        assert parsed is not None
        g = self._groups[make_group_id(parsed[0])]
        if min_version < g.admit_version:
            raise ValueError(
                f"worker {worker_id!r} returned {sample_id} with tokens of version {min_version}, but the "
                f"group was admitted at version {g.admit_version}; a worker must report the version of "
                "the weights it really holds when it asks for work"
            )
        g.results[parsed[1]] = SampleResult(sample_id, parsed[1], payload, min_version, worker_id)
        if len(g.results) < g.size:
            self.stats[ResultStatus.ACCEPTED.value] += 1
            return ResultStatus.ACCEPTED
        g.state, g.worker_id = GroupState.COMPLETE, None
        g.completion = self._next_completion
        self._next_completion += 1
        self.gate.on_group_finished()
        self.stats[ResultStatus.COMPLETED.value] += 1
        return ResultStatus.COMPLETED

    def admission_of(self, sample_id: str) -> tuple[str, Any, int] | None:
        """(group id, metadata, admission version) of the live group ``sample_id`` belongs to, else None."""
        parsed = parse_sample_id(sample_id)
        g = None if parsed is None else self._groups.get(make_group_id(parsed[0]))
        return None if g is None else (g.group_id, g.meta, g.admit_version)

    def classify(self, sample_id: str, worker_id: str) -> ResultStatus:
        """What ``on_result`` would do with this result now (ACCEPTED or the reason it is dropped); no change."""
        parsed = parse_sample_id(sample_id)
        if parsed is None:
            return ResultStatus.UNKNOWN
        seq, index = parsed
        g = self._groups.get(make_group_id(seq))
        if g is None:
            return ResultStatus.RETIRED if seq < self._next_seq else ResultStatus.UNKNOWN
        if index >= g.size:
            return ResultStatus.UNKNOWN
        if index in g.results:
            return ResultStatus.DUPLICATE
        if g.state is not GroupState.ASSIGNED or g.worker_id != worker_id:
            return ResultStatus.LATE
        return ResultStatus.ACCEPTED

    # ------------------------------------------------------------------ reading
    def live(self) -> list[tuple[str, int, GroupState]]:
        """``(group_id, admit_version, state)`` of every live group, in admission order."""
        return [(g.group_id, g.admit_version, g.state) for g in self._groups.values()]

    def complete_groups(self) -> list[CompleteGroup]:
        """COMPLETE groups in completion order."""
        done = [g for g in self._groups.values() if g.state is GroupState.COMPLETE]
        return [self._view(g) for g in sorted(done, key=lambda g: g.completion)]

    def get(self, group_id: str) -> CompleteGroup:
        g = self._groups[group_id]
        if g.state is not GroupState.COMPLETE:
            raise ValueError(f"group {group_id} is {g.state.value}, not complete")
        return self._view(g)

    def score(self, group_id: str, scores: Scores) -> None:
        """Attach a live group's scores (kept in checkpoints)."""
        self._groups[group_id].scores = scores

    @staticmethod
    def _view(g: _Group) -> CompleteGroup:
        samples = tuple(g.results[i] for i in sorted(g.results))
        return CompleteGroup(g.group_id, g.seq, g.admit_version, g.meta, samples, g.completion, g.scores)

    def retire(self, group_ids: list[str]) -> None:
        """Remove COMPLETE groups (the assembler calls this when it consumes or filters them; the
        gate transition is the assembler's, since only it knows which of the two happened)."""
        for gid in group_ids:
            g = self._groups[gid]
            if g.state is not GroupState.COMPLETE:
                raise AssertionError(f"retiring group {gid} in state {g.state.value}")
            del self._groups[gid]

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in GroupState}
        for g in self._groups.values():
            out[g.state.value] += 1
        return out

    # --------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        groups = []
        for g in self._groups.values():
            groups.append(
                {
                    "seq": g.seq,
                    "admit_version": g.admit_version,
                    "meta": g.meta,
                    "complete": g.state is GroupState.COMPLETE,
                    "completion": g.completion,
                    "scores": None if g.scores is None else g.scores.state(),
                    "results": [
                        [r.index, r.payload, r.min_version, r.worker_id]
                        for r in (g.results[i] for i in sorted(g.results))
                    ],
                }
            )
        return {
            "group_size": self.group_size,
            "next_seq": self._next_seq,
            "next_completion": self._next_completion,
            "groups": groups,
            "stats": dict(self.stats),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore groups; ASSIGNED groups come back PENDING (their workers belonged to the old process)."""
        if state["group_size"] != self.group_size:
            raise ValueError(
                f"checkpoint was taken with group_size={state['group_size']} but the config says "
                f"{self.group_size}; resume with the same rollout.group_size"
            )
        self._groups = {}
        for item in state["groups"]:
            g = _Group(
                int(item["seq"]),
                make_group_id(int(item["seq"])),
                int(item["admit_version"]),
                item["meta"],
                self.group_size,
            )
            for index, payload, min_version, worker_id in item["results"]:
                sid = make_sample_id(g.group_id, int(index))
                g.results[int(index)] = SampleResult(sid, int(index), payload, int(min_version), worker_id)
            g.state = GroupState.COMPLETE if item["complete"] else GroupState.PENDING
            g.completion = int(item["completion"])
            g.scores = Scores.from_state(item.get("scores", item.get("extra")))  # "extra": states of older runs
            self._groups[g.group_id] = g
        self._next_seq = int(state["next_seq"])
        self._next_completion = int(state["next_completion"])
        self.stats = {s.value: int(state["stats"].get(s.value, 0)) for s in ResultStatus}
