"""Record types of the trajectory log (schema version ``SCHEMA_VERSION``).

Owns: what one log record holds. A ``SampleRecord`` is appended when a group is complete and scored;
a ``BatchRecord`` when the learner consumes a batch (it names the sample ids, in the order the
learner saw them), so the log alone rebuilds every batch in order (``asyncrl replay``).
Never: changes a field in place. Fields are appended with defaults (same rules as ``protocols``);
anything else bumps ``SCHEMA_VERSION`` and old logs are refused with a message naming both versions.
"""

from __future__ import annotations

import msgspec

from protocols import FinishedSample

SCHEMA_VERSION = 1


class _Record(msgspec.Struct, kw_only=True, omit_defaults=True, tag_field="kind"):
    pass


class SampleRecord(_Record, tag="sample"):
    """One finished, scored sample. ``advantage`` is the group-normalised advantage given to the learner."""

    sample: FinishedSample
    reward: float
    advantage: float
    admitted_version: int = -1
    logged_at: float = 0.0


class BatchRecord(_Record, tag="batch"):
    """Learner step ``step`` (learner version ``step`` at its start) consumed these samples, in order."""

    step: int
    sample_ids: list[str]
    logged_at: float = 0.0
    metrics: dict[str, float] = {}


class EventRecord(_Record, tag="event"):
    """A run event worth keeping with the data: ``resume``, ``worker_joined``, ``reissued``, ..."""

    event: str
    data: dict[str, str] = {}
    logged_at: float = 0.0


Record = SampleRecord | BatchRecord | EventRecord


class LogHeader(msgspec.Struct, kw_only=True, omit_defaults=True):
    """First frame of every segment."""

    schema_version: int
    created: float
    run_name: str = ""
    model: str = ""
    segment: int = 0
    config: dict = {}
