"""Trajectory log: durability rules, rotation, and recovery of exactly the intact prefix."""

from __future__ import annotations

import random
import subprocess
import sys

import msgspec
import numpy as np
import pytest

from asyncrl.log import (
    BatchRecord,
    EventRecord,
    LogCorruptionError,
    LogFormatError,
    SampleRecord,
    TrajectoryLogWriter,
    read_log,
    segment_paths,
)
from asyncrl.log.framing import MAGIC, frame, scan_segment
from asyncrl.log.inspect import summarize
from protocols import Array, FinishedSample


def sample(i: int, version: int = 0, n: int = 4) -> SampleRecord:
    fs = FinishedSample(
        sample_id=f"g{i // 2}/{i % 2}", group_id=f"g{i // 2}",
        prompt_ids=Array.from_numpy(np.arange(3, dtype=np.int32)),
        response_ids=Array.from_numpy(np.arange(n, dtype=np.int32) + i),
        behav_logp=Array.from_numpy(np.full(n, -0.5, np.float32)),
        versions=Array.from_numpy(np.full(n, version, np.int32)),
        finish_reason="stop", worker_id="w0",
    )
    return SampleRecord(sample=fs, reward=float(i % 2), advantage=0.0)


def write_small_log(path, n=6, **kw) -> list:
    records = [sample(i, version=i // 2) for i in range(n)] + [BatchRecord(step=1, sample_ids=["g0/0", "g0/1"])]
    with TrajectoryLogWriter(path, config={"seed": 1}, run_name="t", fsync="never", **kw) as w:
        for r in records:
            w.append(r)
    return records


def test_records_read_back_in_order_with_header(tmp_path):
    records = write_small_log(tmp_path / "log")
    scan = read_log(tmp_path / "log")
    assert scan.records == records and not scan.corruptions
    assert scan.header.config == {"seed": 1} and scan.header.run_name == "t"


def test_truncation_at_every_offset_recovers_exactly_the_intact_prefix(tmp_path):
    records = write_small_log(tmp_path / "log")
    (seg,) = segment_paths(tmp_path / "log")
    data = seg.read_bytes()
    _, recs, end, _ = scan_segment(data, "x")
    offsets = [off for off, _ in recs] + [end]  # record starts, then the end of the last one
    header_end, ends = offsets[0], offsets[1:]
    for cut in range(len(data)):
        torn = tmp_path / f"torn-{cut}.log"
        torn.write_bytes(data[:cut])
        if cut < header_end:
            with pytest.raises(LogFormatError):
                read_log(torn)
            continue
        scan = read_log(torn)
        n_intact = sum(1 for e in ends if e <= cut)
        assert scan.records == records[:n_intact], cut
        assert bool(scan.corruptions) == (cut not in offsets), cut


def test_random_byte_flips_never_return_a_wrong_record(tmp_path):
    records = write_small_log(tmp_path / "log")
    (seg,) = segment_paths(tmp_path / "log")
    data = seg.read_bytes()
    rng = random.Random(0)
    _, recs, _, _ = scan_segment(data, "x")
    first_record = recs[0][0]
    for _ in range(300):
        buf = bytearray(data)
        i = rng.randrange(first_record, len(buf))
        buf[i] ^= rng.randrange(1, 256)
        p = tmp_path / "flip.log"
        p.write_bytes(bytes(buf))
        scan = read_log(p)
        assert all(r in records for r in scan.records)  # every record returned is intact
        assert [records.index(r) for r in scan.records] == sorted(records.index(r) for r in scan.records)
        assert len(scan.records) >= len(records) - 1  # one flipped byte damages at most one record
        assert scan.corruptions and scan.corruptions[0].offset <= i


def test_reopen_truncates_torn_tail_and_continues(tmp_path):
    records = write_small_log(tmp_path / "log")
    (seg,) = segment_paths(tmp_path / "log")
    data = seg.read_bytes()
    seg.write_bytes(data[:-3])  # tear the last record
    w = TrajectoryLogWriter(tmp_path / "log", fsync="always")
    assert len(w.repaired) == 1 and "past the end" in w.repaired[0].reason
    extra = EventRecord(event="resume", data={"step": "1"})
    w.append(extra)
    w.close()
    scan = read_log(tmp_path / "log")
    assert scan.records == records[:-1] + [extra] and not scan.corruptions


def test_rotation_by_size_keeps_every_record_across_segments(tmp_path):
    recs = [sample(i, n=200) for i in range(40)]
    with TrajectoryLogWriter(tmp_path / "log", rotate_bytes=8192, fsync="rotation") as w:
        for r in recs:
            w.append(r)
    assert len(segment_paths(tmp_path / "log")) > 2
    assert read_log(tmp_path / "log").records == recs


def test_corrupt_middle_segment_loses_nothing_outside_its_damaged_tail(tmp_path):
    recs = [sample(i, n=200) for i in range(40)]
    with TrajectoryLogWriter(tmp_path / "log", rotate_bytes=8192) as w:
        for r in recs:
            w.append(r)
    segs = segment_paths(tmp_path / "log")
    counts = [len(read_log(s).records) for s in segs]
    segs[1].write_bytes(segs[1].read_bytes()[:-10])
    scan = read_log(tmp_path / "log")
    assert len(scan.corruptions) == 1
    expect = recs[: counts[0]] + recs[counts[0] : counts[0] + counts[1] - 1] + recs[counts[0] + counts[1] :]
    assert scan.records == expect


def test_a_damaged_length_prefix_inside_the_log_loses_only_its_record(tmp_path):
    records = write_small_log(tmp_path / "log")
    (seg,) = segment_paths(tmp_path / "log")
    data = bytearray(seg.read_bytes())
    _, recs, _, _ = scan_segment(bytes(data), "x")
    off = recs[2][0]
    data[off : off + 4] = (10_000_000).to_bytes(4, "little")
    seg.write_bytes(bytes(data))
    scan = read_log(seg)
    assert scan.records == records[:2] + records[3:] and scan.corruptions[0].offset == off
    assert "runs past the end of the file" in scan.corruptions[0].reason and not scan.corruptions[0].torn_tail


def test_not_a_log_and_other_schema_version_are_refused_with_the_fix(tmp_path):
    p = tmp_path / "x.log"
    p.write_bytes(b"hello world")
    with pytest.raises(LogFormatError, match="not an asyncrl trajectory log"):
        read_log(p)
    p.write_bytes(MAGIC + frame(msgspec.msgpack.encode({"schema_version": 99, "created": 0.0})))
    with pytest.raises(LogFormatError, match="schema version 99.*reads version 1"):
        read_log(p)


def test_bad_fsync_policy_names_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="always"):
        TrajectoryLogWriter(tmp_path / "log", fsync="sometimes")


def test_inspect_reports_counts_staleness_and_rewards(tmp_path):
    write_small_log(tmp_path / "log")
    s = summarize(tmp_path / "log")
    assert s["samples"] == 6 and s["batches"] == 1 and s["consumed_samples"] == 2
    assert s["staleness_histogram"] == {"1": 8}  # step 1 consumed two version-0 samples of 4 tokens
    assert s["version_range"] == [0, 2] and s["reward"]["mean"] == pytest.approx(0.5)
    res = subprocess.run([sys.executable, "-m", "asyncrl", "log", "inspect", str(tmp_path / "log")],
                         capture_output=True, text=True)
    assert "6 samples, 1 batches" in res.stdout and "eta=  1" in res.stdout
    # this synthetic log's only batch is step 1: exactly-once accounting flags the missing step 0
    assert res.returncode == 1 and "batch records start at step 1, not 0" in res.stdout


def _flip_inside(seg, record_no: int) -> int:
    data = bytearray(seg.read_bytes())
    _, recs, _, _ = scan_segment(bytes(data), "x")
    off = recs[record_no][0]
    data[off + 12] ^= 0x55  # a byte of the body: the CRC no longer matches
    seg.write_bytes(bytes(data))
    return off


def test_a_flipped_byte_inside_the_log_is_interior_corruption_not_a_torn_tail(tmp_path):
    records = write_small_log(tmp_path / "log")
    (seg,) = segment_paths(tmp_path / "log")
    size = seg.stat().st_size
    off = _flip_inside(seg, 2)
    scan = read_log(tmp_path / "log")
    assert scan.records == records[:2] + records[3:]  # every intact record, before and after
    (c,) = scan.interior
    assert c.offset == off and not c.torn_tail and c.resume_at > off
    with pytest.raises(LogCorruptionError) as e:  # reopening (resume) refuses, names segment + offset
        TrajectoryLogWriter(tmp_path / "log")
    assert str(seg) in str(e.value) and f"byte {off}" in str(e.value) and "asyncrl log repair" in str(e.value)
    assert seg.stat().st_size == size  # nothing was truncated
    w = TrajectoryLogWriter(tmp_path / "log", salvage=True)  # explicit salvage keeps every intact record
    assert [x.offset for x in w.salvaged] == [off]
    extra = EventRecord(event="resume")
    w.append(extra)
    w.close()
    assert read_log(tmp_path / "log").records == records[:2] + records[3:] + [extra]


def test_log_repair_removes_only_the_damaged_bytes_and_maps_offsets(tmp_path):
    from asyncrl.log.repair import repair_log

    records = write_small_log(tmp_path / "log")
    (seg,) = segment_paths(tmp_path / "log")
    _, recs, end, _ = scan_segment(seg.read_bytes(), "x")
    _flip_inside(seg, 3)
    (rep,) = repair_log(tmp_path / "log")
    scan = read_log(tmp_path / "log")
    assert scan.records == records[:3] + records[4:] and not scan.corruptions
    assert rep.backup.exists() and not segment_paths(tmp_path / "log")[1:]
    removed = recs[4][0] - recs[3][0]
    assert rep.new_offset(end) == end - removed and rep.new_offset(recs[2][0]) == recs[2][0]
    TrajectoryLogWriter(tmp_path / "log").close()  # a repaired log reopens without complaint


def test_replay_refuses_interior_corruption_unless_salvage(tmp_path):
    from asyncrl.log.replay import check_replayable, load_replay_batches

    recs = [sample(i) for i in range(8)]
    batches = [BatchRecord(step=0, sample_ids=["g0/0", "g0/1"]), BatchRecord(step=1, sample_ids=["g1/0", "g1/1"]),
               BatchRecord(step=2, sample_ids=["g2/0", "g2/1"])]
    with TrajectoryLogWriter(tmp_path / "log", fsync="never") as w:
        for r in recs[:2] + [batches[0]] + recs[2:4] + [batches[1]] + recs[4:6] + [batches[2]]:
            w.append(r)
    (seg,) = segment_paths(tmp_path / "log")
    _flip_inside(seg, 3)  # sample g1/0: batch 1 loses a sample
    with pytest.raises(LogCorruptionError):
        check_replayable(tmp_path / "log", model_id="")
    with pytest.raises(LogCorruptionError):
        load_replay_batches(tmp_path / "log")
    notes = check_replayable(tmp_path / "log", model_id="", salvage=True)
    assert len(notes) == 1 and "skipping" in notes[0]
    out = load_replay_batches(tmp_path / "log", salvage=True)
    assert [b.step for b in out] == [0, 1] and [s.sample_id for s in out[1].samples] == ["g2/0", "g2/1"]


def test_replay_of_a_prefix_stops_at_the_steps_logged_when_it_was_checked(tmp_path):
    """A run still training goes on logging after ``asyncrl replay replay.allow_prefix=true`` counted its steps:
    the learner replays the steps counted, not what was logged since."""
    from asyncrl.log.replay import load_replay_batches, logged_steps

    recs = [sample(i) for i in range(6)]
    with TrajectoryLogWriter(tmp_path / "log", fsync="never") as w:
        for i in range(3):
            w.append(recs[2 * i])
            w.append(recs[2 * i + 1])
            w.append(BatchRecord(step=i, sample_ids=[f"g{i}/0", f"g{i}/1"]))
    assert logged_steps(tmp_path / "log") == 3 and logged_steps(tmp_path / "none") == 0
    assert [b.step for b in load_replay_batches(tmp_path / "log", steps=2)] == [0, 1]
    assert len(load_replay_batches(tmp_path / "log")) == 3
