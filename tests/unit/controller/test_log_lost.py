"""A controller whose trajectory log is deleted under it stops before the learner gets a batch it cannot log,
and a resume checks that the log still reaches the checkpoint it resumes from (real files, no sockets)."""

from __future__ import annotations

import shutil

import pytest

import protocols as P
from asyncrl.controller.recovery import lost_log_message, resume_point
from asyncrl.log import EventRecord, LogLostError, SampleRecord, read_log
from asyncrl.models import ensure_tiny_model
from tests.unit.controller.test_core import answer, make_core, register


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def _assignments(out):
    return [m for _, m in out if isinstance(m, P.RolloutAssignment)]


def test_a_deleted_log_stops_the_next_batch_and_no_checkpoint_is_written_over_it(tmp_path, model_dir):
    core = make_core(tmp_path, model_dir)
    core.save(core.checkpoint_path(0))
    register(core)
    held = _assignments(core.handle(b"W", P.WorkRequest(worker_id="w", credits=64)))
    answer(core, held[0])
    shutil.rmtree(tmp_path / "trajectories")  # rm -rf RUN/trajectories while it trains
    with pytest.raises(LogLostError, match="deleted or moved") as e:
        for a in held[1:]:
            answer(core, a)  # completes the first batch: the learner would get it now
        core.handle(b"L", P.BatchRequest(step=0))
    assert core.log.lost is e.value
    with pytest.raises(LogLostError):  # nor is a controller state saved that names a position in it
        core.handle(b"L", P.VersionUpdate(version=1, checkpoint=True))
    assert not core.checkpoint_path(1).exists()
    message = lost_log_message(e.value, tmp_path)
    assert f"{tmp_path / 'trajectories' / 'traj-000000.log'} was deleted or moved" in message
    assert f"asyncrl train resume={tmp_path}" in message and "log.salvage=true" in message
    core.close()


def test_resume_refuses_a_log_deleted_behind_its_checkpoint_and_salvage_goes_on_with_a_new_one(tmp_path, model_dir):
    core = make_core(tmp_path, model_dir)
    core.save(core.checkpoint_path(0))
    register(core)
    for a in _assignments(core.handle(b"W", P.WorkRequest(worker_id="w", credits=64))):
        answer(core, a)
    core.save(core.checkpoint_path(0))  # a checkpoint after the samples were logged
    core.close()
    shutil.rmtree(tmp_path / "trajectories")
    with pytest.raises(LogLostError, match="checkpoint being resumed was taken at traj-000000.log byte") as e:
        resume_point(tmp_path)
    assert f"{tmp_path / 'trajectories'} is missing" in str(e.value) and "log.salvage=true" in str(e.value)
    assert not (tmp_path / "trajectories").exists()  # a refused resume changes nothing
    state, version = resume_point(tmp_path, salvage=True)
    assert version == 0 and state is not None and "is missing" in state["log_lost"]
    resumed = make_core(tmp_path, model_dir, extra=["log.salvage=true"])
    resumed.load_state(state)
    assert core.samples_logged > 0 and state["samples_logged"] == 0  # none of them is on disk any more
    assert resumed.samples_logged == 0 and resumed.counters["log/lost_before_resume"] == 1
    resumed.close()
    records = read_log(tmp_path / "trajectories").records
    assert not any(isinstance(r, SampleRecord) for r in records)  # the new log says what it lacks
    (salvaged,) = [r for r in records if isinstance(r, EventRecord) and r.event == "salvaged"]
    assert "records before the checkpoint's position" in salvaged.data["lost"]
