"""A trajectory log deleted, moved or replaced under its writer is noticed at the next flush or rotation, and a
resume checks that the log still reaches the position its checkpoint names (real files throughout)."""

from __future__ import annotations

import shutil

import pytest

from asyncrl.log import LogLostError, TrajectoryLogWriter, read_log, segment_paths, truncate_log
from tests.unit.log.test_trajectory_log import sample


def _writer(path, **kw) -> TrajectoryLogWriter:
    w = TrajectoryLogWriter(path, run_name="t", fsync="never", **kw)
    for i in range(4):
        w.append(sample(i))
    return w


def test_a_deleted_log_folder_is_noticed_at_the_next_flush_naming_the_path(tmp_path):
    log_dir = tmp_path / "trajectories"
    w = _writer(log_dir)
    w.flush()  # in place: nothing to say
    shutil.rmtree(log_dir)
    with pytest.raises(LogLostError, match="deleted or moved") as e:
        w.flush()
    assert str(log_dir / "traj-000000.log") in str(e.value) and f"{log_dir} is gone" in str(e.value)
    assert e.value.path == str(log_dir / "traj-000000.log")
    with pytest.raises(LogLostError):  # a lost log takes no more records: they would be written to nowhere
        w.append(sample(9))
    w.close()  # closing a lost log says nothing more
    assert not log_dir.exists()  # nothing was written in its place


def test_a_replaced_segment_is_noticed_at_the_next_flush(tmp_path):
    log_dir = tmp_path / "trajectories"
    w = _writer(log_dir)
    w.flush()
    seg = log_dir / "traj-000000.log"
    copy = tmp_path / "copy.log"
    shutil.copyfile(seg, copy)
    copy.replace(seg)  # the same bytes under the same name, but another file
    with pytest.raises(LogLostError, match="replaced by another file") as e:
        w.flush()
    assert str(seg) in str(e.value)
    w.close()


def test_a_deleted_log_folder_is_noticed_at_rotation_and_no_segment_is_made_in_its_place(tmp_path):
    log_dir = tmp_path / "trajectories"
    w = _writer(log_dir, rotate_bytes=4096)
    shutil.rmtree(log_dir)
    with pytest.raises(LogLostError, match="deleted or moved"):
        for i in range(200):  # well past one segment of 4 KiB
            w.append(sample(i))
    assert not log_dir.exists()
    w.close()


def test_cutting_back_a_log_that_lost_the_checkpoints_segment_is_refused_naming_it(tmp_path):
    log_dir = tmp_path / "trajectories"
    w = _writer(log_dir, rotate_bytes=4096)
    for i in range(100):
        w.append(sample(i))
    position = w.tell()
    w.close()
    segments = segment_paths(log_dir)
    assert position[0] >= 1 and len(segments) == position[0] + 1
    segments[0].unlink()  # an earlier segment is gone: the records before the checkpoint are not all there
    with pytest.raises(LogLostError, match="traj-000000.log is missing"):
        truncate_log(log_dir, *position)
    shutil.rmtree(log_dir)
    with pytest.raises(LogLostError, match=f"{log_dir} is missing"):
        truncate_log(log_dir, *position)


def test_salvage_cuts_back_what_is_left_of_a_lost_log_and_says_what_is_missing(tmp_path):
    log_dir = tmp_path / "trajectories"
    w = _writer(log_dir, rotate_bytes=4096)
    for i in range(100):
        w.append(sample(i))
    position = w.tell()
    for i in range(20):  # logged after the checkpoint: cut back
        w.append(sample(100 + i))
    w.close()
    last = segment_paths(log_dir)[position[0]]
    segment_paths(log_dir)[0].unlink()
    lost: list[str] = []
    truncate_log(log_dir, *position, salvage=lost.append)
    assert lost and "traj-000000.log is missing" in lost[0]
    assert last.stat().st_size == position[1] and segment_paths(log_dir)[-1] == last
    shutil.rmtree(log_dir)
    lost.clear()
    assert truncate_log(log_dir, *position, salvage=lost.append) == 0 and f"{log_dir} is missing" in lost[0]
    with TrajectoryLogWriter(log_dir, fsync="never") as fresh:  # a resumed run starts a new log
        fresh.append(sample(0))
    assert len(read_log(log_dir).records) == 1
