"""Batch assembly: complete groups -> learner batch ``k``, with dynamic sampling and the staleness check.

Owns: the choice of which complete groups form learner batch ``k`` (``k`` = batches taken so far),
the dynamic-sampling decision (a predicate passed in; the advantage math lives in ``asyncrl.algo``),
the record of which batch consumed which sample ids, and the final check that no consumed token
is more than ``eta`` versions stale.

Must never: compute rewards or advantages, import torch, discard a group for being stale, or
read a clock. Not thread-safe: one controller event loop calls it.

Invariants and the selection rule:
- Every live group has a deadline ``admit_version + eta``: the last batch that may consume it.
  Batch ``k`` is the ``B`` complete, kept groups with the earliest deadlines (ties: completion
  order), provided that afterwards, for every later ``k'``, the groups left with deadline ``<= k'``
  fit in the ``k' - k`` batches before it. If the groups that must go now are still generating,
  the batch waits (``try_assemble`` returns ``None``). The gate's admission rule guarantees that
  waiting always ends once those groups complete (see ``gate.py``); this rule lets later groups
  overtake slow ones whenever the slack allows it, and never otherwise.
- docs/algorithms.md §3.4 drops tokens with ``eta > eta_max``; here none can exist, because the gate
  paces admission instead. A consumed sample with ``k - min_version > eta`` (or a negative
  staleness, which means versions and batch indices disagree) is an internal error and raises
  ``AssertionError``.
- Dynamic sampling (docs/algorithms.md §3.2): a complete group for which ``keep(group)`` is false is
  removed and its gate slot freed (``on_filtered``), so the gate admits a replacement. With
  ``max_filtered_per_step`` set, once that many groups were filtered for the current batch the
  predicate is no longer applied until the batch is formed (verl's ``max_num_gen_batches``
  raises instead; [R] here the step goes ahead with unfiltered groups and says how many).
- Each batch holds exactly ``groups_per_step`` groups; a sample id is consumed at most once.
- A batch is retained (and checkpointed) until the learner's version passes it
  (``release_through``), so a learner resumed from an older checkpoint than the controller's gets
  the very same batch again (``retained_batch``) and no rollout is lost.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncrl.controller.buffer import CompleteGroup, GroupBuffer, SampleResult
from asyncrl.controller.gate import StalenessGate
from asyncrl.controller.scores import Scores
from asyncrl.controller.versions import make_sample_id

KeepFn = Callable[[CompleteGroup], bool]
"""Dynamic-sampling predicate: ``True`` keeps the group for training."""


@dataclass(frozen=True, slots=True)
class Batch:
    """Learner batch ``step``."""

    step: int
    groups: tuple[CompleteGroup, ...]
    """Exactly ``groups_per_step`` groups, earliest deadline first."""
    filtered: tuple[CompleteGroup, ...]
    """Groups dropped by dynamic sampling while this batch was being formed (log them too)."""
    unfiltered: int
    """Groups in ``groups`` kept only because ``max_filtered_per_step`` was reached."""
    max_staleness: int
    """``max over samples of step - min_version`` (token staleness, <= eta)."""

    @property
    def sample_ids(self) -> tuple[str, ...]:
        return tuple(sid for g in self.groups for sid in g.sample_ids)


class BatchAssembler:
    """Forms learner batches from a ``GroupBuffer`` under the gate's staleness bound.

    Args:
        gate: the staleness gate (gives ``eta``, ``groups_per_step`` and the batch index).
        buffer: the group buffer fed by workers.
        keep: dynamic-sampling predicate; ``None`` keeps every group.
        max_filtered_per_step: stop filtering for the current batch after this many drops
            (``None``: no limit).
    """

    def __init__(
        self,
        gate: StalenessGate,
        buffer: GroupBuffer,
        *,
        keep: KeepFn | None = None,
        max_filtered_per_step: int | None = None,
    ) -> None:
        if buffer.gate is not gate:
            raise ValueError("the assembler and the buffer must share one StalenessGate")
        if max_filtered_per_step is not None and max_filtered_per_step < 0:
            raise ValueError(f"max_filtered_per_step must be >= 0 or None, got {max_filtered_per_step}")
        self.gate = gate
        self.buffer = buffer
        self.keep = keep
        self.max_filtered_per_step = max_filtered_per_step
        self._judged: dict[str, bool] = {}  # group_id -> kept only because the filter budget ran out
        self._filtered: list[CompleteGroup] = []  # filtered since the last batch
        self._consumed_by: dict[str, int] = {}
        self._retained: dict[int, Batch] = {}  # emitted batches the learner has not finished
        self._filtered_this_step = 0

    @property
    def next_step(self) -> int:
        """Index ``k`` of the next batch (= batches consumed so far)."""
        return self.gate.consumed_batches

    def deadline(self, admit_version: int) -> int:
        """Last batch index that may consume a group admitted at ``admit_version``."""
        return admit_version + self.gate.eta

    # ------------------------------------------------------------------ filter
    def _judge(self) -> None:
        """Apply the predicate once to every newly complete group, in completion order."""
        for group in self.buffer.complete_groups():
            if group.group_id in self._judged:
                continue
            budget_left = (
                self.max_filtered_per_step is None or self._filtered_this_step < self.max_filtered_per_step
            )
            if self.keep is None:
                self._judged[group.group_id] = False
            elif budget_left:
                if self.keep(group):
                    self._judged[group.group_id] = False
                else:
                    self.buffer.retire([group.group_id])
                    self.gate.on_filtered()
                    self._filtered.append(group)
                    self._filtered_this_step += 1
            else:
                self._judged[group.group_id] = True

    # ---------------------------------------------------------------- assembly
    def try_assemble(self) -> Batch | None:
        """Form batch ``next_step`` if the staleness schedule allows it now, else ``None``."""
        self._judge()
        k = self.next_step
        B = self.gate.groups_per_step
        live = self.buffer.live()
        deadlines = sorted(self.deadline(v) for _, v, _ in live)
        if deadlines and deadlines[0] < k:
            raise AssertionError(
                f"a live group has deadline {deadlines[0]} but the learner is already at batch {k}"
            )
        if not _feasible(deadlines, deadlines[:B], k, B):
            # Not even all groups complete could meet their deadlines: waiting would never end.
            raise AssertionError(f"staleness schedule broken at batch {k}: live deadlines {deadlines}")
        candidates = sorted(
            (g for g in self.buffer.complete_groups() if g.group_id in self._judged),
            key=lambda g: (self.deadline(g.admit_version), g.completion),
        )
        if len(candidates) < B:
            return None
        chosen = candidates[:B]
        chosen_deadlines = sorted(self.deadline(g.admit_version) for g in chosen)
        if not _feasible(deadlines, chosen_deadlines, k, B):
            return None
        return self._emit(k, chosen)

    def _emit(self, k: int, chosen: list[CompleteGroup]) -> Batch:
        max_staleness = -1
        for g in chosen:
            for s in g.samples:
                staleness = k - s.min_version
                if not 0 <= staleness <= self.gate.eta:
                    raise AssertionError(
                        f"sample {s.sample_id} would be consumed at batch {k} with behaviour version "
                        f"{s.min_version} (staleness {staleness}, eta {self.gate.eta})"
                    )
                if s.sample_id in self._consumed_by:
                    raise AssertionError(f"sample {s.sample_id} consumed twice")
                max_staleness = max(max_staleness, staleness)
        ids = [g.group_id for g in chosen]
        unfiltered = sum(self._judged.pop(gid) for gid in ids)
        self.buffer.retire(ids)
        self.gate.on_consumed(len(chosen))
        for g in chosen:
            for sid in g.sample_ids:
                self._consumed_by[sid] = k
        batch = Batch(k, tuple(chosen), tuple(self._filtered), unfiltered, max_staleness)
        self._filtered = []
        self._filtered_this_step = 0
        self._retained[k] = batch
        self.release_through(self.gate.version)
        return batch

    # ------------------------------------------------------- retained batches
    def release_through(self, version: int) -> None:
        """The learner reached ``version``: batches ``< version`` are trained and need not be kept."""
        for step in [k for k in self._retained if k < version]:
            del self._retained[step]

    def retained_steps(self) -> list[int]:
        """The steps of the batches emitted and not yet trained on (a resuming learner may ask for them)."""
        return sorted(self._retained)

    def retained_batch(self, step: int) -> Batch:
        """Batch ``step`` again, for a learner that resumed from a checkpoint taken before it
        trained on it (the controller's checkpoint may be newer than the learner's)."""
        if step not in self._retained:
            raise ValueError(
                f"batch {step} is not retained (retained: {sorted(self._retained)}); the controller "
                "checkpoint is older than the learner's or the batch was already released"
            )
        return self._retained[step]

    # -------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Judgements of complete groups, filtered groups not yet handed over, and batches the
        learner has not finished (payloads as given). The consumed-by index is not included:
        the trajectory log is its durable record."""
        return {
            "judged": dict(self._judged),
            "filtered_this_step": self._filtered_this_step,
            "filtered": [_group_state(g) for g in self._filtered],
            "retained": [
                {
                    "step": b.step,
                    "groups": [_group_state(g) for g in b.groups],
                    "filtered": [_group_state(g) for g in b.filtered],
                    "unfiltered": b.unfiltered,
                    "max_staleness": b.max_staleness,
                }
                for b in self._retained.values()
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._judged = {str(k): bool(v) for k, v in state["judged"].items()}
        self._filtered = [_group_from_state(item) for item in state["filtered"]]
        self._filtered_this_step = int(state["filtered_this_step"])
        self._retained = {}
        for item in state["retained"]:
            batch = Batch(
                int(item["step"]),
                tuple(_group_from_state(g) for g in item["groups"]),
                tuple(_group_from_state(g) for g in item["filtered"]),
                int(item["unfiltered"]),
                int(item["max_staleness"]),
            )
            self._retained[batch.step] = batch
        self._consumed_by = {sid: b.step for b in self._retained.values() for sid in b.sample_ids}


def _group_state(g: CompleteGroup) -> dict[str, Any]:
    return {
        "group_id": g.group_id,
        "seq": g.seq,
        "admit_version": g.admit_version,
        "meta": g.meta,
        "completion": g.completion,
        "scores": None if g.scores is None else g.scores.state(),
        "samples": [[s.index, s.payload, s.min_version, s.worker_id] for s in g.samples],
    }


def _group_from_state(item: dict[str, Any]) -> CompleteGroup:
    gid = item["group_id"]
    samples = tuple(
        SampleResult(make_sample_id(gid, int(i)), int(i), payload, int(mv), worker)
        for i, payload, mv, worker in item["samples"]
    )
    return CompleteGroup(
        gid,
        int(item["seq"]),
        int(item["admit_version"]),
        item["meta"],
        samples,
        int(item["completion"]),
        Scores.from_state(item.get("scores", item.get("extra"))),  # "extra": states of older runs
    )


def _feasible(live_deadlines: list[int], chosen_deadlines: list[int], k: int, B: int) -> bool:
    """After taking ``chosen`` as batch ``k``, can every remaining group still meet its deadline?

    For each deadline ``d`` among live groups: the groups with deadline ``<= d`` that remain must
    fit in batches ``k+1 .. d``, i.e. ``live(<= d) - chosen(<= d) <= (d - k) * B``. Both lists are
    sorted ascending; ``chosen`` is a sub-multiset of ``live``.
    """
    j = 0
    for i, d in enumerate(live_deadlines):
        if i + 1 < len(live_deadlines) and live_deadlines[i + 1] == d:
            continue  # evaluate once per distinct deadline, with all groups <= d counted
        while j < len(chosen_deadlines) and chosen_deadlines[j] <= d:
            j += 1
        if (i + 1) - j > (d - k) * B:
            return False
    return True
