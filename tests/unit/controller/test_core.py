"""ControllerCore without sockets: handshakes, admission, exactly-once results, batches, checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

import protocols as P
from asyncrl.config import load_train_config
from asyncrl.controller.core import ControllerCore, read_state
from asyncrl.controller.scoring import build_scorer
from asyncrl.log import BatchRecord, SampleRecord, read_log, truncate_log
from asyncrl.models import ensure_tiny_model

G, B = 4, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def make_core(tmp_path, model_dir, eta=1, extra=(), clock=None):
    cfg = load_train_config([f"algo.group_size={G}", f"rollout.groups_per_step={B}", f"rollout.eta={eta}",
                             "rollout.worker_slots=8", "log.fsync=never", *extra])
    return ControllerCore(cfg, run_dir=tmp_path, scorer=build_scorer(cfg, model_dir),
                          welcome_config={"samples_address": "x", "model_id": "tiny:test"}, publish_formats=["int8"],
                          **({"clock": clock} if clock is not None else {}))


def hello(role, peer_id, fmt="int8"):
    return P.Hello(protocol_version=P.PROTOCOL_VERSION, role=role, peer_id=peer_id,
                   capabilities={"quant_format": fmt} if role == "generator" else {"version": "0"})


def register(core):
    assert isinstance(core.handle(b"L", hello("learner", "learner"))[0][1], P.Welcome)
    assert isinstance(core.handle(b"W", hello("generator", "w"))[0][1], P.Welcome)
    core.handle(b"W", P.Heartbeat(peer_id="w", time=0.0, stats={"version": 0.0}))


def answer(core, assignment, worker="w", version=0, correct=(True, False, False, False)):
    prompt = core.scorer.decode(assignment.prompt_ids.to_numpy().tolist())  # "a+b="
    a, b = prompt.rstrip("=").split("+")
    right = [4 + c for c in str(int(a) + int(b)).encode()] + [2]  # byte ids + <eos>
    for sid, ok in zip(assignment.sample_ids, correct, strict=False):
        ids = np.array(right if ok else [4 + ord("x"), 2], np.int32)
        core.on_sample(P.FinishedSample(
            sample_id=sid, group_id=assignment.group_id, prompt_ids=assignment.prompt_ids,
            response_ids=P.Array.from_numpy(ids), behav_logp=P.Array.from_numpy(np.full(len(ids), -0.5, np.float32)),
            versions=P.Array.from_numpy(np.full(len(ids), version, np.int32)), finish_reason="stop", worker_id=worker))


def test_generators_wait_for_the_learner_and_unknown_formats_are_refused(tmp_path, model_dir):
    core = make_core(tmp_path, model_dir)
    (_, reply), = core.handle(b"W", hello("generator", "w"))
    assert isinstance(reply, P.Error) and reply.code == "not_ready"
    core.handle(b"L", hello("learner", "learner"))
    (_, reply), = core.handle(b"W", hello("generator", "w", fmt="nvfp4"))
    assert isinstance(reply, P.Reject) and "quant.fmt=int8" in reply.reason
    (_, reply), = core.handle(b"X", hello("learner", "learner"))
    assert isinstance(reply, P.Reject)


def test_peers_cannot_speak_for_others(tmp_path, model_dir):
    core = make_core(tmp_path, model_dir)
    register(core)
    (_, r1), = core.handle(b"EVIL", P.Goodbye(peer_id="w"))
    (_, r2), = core.handle(b"EVIL", P.VersionUpdate(version=5, metrics={"done": 1.0}))
    (_, r3), = core.handle(b"EVIL", P.BatchRequest(step=0))
    assert all(isinstance(r, P.Error) for r in (r1, r2, r3))
    assert "w" in core.workers and core.version.version == 0 and not core.done


def test_admission_is_paced_by_the_gate_and_batches_are_logged(tmp_path, model_dir):
    core = make_core(tmp_path, model_dir, eta=0)
    register(core)
    out = core.handle(b"W", P.WorkRequest(worker_id="w", credits=64))
    assignments = [m for _, m in out if isinstance(m, P.RolloutAssignment)]
    assert len(assignments) == B  # eta=0: exactly one step's worth of groups
    assert isinstance(core.handle(b"W", P.WorkRequest(worker_id="w", credits=64))[0][1], P.NoWork)
    for a in assignments:
        answer(core, a)
    answer(core, assignments[0])  # duplicates are dropped and counted
    assert core.counters["samples/duplicate"] == G
    (peer, batch), = core.handle(b"L", P.BatchRequest(step=0))
    assert peer == b"L" and isinstance(batch, P.TrainBatch) and len(batch.samples) == B * G
    records = read_log(tmp_path / "trajectories").records
    assert sum(isinstance(r, SampleRecord) for r in records) == B * G
    assert [r.sample_ids for r in records if isinstance(r, BatchRecord)] == [[s.sample_id for s in batch.samples]]
    # advantages are group-normalised: one correct of four
    assert sorted({round(s.advantage, 4) for s in batch.samples}) == [-0.5, 1.5]


def test_state_round_trips_and_the_log_is_cut_back_to_it(tmp_path, model_dir):
    core = make_core(tmp_path, model_dir)
    register(core)
    out = core.handle(b"W", P.WorkRequest(worker_id="w", credits=64))
    assignments = [m for _, m in out if isinstance(m, P.RolloutAssignment)]
    answer(core, assignments[0])
    core.save(tmp_path / "state.json")
    answer(core, assignments[1])  # logged after the checkpoint: redone on resume
    core.close()
    state = read_state(tmp_path / "state.json")
    assert truncate_log(tmp_path / "trajectories", *state["log_position"]) > 0
    resumed = make_core(tmp_path, model_dir)
    resumed.load_state(state)
    assert resumed.cursor == core.cursor
    records = read_log(tmp_path / "trajectories").records
    ids = [r.sample.sample_id for r in records if isinstance(r, SampleRecord)]
    assert ids == list(assignments[0].sample_ids)


def test_time_budget_answers_the_first_batch_request_past_it_with_shutdown_and_survives_resume(tmp_path, model_dir):
    now = [100.0]
    core = make_core(tmp_path, model_dir, extra=["learner.time_budget_s=10"], clock=lambda: now[0])
    register(core)
    now[0] = 500.0  # time before the first batch request does not count
    assert core.handle(b"L", P.BatchRequest(step=0)) == [] and core.pending_batch == 0  # no batch ready yet
    now[0] = 509.5
    assert core.handle(b"L", P.BatchRequest(step=0)) == []
    now[0] = 510.0
    (peer, reply), = core.handle(b"L", P.BatchRequest(step=0))
    assert peer == b"L" and isinstance(reply, P.Shutdown) and "learner.time_budget_s=10" in reply.reason
    assert core.pending_batch is None
    core.save(tmp_path / "state.json")
    core.close()
    state = read_state(tmp_path / "state.json")
    assert state["budget_used_s"] == 10.0
    resumed = make_core(tmp_path / "resumed", model_dir, extra=["learner.time_budget_s=10"], clock=lambda: now[0])
    resumed.load_state(state)
    register(resumed)
    (_, reply), = resumed.handle(b"L", P.BatchRequest(step=0))  # nothing is left of the budget
    assert isinstance(reply, P.Shutdown)


def test_no_time_budget_never_ends_training(tmp_path, model_dir):
    now = [0.0]
    core = make_core(tmp_path, model_dir, clock=lambda: now[0])  # learner.time_budget_s=0: no limit
    register(core)
    core.handle(b"L", P.BatchRequest(step=0))
    now[0] = 1e9
    assert core.handle(b"L", P.BatchRequest(step=0)) == [] and core.pending_batch == 0

