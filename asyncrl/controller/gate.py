"""Staleness gate: admission control for prompt groups (AReaL's rule, docs/architecture.md §1 step 1).

Owns: the group counters (issued, running, finished, consumed; filtered groups leave the
count) and the admission rule

    admit a group only while  issued + running + finished + consumed  <  (eta + version + 1) * B

with ``B = groups_per_step`` and ``version`` read from an injected version source. This is
``areal/infra/staleness_manager.py``'s ``(max_staleness + version + 1) * batch - (accepted + running)``,
counted in groups.

Must never: discard a group for being stale (the gate paces admission, it does not drop work), read
a clock, spawn anything, or import outside the standard library. Not thread-safe: the controller
calls it from one event loop (the version source may be written by another thread).

Invariants (why nothing consumed is more than ``eta`` versions stale):
- Consumption frees no slot. A consumed group keeps counting, so after ``c`` learner batches at
  most ``(eta + version + 1 - c) * B`` groups are admitted and not yet consumed. Only groups that
  never reach the learner (filtered by dynamic sampling) leave the count.
- Staleness counts queue time: a group is charged from admission, and its deadline is fixed then:
  ``admit_version + eta``. The admission version is recorded with the group (``admit()`` returns it)
  and ``GroupBuffer.assign`` hands a group only to a worker whose weights are at least that
  version, so every token of the group has ``version >= admit_version``.
- With the rule above, the groups whose deadline is ``<= k`` never outnumber the batches left
  before ``k``; ``BatchAssembler`` picks earliest deadlines first, so batch ``k`` never holds a
  token older than ``k - eta``. eta = 0 is the synchronous mode: exactly ``B`` groups per version.
- ``version <= consumed // B`` always (the learner cannot be at version ``v`` without having taken
  ``v`` batches); a violation means the learner and the controller were resumed from different
  checkpoints and is raised as an ``AssertionError``.

Worked example (eta = 1, B = 2, so the limit is ``(version + 2) * 2``)::

    version 0: limit 4
      four work requests       -> g0 g1 g2 g3 admitted (issued 4, capacity 0)
      a fifth request          -> admit() == (0, version): the worker waits, nothing is generated early
      g0..g3 start             -> running 4
      g1, g3 finish            -> finished 2, running 2
      learner takes batch 0    -> {g1, g3}: consumed 2; counted is still 4 so capacity stays 0
                                  (taking a batch frees no slot: nothing is "born stale")
    version 1: limit 6         -> capacity 2: g4, g5 admitted at version 1 (deadline 2)
      g0, g2 were admitted at version 0 (deadline 1): batch 1 is {g0, g2} even if g4 finishes first;
      their staleness at batch 1 is 1 - 0 = 1 = eta, never more.
      the worker running g2 dies -> on_reissued(): g2 goes back to issued with the same slot and the
                                  same deadline; no extra group is admitted in its place
      dynamic sampling drops g5 -> on_filtered(): g5 leaves the count, capacity 1, g6 is admitted
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from asyncrl.controller.versions import VersionLike, version_reader


@dataclass(frozen=True, slots=True)
class GateCounts:
    """Snapshot of the gate's counters (all in groups)."""

    issued: int
    """Admitted, waiting for a worker (includes groups put back by a reissue)."""
    running: int
    """Handed to a worker and not yet complete."""
    finished: int
    """Complete (all members returned), waiting for a learner batch."""
    consumed: int
    """Taken by the learner in a batch."""
    filtered: int
    """Complete but dropped by dynamic sampling; no longer counted."""
    reissued: int
    """Reissue events (a group can be reissued more than once)."""
    admitted: int
    """Groups ever admitted."""

    @property
    def counted(self) -> int:
        """The left-hand side of the admission rule."""
        return self.issued + self.running + self.finished + self.consumed


