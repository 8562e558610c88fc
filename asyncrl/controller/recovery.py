"""Recovering a run folder: the controller's resume point, and moving checkpointed log positions after a repair.

Owns: choosing the controller state to resume from (the same verified checkpoint the learner picks,
``asyncrl.rundir.checkpoints``), cutting the trajectory log back to it (work after it is redone, so
keeping it would log it twice), the ports a resumed controller binds (its predecessor's, so that the
learner and workers still running find it at the address they know), and rewriting controller states
after ``asyncrl log repair`` moved byte offsets. Never: loads learner weights; resumes from a state that fails its checksum.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from asyncrl.controller.state import jsonable, read_state
from asyncrl.log import SampleRecord, read_log, segment_paths, truncate_log
from asyncrl.rundir import RunDir
from asyncrl.rundir.checkpoints import choose_resume_point
from asyncrl.rundir.files import ChecksumError, write_checksummed_json
from asyncrl.rundir.paths import CONTROLLER_STATES_GLOB

log = logging.getLogger("asyncrl.controller")


def resume_point(run_dir: Path, *, salvage: bool = False) -> tuple[dict[str, Any] | None, int]:
    """(controller state, version) to resume ``run_dir`` from, with the log cut back to that state.

    A log that no longer reaches the state's position (a segment or the whole folder deleted or moved,
    ``LogLostError``) is refused unless ``salvage`` (``log.salvage=true``): then what is left is cut back,
    the state carries ``log_lost`` (what is missing), which ``load_state`` records in the log, and counts as
    logged only the samples the log still holds."""
    paths = RunDir(run_dir)
    point = choose_resume_point(paths.checkpoints)
    for note in point.notes:
        log.warning("resume: %s", note)
    if point.controller_state is None:
        if any(segment_paths(paths.trajectories)):
            raise ValueError(f"resume: {run_dir} has a trajectory log but no usable controller state to cut it back "
                             "to; it cannot be resumed without logging work twice. Start a new run folder")
        return None, 0
    state = read_state(point.controller_state)
    lost: list[str] = []
    dropped = truncate_log(paths.trajectories, *state["log_position"], salvage=lost.append if salvage else None)
    for note in lost:
        log.warning("resume: log.salvage=true: %s", note)
    if lost:  # the samples the state counts as logged are only those still in the log
        state["log_lost"] = "; ".join(lost)
        left = read_log(paths.trajectories).records if segment_paths(paths.trajectories) else []
        state["samples_logged"] = sum(isinstance(r, SampleRecord) for r in left)
    log.info("resume: version %d; trajectory log cut back to its checkpoint (%d bytes of redone work dropped)",
             point.version, dropped)
    return state, point.version


def lost_log_message(err: Exception, run_dir: Path) -> str:
    """What a controller whose trajectory log was lost under it (``LogLostError``) says as it stops the run."""
    log_dir = RunDir(run_dir).trajectories
    return (f"{err}. The run stops here: training on would log samples nowhere. Put the log back (restore {log_dir} "
            f"from a backup, or move it back) and resume with `asyncrl train resume={run_dir}`: it restarts from the "
            "newest checkpoint and first checks that the log still reaches that checkpoint's position. Without the "
            f"log, `asyncrl train resume={run_dir} log.salvage=true` goes on with a new log that lacks the lost "
            "records; or start a new run")


T = TypeVar("T")


def previous_ports(address_file: Path) -> tuple[int, int]:
    """(control port, samples port) the run's previous controller listened on (``controller.json``); 0 where
    the file does not say."""
    try:
        addresses = json.loads(address_file.read_text())
    except (OSError, ValueError):
        return 0, 0
    ports = []
    for key in ("control", "samples"):
        tail = str(addresses.get(key, "")).rsplit(":", 1)[-1] if isinstance(addresses, dict) else ""
        ports.append(int(tail) if tail.isdigit() else 0)
    return ports[0], ports[1]


def bind_first(bind: Callable[[str], T], host: str, ports: Sequence[int], what: str) -> T:
    """``bind(tcp://host:port)`` on the first of ``ports`` that is free (the last one must be; 0: any)."""
    for i, port in enumerate(ports):
        try:
            return bind(f"tcp://{host}:{port}")
        except ValueError as e:
            if i == len(ports) - 1:
                raise
            log.warning("resume: the previous controller's %s port %d is taken (%s); binding another: the learner "
                        "and workers still running cannot find this controller, start them again with its new "
                        "address", what, port, e)
    raise ValueError("bind_first needs at least one port")


def move_log_positions(ckpt_root: Path, repairs) -> list[str]:
    """Rewrite every controller state whose log position lies in a repaired segment (``repair_log`` result)."""
    by_index = {r.index: r for r in repairs}
    out = []
    for path in sorted(ckpt_root.glob(CONTROLLER_STATES_GLOB)):
        try:
            state = read_state(path)
        except (ChecksumError, ValueError) as e:
            out.append(f"left {path} as it is: {e}")
            continue
        seg, off = state["log_position"]
        if seg in by_index:
            state["log_position"] = [seg, by_index[seg].new_offset(off)]
            write_checksummed_json(path, state, default=jsonable)
            out.append(f"moved the log position of {path.name}: byte {off} -> {state['log_position'][1]}")
    return out


def repair_main(path: str) -> int:
    """``asyncrl log repair PATH`` (a run folder or a log folder): remove damaged bytes, say what went."""
    from asyncrl.log import LogFormatError
    from asyncrl.log.repair import repair_log

    p = RunDir(Path(path))
    log_dir = p.trajectories if p.trajectories.is_dir() else p.root
    try:
        repairs = repair_log(log_dir)
    except (LogFormatError, OSError) as e:
        print(f"asyncrl log repair: {e}")
        return 2
    if not repairs:
        print(f"asyncrl log repair: {log_dir} has no damage; nothing changed")
        return 0
    for r in repairs:
        for c in r.damage:
            print(f"removed: {c}")
        print(f"rewrote {r.path} ({sum(e - s for s, e in r.removed)} bytes removed; the original is kept as {r.backup})")
    if p.checkpoints.is_dir():
        for line in move_log_positions(p.checkpoints, repairs):
            print(line)
    return 0
