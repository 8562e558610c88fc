"""Workers whose samples keep failing validation: the back-off after each rejection, and the quarantine.

Owns: ``Quarantine``: per worker, its rejected samples in a row (an accepted sample resets the count; a
sample that is only too old for its group never counts, ``asyncrl.controller.validation``), the back-off
before it may have work again (``REJECT_BACKOFF_S``, doubled per rejection in a row, at most
``REJECT_BACKOFF_MAX_S``), and the workers quarantined after ``rollout.quarantine_after`` rejections in a row
(worker id -> its reply address and the reason); the wording of what a quarantined worker is told.
Never: reissues groups, logs, counts metrics or builds a protocol message (``ControllerCore`` does, with what
this returns); reads a clock (times are passed in); imports beyond the standard library and
``protocols.values`` (where the ``Shutdown`` wording a worker recognises is defined).

Invariants: a quarantined worker is never handed work again by this controller, under that id, whatever it
sends (its work requests and heartbeats are answered with the reason, its ``Hello`` is refused); a worker is
quarantined at most once, so it is logged and counted once.
"""

from __future__ import annotations

import dataclasses

from protocols.values import QUARANTINED as QUARANTINE_PREFIX

REJECT_BACKOFF_S = 0.1
"""The back-off after a worker's first rejected sample in a row: it gets no work for this long (another
worker takes the group meanwhile). Doubled for each further rejection in a row."""
REJECT_BACKOFF_MAX_S = 2.0
"""The longest back-off after a rejection."""


@dataclasses.dataclass
class _Record:
    in_a_row: int = 0
    backoff_until: float = 0.0


class Quarantine:
    """Rejections in a row, back-offs and quarantined workers. ``after``: ``rollout.quarantine_after`` (0: never)."""

    def __init__(self, after: int) -> None:
        if isinstance(after, bool) or not isinstance(after, int) or after < 0:
            raise ValueError(f"rollout.quarantine_after must be an integer >= 0 (0 = never), got {after!r}")
        self.after = after
        self._records: dict[str, _Record] = {}
        self._quarantined: dict[str, tuple[bytes, str]] = {}  # worker id -> (reply address, Shutdown reason)

    def rejected(self, worker_id: str, why: str, now: float) -> str | None:
        """Count a rejected sample of ``worker_id`` (``why``: what was wrong) and back it off; returns the
        ``Shutdown`` reason when this rejection quarantines it, else None."""
        r = self._records.setdefault(worker_id, _Record())
        r.in_a_row += 1
        r.backoff_until = now + min(REJECT_BACKOFF_MAX_S, REJECT_BACKOFF_S * 2 ** (r.in_a_row - 1))
        if self.after and r.in_a_row >= self.after:
            return (f"{QUARANTINE_PREFIX}{r.in_a_row} invalid samples in a row (rollout.quarantine_after="
                    f"{self.after}), the last: {why}; this controller gives worker {worker_id} no more work")
        return None

    def accepted(self, worker_id: str) -> None:
        """A sample of ``worker_id`` passed validation: its rejections in a row start again from 0."""
        self._records.pop(worker_id, None)

    def backoff_s(self, worker_id: str, now: float) -> float:
        """Seconds ``worker_id`` must still wait for work after its last rejection (0: none)."""
        r = self._records.get(worker_id)
        return 0.0 if r is None else max(0.0, r.backoff_until - now)

    def in_a_row(self, worker_id: str) -> int:
        r = self._records.get(worker_id)
        return 0 if r is None else r.in_a_row

    def quarantine(self, worker_id: str, peer: bytes, reason: str) -> None:
        self._records.pop(worker_id, None)
        self._quarantined[worker_id] = (peer, reason)

    def forget(self, worker_id: str) -> None:
        """``worker_id`` left (or died): its rejections in a row are forgotten; a quarantine stays."""
        self._records.pop(worker_id, None)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._quarantined

    def shutdown_reason(self, worker_id: str, peer: bytes) -> str | None:
        """The reason to answer a message of quarantined ``worker_id`` from ``peer`` with (None: not
        quarantined, or another peer speaking for it)."""
        held = self._quarantined.get(worker_id)
        return held[1] if held is not None and held[0] == peer else None

    def refusal(self, worker_id: str) -> str:
        """What a ``Hello`` under a quarantined id is refused with."""
        reason = self._quarantined[worker_id][1].removeprefix(QUARANTINE_PREFIX)
        return (f"worker {worker_id} was quarantined by this controller ({reason}); fix what makes its samples "
                "invalid (its log and the controller's name the field), then join it under another worker_id")

    def reasons(self) -> dict[str, str]:
        """Every quarantined worker and why, in the order they were quarantined."""
        return {wid: reason.removeprefix(QUARANTINE_PREFIX) for wid, (_, reason) in self._quarantined.items()}