class StalenessGate:
    """Admits prompt groups so that no consumed token is more than ``eta`` versions stale.

    Args:
        version_source: the learner version (an object with ``.version`` or a callable).
        eta: maximum staleness in versions; 0 is the synchronous mode.
        groups_per_step: ``B``, groups the learner consumes per step.
        max_inflight_groups: optional concurrency cap on issued + running groups (AReaL's
            ``max_concurrent_rollouts``); ``None`` means the staleness rule alone limits admission.
    """

    def __init__(
        self,
        version_source: VersionLike,
        *,
        eta: int,
        groups_per_step: int,
        max_inflight_groups: int | None = None,
    ) -> None:
        if isinstance(eta, bool) or not isinstance(eta, int) or eta < 0:
            raise ValueError(f"rollout.eta must be an integer >= 0 (0 = synchronous), got {eta!r}")
        if isinstance(groups_per_step, bool) or not isinstance(groups_per_step, int) or groups_per_step < 1:
            raise ValueError(f"groups_per_step must be an integer >= 1, got {groups_per_step!r}")
        if max_inflight_groups is not None and max_inflight_groups < 1:
            raise ValueError(
                f"max_inflight_groups must be >= 1 or None (no cap), got {max_inflight_groups!r}"
            )
        self._read_version = version_reader(version_source)
        self.eta = eta
        self.groups_per_step = groups_per_step
        self.max_inflight_groups = max_inflight_groups
        self._issued = 0
        self._running = 0
        self._finished = 0
        self._consumed = 0
        self._filtered = 0
        self._reissued = 0
        self._admitted = 0

    # ------------------------------------------------------------------ reading
    @property
    def version(self) -> int:
        """Current learner version, checked against the batches already consumed."""
        version = self._read_version()
        if version < 0 or version > self.consumed_batches:
            raise AssertionError(
                f"version source reports {version} but the learner has taken {self.consumed_batches} "
                "batches; the learner and the controller must resume from the same checkpoint"
            )
        return version

    @property
    def consumed_batches(self) -> int:
        """Learner batches taken so far; every batch holds exactly ``groups_per_step`` groups."""
        return self._consumed // self.groups_per_step

    def limit(self, version: int | None = None) -> int:
        """``(eta + version + 1) * groups_per_step``: the most groups ever counted at ``version``."""
        v = self.version if version is None else version
        return (self.eta + v + 1) * self.groups_per_step

    def capacity(self) -> int:
        """Groups that may be admitted now (never negative)."""
        return self._capacity_at(self.version)

    def _capacity_at(self, version: int) -> int:
        room = self.limit(version) - self.counts().counted
        if self.max_inflight_groups is not None:
            room = min(room, self.max_inflight_groups - self._issued - self._running)
        return max(0, room)

    def counts(self) -> GateCounts:
        return GateCounts(
            issued=self._issued,
            running=self._running,
            finished=self._finished,
            consumed=self._consumed,
            filtered=self._filtered,
            reissued=self._reissued,
            admitted=self._admitted,
        )

    # ---------------------------------------------------------------- admission
    def admit(self, n: int = 1) -> tuple[int, int]:
        """Admit up to ``n`` groups; returns ``(admitted, version)``.

        ``version`` is the one the rule was evaluated at: record it as the groups' admission
        version (``GroupBuffer.admit`` does) so that their deadline is ``version + eta``.
        """
        if n < 0:
            raise ValueError(f"cannot admit a negative number of groups ({n})")
        version = self.version
        granted = min(n, self._capacity_at(version))
        self._issued += granted
        self._admitted += granted
        return granted, version

    # -------------------------------------------------------------- transitions
    def on_started(self, n: int = 1) -> None:
        """Issued -> running: a worker took the group."""
        self._move("issued", "running", n)

    def on_reissued(self, n: int = 1) -> None:
        """Running -> issued: the worker died or timed out; the group keeps its slot and deadline."""
        self._move("running", "issued", n)
        self._reissued += n

    def on_group_finished(self, n: int = 1) -> None:
        """Running -> finished: every member of the group has returned."""
        self._move("running", "finished", n)

    def on_consumed(self, n: int) -> None:
        """Finished -> consumed: the learner took ``n`` groups in batches (still counted)."""
        self._move("finished", "consumed", n)

    def on_filtered(self, n: int = 1) -> None:
        """Finished -> gone: dynamic sampling dropped the group, its slot is free again."""
        self._move("finished", None, n)
        self._filtered += n

    def _move(self, src: str, dst: str | None, n: int) -> None:
        if n < 0:
            raise AssertionError(f"negative transition count {n}")
        have = getattr(self, f"_{src}")
        if have < n:
            raise AssertionError(f"gate bookkeeping: moving {n} groups out of {src} but only {have} there")
        setattr(self, f"_{src}", have - n)
        if dst is not None:
            setattr(self, f"_{dst}", getattr(self, f"_{dst}") + n)

    # -------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Plain-int counters plus the settings they were counted under."""
        state = asdict(self.counts())
        state.update(eta=self.eta, groups_per_step=self.groups_per_step)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counters. Groups that were running belong to workers of the previous process,
        so they come back as issued, to be reissued (``GroupBuffer.load_state_dict`` does the same)."""
        if state["groups_per_step"] != self.groups_per_step:
            raise ValueError(
                f"checkpoint was taken with groups_per_step={state['groups_per_step']} but the config "
                f"says {self.groups_per_step}; resume with the same rollout settings"
            )
        if self.eta < state["eta"]:
            raise ValueError(
                f"checkpoint was taken with eta={state['eta']}; resuming with a smaller eta={self.eta} "
                "would leave admitted groups past their deadline. Resume with eta >= "
                f"{state['eta']}, or start a new run"
            )
        self._issued = int(state["issued"]) + int(state["running"])
        self._running = 0
        self._finished = int(state["finished"])
        self._consumed = int(state["consumed"])
        self._filtered = int(state["filtered"])
        self._reissued = int(state["reissued"])
        self._admitted = int(state["admitted"])
