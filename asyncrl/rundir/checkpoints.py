"""Which checkpoint a resume starts from: the newest one whose every file matches its checksum.

Owns: the checksum manifest of a learner checkpoint (``checksums.json`` beside ``learner.json``:
sha256 of every DCP shard, ``learner.json`` and ``extra.json``), its verification, and the choice
of the resume point shared by the controller and the learner, so both pick the same version: the
newest learner checkpoint that verifies *and* has a controller state of the same version that
verifies; else the controller's state at version 0 (written when a run starts), so a run that
stops before its first learner checkpoint resumes from the start with its log cut back.
Also owns how many checkpoints a run keeps (``KEEP_CHECKPOINTS``) and the pruning of controller states
(``prune_controller_states``): the newest ``KEEP_CHECKPOINTS`` stay, and so does every state a learner
checkpoint on disk pairs with, the state at version 0 (the resume point of last resort) and
``controller-final.json``.
Never: imports torch; loads weights; deletes a damaged checkpoint (it is reported and skipped).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

from asyncrl.rundir.files import ChecksumError, read_checksummed_json, sha256_file, write_checksummed_json
from asyncrl.rundir.paths import CONTROLLER_CHECKPOINT_RE, LEARNER_CHECKPOINT_RE, controller_checkpoint_name

log = logging.getLogger("asyncrl.checkpoints")

MANIFEST = "checksums.json"
KEEP_CHECKPOINTS = 3
"""Learner checkpoints a run keeps (older complete ones are deleted as a new one is saved), and the
number of newest controller states kept beside those the kept learner checkpoints pair with."""
LEARNER_FOLDER_RE = re.compile(r"^step_(\d{8})(?:\.tmp)?$")
"""A learner checkpoint folder, complete or still being written (its controller state must stay)."""


def controller_state_path(ckpt_root: str | Path, version: int) -> Path:
    return Path(ckpt_root) / controller_checkpoint_name(version)


def write_manifest(ckpt_dir: str | Path) -> None:
    """Checksum every file of a finished learner checkpoint folder (call once all of it is written)."""
    d = Path(ckpt_dir)
    files = {str(p.relative_to(d)): sha256_file(p) for p in sorted(d.rglob("*"))
             if p.is_file() and p.name != MANIFEST}
    write_checksummed_json(d / MANIFEST, {"files": files}, indent=1, sort_keys=True)


def verify_manifest(ckpt_dir: str | Path) -> str | None:
    """None when every file listed matches its checksum; else what is wrong (one line)."""
    d = Path(ckpt_dir)
    try:
        files = read_checksummed_json(d / MANIFEST)["files"]
    except FileNotFoundError:
        return f"{d} has no {MANIFEST} (it was not finished, or written by an asyncrl without checksums)"
    except (ChecksumError, ValueError, KeyError, TypeError) as e:
        return f"{d}/{MANIFEST} is damaged ({e})"
    for rel, digest in files.items():
        p = d / rel
        if not p.is_file():
            return f"{p} is missing"
        if sha256_file(p) != digest:
            return f"{p} does not match its checksum"
    if not files:
        return f"{d}/{MANIFEST} lists no file"
    return None


@dataclasses.dataclass
class ResumePoint:
    version: int
    learner_dir: Path | None  # None: start the learner from the model folder (version 0)
    controller_state: Path | None  # None: nothing to resume (fresh start)
    notes: list[str]


def learner_checkpoints(ckpt_root: str | Path) -> list[tuple[int, Path]]:
    """Complete learner checkpoints, newest first."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if p.is_dir() and (m := LEARNER_CHECKPOINT_RE.match(p.name))]
    return sorted(found, reverse=True)


def verify_controller_state(path: Path) -> str | None:
    try:
        read_checksummed_json(path)
    except FileNotFoundError:
        return f"{path} is missing"
    except (ChecksumError, ValueError) as e:
        return str(e)
    return None


def choose_resume_point(ckpt_root: str | Path, *, controller_state: bool = True) -> ResumePoint:
    """The newest verified checkpoint (see the module docstring); every damaged one skipped is in ``notes``."""
    notes: list[str] = []
    for version, d in learner_checkpoints(ckpt_root):
        problem = verify_manifest(d)
        if problem is None and controller_state:
            problem = verify_controller_state(controller_state_path(ckpt_root, version))
        if problem is None:
            if notes:
                notes.append(f"resuming from the previous good checkpoint, version {version}")
            return ResumePoint(version, d, controller_state_path(ckpt_root, version), notes)
        notes.append(f"checkpoint at version {version} is not usable: {problem}")
    zero = controller_state_path(ckpt_root, 0)
    if controller_state and verify_controller_state(zero) is None:
        notes.append("no usable learner checkpoint: resuming from the start of the run (version 0)")
        return ResumePoint(0, None, zero, notes)
    if notes:
        notes.append("no usable checkpoint: starting from version 0")
    return ResumePoint(0, None, None, notes)


def prune_controller_states(ckpt_root: str | Path, keep: int = KEEP_CHECKPOINTS) -> list[Path]:
    """Delete the controller states of ``ckpt_root`` (``controller-NNNNNNNN.json``) beyond the newest
    ``keep``, except one a learner checkpoint folder of the same version pairs with (complete or being
    written) and the one of version 0; returns what was deleted. ``controller-final.json`` is never touched."""
    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1: the newest controller state is the next resume point")
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    paired = {int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := LEARNER_FOLDER_RE.match(p.name))}
    states = sorted(((int(m.group(1)), p) for p in root.iterdir() if (m := CONTROLLER_CHECKPOINT_RE.match(p.name))),
                    reverse=True)
    removed = []
    for version, path in states[keep:]:
        if version != 0 and version not in paired:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
