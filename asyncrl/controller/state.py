"""A controller state on disk: what ``ControllerCore`` checkpoints, as checksummed JSON.

Owns: the state's content (``state_dict``: dataset cursor, gate, buffer with payloads, assembler, log
position, counters, the time budget spent), writing it (``save_state``: the log flushed first, then one
atomic checksummed file), reading it (``read_state``), continuing from it (``load_state``), and the JSON
form of the one non-JSON value in it, a streamed ``FinishedSample`` (hex of its msgpack encoding).
Never: decides which state to resume from (``asyncrl.controller.recovery``) or when to save one
(``ControllerCore`` on a checkpoint request, ``workers/controller.py`` at start and end).

Invariant: a reader sees the previous state file or the new one, never a torn one; a state names the
log position its trajectory log is cut back to on resume, so work after it is redone, not logged twice.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import protocols as P
from asyncrl.controller.assembler import BatchAssembler
from asyncrl.controller.batches import BatchDesk
from asyncrl.controller.buffer import GroupBuffer
from asyncrl.controller.gate import StalenessGate
from asyncrl.controller.versions import ManualVersion
from asyncrl.log import EventRecord, TrajectoryLogWriter
from asyncrl.rundir.files import read_checksummed_json, write_checksummed_json


class Checkpointed(Protocol):
    """What of the controller a state holds (``ControllerCore``, which imports this module)."""

    cursor: int
    version: ManualVersion
    gate: StalenessGate
    buffer: GroupBuffer
    assembler: BatchAssembler
    log: TrajectoryLogWriter
    counters: Counter
    samples_logged: int
    batches: BatchDesk
    clock: Callable[[], float]


def state_dict(core: Checkpointed) -> dict[str, Any]:
    """Everything a resumed controller needs to continue ``core`` exactly (payloads as ``FinishedSample``)."""
    return {"cursor": core.cursor, "gate": core.gate.state_dict(), "buffer": core.buffer.state_dict(),
            "assembler": core.assembler.state_dict(), "log_position": list(core.log.tell()),
            "counters": dict(core.counters), "samples_logged": core.samples_logged,
            "max_consumed_staleness": core.batches.max_consumed_staleness,
            "budget_used_s": core.batches.budget_elapsed(core.clock())}


def save_state(core: Checkpointed, path: Path) -> None:
    """Checksummed and atomic: a reader sees the previous state or this one (``DiskFullError`` when full)."""
    core.log.flush()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_checksummed_json(path, state_dict(core), default=jsonable)


def load_state(core: Checkpointed, state: dict[str, Any]) -> None:
    """Continue ``core`` from ``state`` (``state_dict`` of a previous controller, after ``truncate_log``)."""
    core.cursor = int(state["cursor"])
    core.gate.load_state_dict(state["gate"])
    core.buffer.load_state_dict(state["buffer"])
    core.assembler.load_state_dict(state["assembler"])
    core.counters.update(state["counters"])
    core.samples_logged = int(state["samples_logged"])
    core.batches.max_consumed_staleness = int(state["max_consumed_staleness"])
    core.batches.budget_used_s = float(state.get("budget_used_s", 0.0))  # absent in states of older runs
    core.log.append(EventRecord(event="resume", logged_at=time.time(), data={
        "version": str(core.version.version), "cursor": str(core.cursor)}))
    if state.get("log_lost"):  # resumed with log.salvage=true over a log that lost records before this state
        core.counters["log/lost_before_resume"] += 1
        core.log.append(EventRecord(event="salvaged", logged_at=time.time(), data={"lost": str(state["log_lost"])}))


def read_state(path: Path) -> dict[str, Any]:
    """A saved controller state; ``ChecksumError`` (a ValueError) if the file is damaged."""
    return read_checksummed_json(path, object_hook=from_jsonable)


def jsonable(obj: Any) -> Any:
    if isinstance(obj, P.FinishedSample):
        return {"__finished_sample__": P.encode(obj).hex()}
    raise TypeError(f"cannot checkpoint {type(obj).__name__}")


def from_jsonable(d: dict) -> Any:
    if "__finished_sample__" in d:
        return P.decode(bytes.fromhex(d["__finished_sample__"]), P.FinishedSample)
    return d
