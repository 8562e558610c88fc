"""``asyncrl log repair``: remove damaged bytes from a trajectory log, explicitly, keeping every intact record.

Owns: rewriting a damaged segment as its header plus its intact frames (byte for byte), keeping the
original beside it as ``traj-NNNNNN.log.damaged`` (no longer a segment name, so readers ignore it),
and the map from old to new byte offsets that callers need to move checkpointed log positions.
Never: repairs implicitly (the writer refuses interior damage), decodes and re-encodes a record,
or touches a segment without damage.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from asyncrl.log.framing import Corruption, read_header, scan_segment
from asyncrl.log.trajectory import segment_number, segment_paths


@dataclasses.dataclass
class SegmentRepair:
    """One rewritten segment: what was removed (``[start, end)`` in old offsets) and where the original is."""

    path: Path
    index: int
    removed: list[tuple[int, int]]
    damage: list[Corruption]
    backup: Path

    def new_offset(self, old: int) -> int:
        """Where byte ``old`` of the original segment is now (a removed byte maps to where its range was)."""
        shift = 0
        for start, end in self.removed:
            if old >= end:
                shift += end - start
            elif old > start:
                return start - shift
        return old - shift


def repair_log(log_dir: str | Path) -> list[SegmentRepair]:
    """Rewrite every damaged segment of ``log_dir`` without its damaged bytes; returns what changed."""
    out = []
    for path in segment_paths(log_dir):
        data = path.read_bytes()
        _, records, _, damage = scan_segment(data, str(path))
        if not damage:
            continue
        _, header_end = read_header(memoryview(data), str(path))
        removed = [(c.offset, len(data) if c.resume_at is None else c.resume_at) for c in damage]
        kept, pos = bytearray(data[:header_end]), header_end
        for start, end in removed:
            kept += data[pos:start]
            pos = end
        kept += data[pos:]
        backup = path.with_name(path.name + ".damaged")
        tmp = path.with_name(path.name + ".repair")
        with open(tmp, "wb") as f:
            f.write(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path, backup)
        os.replace(tmp, path)
        check = scan_segment(path.read_bytes(), str(path))
        assert not check[3] and len(check[1]) == len(records), "repair must keep exactly the intact records"
        out.append(SegmentRepair(path, segment_number(path), removed, damage, backup))
    return out
