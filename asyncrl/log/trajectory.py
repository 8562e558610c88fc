"""The trajectory log: an append-only, checksummed, rotating record of every sample and batch.

A log is a folder of segments ``traj-000000.log``, ``traj-000001.log``, ... (framing in ``framing``).
Owns: appending with an fsync policy, rotation by size, reading every intact record in order, and
repairing a torn tail when a log is reopened for writing (the tail of the *last* segment is truncated
to its intact prefix and appending continues; the truncation is reported, never silent).
Interior corruption (damaged bytes with intact records after them, or a damaged end of a closed
segment) is never repaired implicitly: reopening raises ``LogCorruptionError`` naming the segment and
offset, unless ``salvage=True``, which leaves the damaged bytes in place (readers skip them), keeps
every intact record and lists what was skipped in ``salvaged``. ``asyncrl log repair`` removes them.
Never: rewrites or deletes an intact record; loses a record that precedes or follows a corrupt one;
writes to a log whose file was deleted, moved or replaced under it: at every flush, every fsync and every
rotation the writer checks that its path still names the file it appends to (same inode and device), and
raises ``LogLostError`` naming the path otherwise (and for every later append or flush); on a full device
raises ``DiskFullError`` ("disk full at PATH"), and closing then drops what did not fit (a torn tail, cut back
when the log is reopened) instead of failing a second time. Cutting a log back
to a checkpoint (``truncate_log``) checks that every segment up to the checkpoint's position is there.

fsync policies: ``always`` (every record durable before ``append`` returns), ``every_n`` (every
``fsync_every`` records and on close), ``rotation`` (when a segment is closed), ``never`` (the OS
decides; tests only).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.constants import FSYNC_POLICIES
from asyncrl.log.framing import Corruption, LogFormatError, encode_record, header_bytes, scan_segment
from asyncrl.log.records import SCHEMA_VERSION, LogHeader
from asyncrl.rundir import RunDir
from asyncrl.rundir.files import DiskFullError, raise_if_disk_full


class LogCorruptionError(ValueError):
    """The log has damage that is not a torn tail; the message names it and the way out."""

    def __init__(self, log_dir: str | Path, damage: list[Corruption]) -> None:
        self.damage = damage
        where = "; ".join(str(c) for c in damage)
        super().__init__(
            f"trajectory log {log_dir} is corrupt inside (not a torn tail): {where}. Every intact record is "
            f"kept. Salvage explicitly with `asyncrl log repair {log_dir}`, or resume/replay with "
            "log.salvage=true (the damaged records are skipped and reported)")


class LogLostError(ValueError):
    """The log's file or folder is not where its writer or a resume needs it: deleted, moved or replaced.

    ``path``: the file or folder that is missing or was replaced. The message says what happened and the
    way on."""

    def __init__(self, path: str | Path, message: str) -> None:
        self.path = str(path)
        super().__init__(message)


def interior_damage(corruptions: list[Corruption], *, last_segment: str | None) -> list[Corruption]:
    """The corruptions that are not the repairable torn tail of ``last_segment``."""
    return [c for c in corruptions if not (c.torn_tail and c.path == last_segment)]

log = logging.getLogger(__name__)

SEGMENT_RE = re.compile(r"^traj-(\d{6})\.log$")


def segment_number(path: Path) -> int:
    """The index ``n`` of a ``traj-nnnnnn.log`` segment file."""
    m = SEGMENT_RE.match(path.name)
    if m is None:
        raise ValueError(f"{path} is not a trajectory log segment: its name must be traj-NNNNNN.log")
    return int(m.group(1))


def segment_paths(log_dir: str | Path) -> list[Path]:
    d = Path(log_dir)
    if not d.is_dir():
        return []
    found = sorted((int(m.group(1)), p) for p in d.iterdir() if (m := SEGMENT_RE.match(p.name)))
    return [p for _, p in found]


def _segment_name(index: int) -> str:
    return f"traj-{index:06d}.log"


class TrajectoryLogWriter:
    """Appends records to a log folder. Not thread-safe: one writer, one thread."""

    def __init__(
        self,
        log_dir: str | Path,
        *,
        config: dict | None = None,
        run_name: str = "",
        model: str = "",
        fsync: str = "every_n",
        fsync_every: int = 64,
        rotate_bytes: int = 256 * 1024 * 1024,
        salvage: bool = False,
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"log fsync policy {fsync!r} unknown; use one of {FSYNC_POLICIES}")
        if fsync_every < 1 or rotate_bytes < 4096:
            raise ValueError("log fsync_every must be >= 1 and rotate_bytes >= 4096")
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync, self.fsync_every, self.rotate_bytes = fsync, fsync_every, rotate_bytes
        self._config, self._run_name, self._model = config or {}, run_name, model
        self.repaired: list[Corruption] = []
        self.salvaged: list[Corruption] = []
        self._since_sync = 0
        self.lost: LogLostError | None = None  # set once the file was found deleted, moved or replaced
        self.full: DiskFullError | None = None  # set once a write found the device full
        existing = segment_paths(self.dir)
        if existing:
            self._check_closed_segments(existing[:-1], salvage)
            self._reopen(existing[-1], salvage)
        else:
            self._open_new(0)

    # -------------------------------------------------------------------------------- segments
    def _open_new(self, index: int) -> None:
        self.segment_index = index
        self.path = self.dir / _segment_name(index)
        header = LogHeader(schema_version=SCHEMA_VERSION, created=time.time(), run_name=self._run_name,
                           model=self._model, segment=index, config=self._config)
        self._f = open(self.path, "xb")  # noqa: SIM115 - closed in close()/_rotate()
        self._f.write(header_bytes(header))
        self._sync(force=True)
        self._size = self._f.tell()

    def _check_closed_segments(self, paths: list[Path], salvage: bool) -> None:
        self._salvage([c for p in paths for c in scan_segment(p.read_bytes(), str(p))[3]], salvage)

    def _salvage(self, damage: list[Corruption], salvage: bool) -> None:
        """Damage a reader would skip: refused (``LogCorruptionError``) unless ``salvage``, else logged and kept."""
        if damage and not salvage:
            raise LogCorruptionError(self.dir, damage)
        for c in damage:
            log.warning("log.salvage: skipping damaged bytes: %s", c)
        self.salvaged.extend(damage)

    def _reopen(self, path: Path, salvage: bool) -> None:
        data = path.read_bytes()
        header, _, _, corruptions = scan_segment(data, str(path))
        if self._model and header.model and header.model != self._model:
            raise LogFormatError(f"{path} was written for model {header.model!r}, not {self._model!r}; "
                                 "start a new run folder or resume with the original model")
        self._salvage(interior_damage(corruptions, last_segment=str(path)), salvage)
        end = len(data)
        if corruptions and corruptions[-1].torn_tail:
            torn = corruptions[-1]
            end = torn.offset
            log.warning("repairing trajectory log: %s; truncating %d bytes", torn, len(data) - end)
            self.repaired.append(torn)
            with open(path, "r+b") as f:
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
        self.segment_index = segment_number(path)
        self.path = path
        self._f = open(path, "ab")  # noqa: SIM115
        self._size = end

    def _rotate(self) -> None:
        self._check_in_place()  # a new segment in a folder that replaced the log's would hide the loss
        self._sync(force=self.fsync != "never")
        self._f.close()
        self._open_new(self.segment_index + 1)

    # --------------------------------------------------------------------------------- writing
    def append(self, record: Any) -> None:
        """Append one record; ``DiskFullError`` ("disk full at PATH") when the device is full (a partial
        frame left behind is a torn tail, repaired on the next open)."""
        if self.lost is not None:
            raise self.lost
        try:
            self._append(record)
        except OSError as e:
            self._raise_if_full(e)
            raise

    def _append(self, record: Any) -> None:
        data = encode_record(record)
        if self._size + len(data) > self.rotate_bytes and self._size > 4096:
            self._rotate()
        self._f.write(data)
        self._size += len(data)
        self._since_sync += 1
        if self.fsync == "always" or (self.fsync == "every_n" and self._since_sync >= self.fsync_every):
            self._check_in_place()
            self._sync(force=True)

    def _sync(self, force: bool) -> None:
        self._f.flush()
        if force and self.fsync != "never":
            os.fsync(self._f.fileno())
        self._since_sync = 0

    def flush(self) -> None:
        """Make everything appended so far durable (regardless of policy, except ``never``); ``LogLostError``
        if the segment was deleted, moved or replaced since it was opened."""
        self._check_in_place()
        try:
            self._sync(force=True)
        except OSError as e:
            self._raise_if_full(e)
            raise

    def _raise_if_full(self, err: OSError) -> None:
        """``DiskFullError`` for a full device (remembered: ``close`` then drops what did not fit, a torn tail
        that the next open cuts back, instead of failing again)."""
        try:
            raise_if_disk_full(err, self.path)
        except DiskFullError as full:
            self.full = full
            raise

    def _check_in_place(self) -> None:
        """``LogLostError`` unless ``self.path`` still names the file this writer appends to."""
        if self.lost is not None:
            raise self.lost
        try:
            on_disk = os.stat(self.path)
        except FileNotFoundError:
            where = f"{self.dir} is gone" if not self.dir.exists() else f"{self.dir} no longer holds it"
            self.lost = LogLostError(self.path, f"trajectory log {self.path} was deleted or moved while it was being "
                                                f"written ({where}); the records appended to it are not on disk")
            raise self.lost from None
        mine = os.fstat(self._f.fileno())
        if (on_disk.st_ino, on_disk.st_dev) != (mine.st_ino, mine.st_dev):
            self.lost = LogLostError(self.path, f"trajectory log {self.path} was replaced by another file while it "
                                                "was being written; the records appended to it are not in that file")
            raise self.lost

    def tell(self) -> tuple[int, int]:
        """(segment index, byte offset) after the last record: a resume point for checkpoints."""
        return self.segment_index, self._size

    def close(self) -> None:
        if self._f.closed:
            return
        try:
            self._sync(force=self.fsync != "never")
        except OSError as e:
            try:
                self._f.close()  # closes the file even though what is buffered cannot be written
            except OSError:
                pass
            if self.full is None:  # a full device not said yet: say it now
                self._raise_if_full(e)
                raise
            return
        self._f.close()

    def __enter__(self) -> TrajectoryLogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclasses.dataclass
class LogScan:
    """Everything readable in a log folder (or one segment file)."""

    headers: list[LogHeader]
    records: list[Any]
    corruptions: list[Corruption]

    last_segment: str = ""

    @property
    def header(self) -> LogHeader:
        return self.headers[0]

    @property
    def interior(self) -> list[Corruption]:
        """Damage other than a torn tail of the last segment: records were lost inside the log."""
        return interior_damage(self.corruptions, last_segment=self.last_segment)


def read_log(path: str | Path) -> LogScan:
    """Every intact record of a log folder or a single segment, in order; corruption is reported.

    Damaged bytes are skipped up to the next intact record (see ``framing``), so no intact record
    before *or* after them is lost. ``LogScan.interior`` lists the damage that is not a torn tail.
    """
    p = Path(path)
    if p.is_dir() and RunDir(p).trajectories.is_dir():
        p = RunDir(p).trajectories
    paths = segment_paths(p) if p.is_dir() else [p]
    if not paths:
        raise ValueError(f"no trajectory log at {path}: expected a run folder, a log folder or a traj-*.log file")
    headers: list[LogHeader] = []
    records: list[Any] = []
    corruptions: list[Corruption] = []
    for seg in paths:
        header, recs, _, found = scan_segment(seg.read_bytes(), str(seg))
        headers.append(header)
        records.extend(rec for _, rec in recs)
        corruptions.extend(found)
    return LogScan(headers, records, corruptions, last_segment=str(paths[-1]))


def truncate_log(log_dir: str | Path, segment: int, offset: int, *,
                 salvage: Callable[[str], None] | None = None) -> int:
    """Cut a log back to a checkpointed position (``TrajectoryLogWriter.tell()``); returns bytes dropped.

    Used on resume: records written after the checkpoint belong to work the resumed run redoes
    (regenerated or re-consumed with the same ids), so keeping them would log them twice.
    Every segment up to ``segment`` must be there and ``segment`` at least ``offset`` bytes long, else
    ``LogLostError`` (a missing segment or folder) or ``ValueError`` (a segment shorter than the position)
    says so; with ``salvage`` (``log.salvage=true``) what is missing is passed to it instead, and what is
    there is cut back (a resumed run then appends to what is left, or starts a new log).
    """
    d = Path(log_dir)
    present = {segment_number(p): p for p in segment_paths(d)}
    missing = [_segment_name(i) for i in range(segment + 1) if i not in present]
    if missing:
        what = f"{d} is missing" if not d.is_dir() else (
            f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} is missing from {d}")
        if salvage is None:
            raise LogLostError(d if not d.is_dir() else d / missing[0], _lost_behind(what, segment, offset))
        salvage(f"{what}: the records before the checkpoint's position ({_segment_name(segment)} byte {offset}) "
                "in it are lost")
    dropped = 0
    for index, p in present.items():
        if index > segment:
            dropped += p.stat().st_size
            p.unlink()
        elif index == segment:
            size = p.stat().st_size
            if size < offset:
                what = (f"{p} has {size} bytes but the checkpoint expects {offset}; the log was truncated behind the "
                        "checkpoint")
                if salvage is None:
                    raise ValueError(f"{what} and cannot be resumed as it is; resume with log.salvage=true to go on "
                                     "with what is left of it, or start a new run folder")
                salvage(f"{what}: the records after byte {size} of it are lost")
                continue
            with open(p, "r+b") as f:
                f.truncate(offset)
                os.fsync(f.fileno())
            dropped += size - offset
    return dropped


def _lost_behind(what: str, segment: int, offset: int) -> str:
    return (f"trajectory log lost: {what}, but the checkpoint being resumed was taken at {_segment_name(segment)} "
            f"byte {offset}, so records logged before it are not on disk (the log was deleted or moved after they "
            "were written). Put the log back where it was (from a backup) and resume again, or resume with "
            "log.salvage=true to go on with a log that lacks them (`asyncrl log inspect` then reports the gap and "
            "replay needs log.salvage=true too), or start a new run folder")
