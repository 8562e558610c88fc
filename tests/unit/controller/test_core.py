"""ControllerCore without sockets: handshakes, admission, exactly-once results, batches, checkpoints."""

from __future__ import annotations

import json

import numpy as np
import pytest

import protocols as P
from asyncrl.config.loader import load_train_config
from asyncrl.controller.core import (
    NO_WORK_RETRY_MAX_S,
    NO_WORK_RETRY_MIN_S,
    ControllerCore,
    ModelInfo,
    no_work_retry_s,
)
from asyncrl.controller.state import read_state
from asyncrl.log import BatchRecord, SampleRecord, read_log, truncate_log
from asyncrl.models import ensure_tiny_model
from asyncrl.tasks.scoring import build_scorer

G, B = 4, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def make_core(tmp_path, model_dir, eta=1, extra=(), **kw):
    cfg = load_train_config([f"algo.group_size={G}", f"rollout.groups_per_step={B}", f"rollout.eta={eta}",
                             "rollout.worker_slots=8", "log.fsync=never", *extra])
    return ControllerCore(cfg, run_dir=tmp_path, scorer=build_scorer(cfg, model_dir), model=model_info(model_dir),
                          samples_address="tcp://x:1", publish_formats=["int8"], **kw)


def model_info(model_dir) -> ModelInfo:
    return ModelInfo(config_json=(model_dir / "config.json").read_text(), eos_token_ids=(2,), model_id="tiny:test")



def fill_first_batch(core):
    """Every assignment of one generous work request answered, then the learner's first batch asked for."""
    out = core.handle(b"W", P.WorkRequest(worker_id="w", credits=64))
    for a in [m for _, m in out if isinstance(m, P.RolloutAssignment)]:
        answer(core, a)
    core.handle(b"L", P.BatchRequest(step=0))

LEARNER_CAPS = {"weights_announce": "tcp://l:1", "weights_fetch": "tcp://l:2"}


def hello(role, peer_id, fmt="int8", version=0):
    return P.Hello(protocol_version=P.PROTOCOL_VERSION, role=role, peer_id=peer_id,
                   version=version if role == "learner" else -1,
                   capabilities={"quant_format": fmt} if role == "generator" else LEARNER_CAPS)


def register(core, version=0):
    assert isinstance(core.handle(b"L", hello("learner", "learner", version=version))[0][1], P.Welcome)
    assert isinstance(core.handle(b"W", hello("generator", "w"))[0][1], P.Welcome)
    core.handle(b"W", P.Heartbeat(peer_id="w", time=0.0, version=0))


def answer(core, assignment, worker="w", version=0, correct=(True, False, False, False)):
    prompt = core.scorer.decode(assignment.prompt_ids.to_numpy().tolist())  # "a+b="
    a, b = prompt.rstrip("=").split("+")
    right = [4 + c for c in str(int(a) + int(b)).encode()] + [2]  # byte ids + <eos>
    replies = []  # what the controller answered (the learner's batch, when a sample completed it)
    for sid, ok in zip(assignment.sample_ids, correct, strict=False):
        ids = np.array(right if ok else [4 + ord("x"), 2], np.int32)
        replies += core.on_sample(P.FinishedSample(
            sample_id=sid, group_id=assignment.group_id, prompt_ids=assignment.prompt_ids,
            response_ids=P.Array.from_numpy(ids), behav_logp=P.Array.from_numpy(np.full(len(ids), -0.5, np.float32)),
            versions=P.Array.from_numpy(np.full(len(ids), version, np.int32)), finish_reason="stop", worker_id=worker))
    return replies


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
    (_, r2), = core.handle(b"EVIL", P.VersionUpdate(version=5, done=True))
    (_, r3), = core.handle(b"EVIL", P.BatchRequest(step=0))
    assert all(isinstance(r, P.Error) for r in (r1, r2, r3))
    assert "w" in core.members.workers and core.version.version == 0 and not core.done


def test_workers_learn_the_group_size_and_no_work_backs_off_with_the_fleet(tmp_path, model_dir):
    core = make_core(tmp_path, model_dir)
    register(core)
    assert core.worker_setup(core.members.workers["w"]).group_size == G  # what a worker needs free before it asks
    (_, nw), = core.handle(b"W", P.WorkRequest(worker_id="w", credits=G - 1))  # less than one group
    assert isinstance(nw, P.NoWork) and nw.retry_after_s == NO_WORK_RETRY_MIN_S
    # the whole fleet's empty polls stay near 200/s: 10 workers 50 ms, 100 workers 0.5 s, capped at 1 s
    assert [no_work_retry_s(n) for n in (1, 10, 100, 200, 10_000)] == [
        NO_WORK_RETRY_MIN_S, 0.05, 0.5, 1.0, NO_WORK_RETRY_MAX_S]


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


def test_time_budget_answers_the_first_request_for_a_new_step_past_it_with_shutdown_and_survives_resume(
        tmp_path, model_dir):
    now = [100.0]
    core = make_core(tmp_path, model_dir, extra=["learner.time_budget_s=10"], clock=lambda: now[0])
    register(core)
    now[0] = 500.0  # time before the first batch request does not count
    assert core.handle(b"L", P.BatchRequest(step=0)) == [] and core.batches.pending == 0  # no batch ready yet
    now[0] = 520.0  # past the budget while step 0 waits for its groups: the step was asked for inside it
    (_, welcome), = core.handle(b"L", hello("learner", "learner"))  # the waiting learner's probe
    assert isinstance(welcome, P.Welcome) and core.batches.pending is None
    assert core.handle(b"L", P.BatchRequest(step=0)) == [] and core.batches.pending == 0  # its re-send: no Shutdown
    sent = [m for _, a in core.handle(b"W", P.WorkRequest(worker_id="w", credits=64))
            if isinstance(a, P.RolloutAssignment) for m in answer(core, a)]
    assert [m.step for _, m in sent if isinstance(m, P.TrainBatch)] == [0]  # trained, however late
    core.handle(b"L", P.VersionUpdate(version=1, metrics={}))
    (peer, reply), = core.handle(b"L", P.BatchRequest(step=1))  # a new step past the budget
    assert peer == b"L" and isinstance(reply, P.Shutdown) and "learner.time_budget_s=10" in reply.reason
    assert "before step 1" in reply.reason and core.batches.pending is None
    core.save(tmp_path / "state.json")
    core.close()
    state = read_state(tmp_path / "state.json")
    assert state["budget_used_s"] == 20.0
    resumed = make_core(tmp_path / "resumed", model_dir, extra=["learner.time_budget_s=10"], clock=lambda: now[0])
    resumed.load_state(state)
    register(resumed, version=1)
    (_, reply), = resumed.handle(b"L", P.BatchRequest(step=1))  # nothing is left of the budget
    assert isinstance(reply, P.Shutdown)


def test_no_time_budget_never_ends_training(tmp_path, model_dir):
    now = [0.0]
    core = make_core(tmp_path, model_dir, clock=lambda: now[0])  # learner.time_budget_s=0: no limit
    register(core)
    core.handle(b"L", P.BatchRequest(step=0))
    now[0] = 1e9
    assert core.handle(b"L", P.BatchRequest(step=0)) == [] and core.batches.pending == 0


def test_resume_before_the_first_learner_checkpoint_cuts_the_log_back_to_version_zero(tmp_path, model_dir):
    from asyncrl.controller.recovery import resume_point

    core = make_core(tmp_path, model_dir)
    core.save(core.checkpoint_path(0))  # what the controller process does when a run starts
    register(core)
    fill_first_batch(core)
    core.close()
    first = read_log(tmp_path / "trajectories").records
    assert first  # samples and a batch, no learner checkpoint
    state, version = resume_point(tmp_path)
    assert version == 0 and state["cursor"] == 0
    assert read_log(tmp_path / "trajectories").records == []  # nothing will be logged twice
    resumed = make_core(tmp_path, model_dir)
    resumed.load_state(state)
    register(resumed)
    fill_first_batch(resumed)
    resumed.close()
    from asyncrl.log.inspect import summarize

    s = summarize(tmp_path / "trajectories")
    assert s["exactly_once_problems"] == [] and s["batches"] == 1
    assert s["samples"] == sum(isinstance(r, SampleRecord) for r in first)


def test_a_damaged_controller_state_is_refused(tmp_path, model_dir):
    from asyncrl.rundir.files import ChecksumError

    core = make_core(tmp_path, model_dir)
    core.save(tmp_path / "state.json")
    core.close()
    data = bytearray((tmp_path / "state.json").read_bytes())
    data[-5] ^= 0x01
    (tmp_path / "state.json").write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="does not match its checksum"):
        read_state(tmp_path / "state.json")


def test_log_inspect_reports_duplicated_and_doubly_consumed_samples(tmp_path, model_dir):
    from asyncrl.log import TrajectoryLogWriter
    from asyncrl.log.inspect import inspect_main, summarize

    core = make_core(tmp_path, model_dir)
    register(core)
    fill_first_batch(core)
    core.close()
    assert summarize(tmp_path / "trajectories")["exactly_once_problems"] == []
    records = read_log(tmp_path / "trajectories").records
    with TrajectoryLogWriter(tmp_path / "trajectories", fsync="never") as w:  # what a resume without cut-back did
        for r in records:
            w.append(r)
    problems = summarize(tmp_path / "trajectories")["exactly_once_problems"]
    assert any("repeat an id" in p for p in problems) and any("consumed twice" in p for p in problems)
    assert any("jump from step 0 to 0" in p for p in problems)
    assert inspect_main(str(tmp_path / "trajectories")) == 1


def test_resume_refuses_interior_log_damage_until_log_repair_which_moves_checkpointed_positions(tmp_path, model_dir):
    from asyncrl.controller.recovery import repair_main, resume_point
    from asyncrl.log import LogCorruptionError
    from asyncrl.log.framing import scan_segment

    core = make_core(tmp_path, model_dir)
    core.save(core.checkpoint_path(0))
    register(core)
    out = core.handle(b"W", P.WorkRequest(worker_id="w", credits=64))
    assignments = [m for _, m in out if isinstance(m, P.RolloutAssignment)]
    answer(core, assignments[0])
    answer(core, assignments[1])
    core.save(core.checkpoint_path(0))  # a checkpoint after eight logged samples
    core.close()
    kept = read_log(tmp_path / "trajectories").records
    (seg,) = sorted((tmp_path / "trajectories").glob("traj-*.log"))
    data = bytearray(seg.read_bytes())
    off = scan_segment(bytes(data), "x")[1][3][0]
    data[off + 20] ^= 0x10  # a flipped byte in the fourth record, before the checkpoint's position
    seg.write_bytes(bytes(data))
    with pytest.raises(LogCorruptionError, match=f"byte {off}"):
        make_core(tmp_path, model_dir)  # reopening for append refuses; nothing is truncated
    assert len(read_log(tmp_path / "trajectories").records) == len(kept) - 1
    assert repair_main(str(tmp_path)) == 0
    state, _ = resume_point(tmp_path)  # the moved position still ends exactly after the last record
    after = read_log(tmp_path / "trajectories").records
    assert after == kept[:3] + kept[4:] and state["log_position"][1] == seg.stat().st_size
    make_core(tmp_path, model_dir).close()


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _assignments(out):
    return [m for _, m in out if isinstance(m, P.RolloutAssignment)]


def test_a_worker_that_heartbeats_but_never_returns_loses_its_group_and_its_late_result_is_dropped(tmp_path, model_dir):
    clock = FakeClock()
    core = make_core(tmp_path, model_dir, extra=["rollout.assignment_timeout_s=10", "rollout.dead_after_s=1000"],
                     clock=clock)
    register(core)
    held = _assignments(core.handle(b"W", P.WorkRequest(worker_id="w", credits=G)))
    assert len(held) == 1
    for _ in range(4):  # alive and heartbeating every 3 s, but it never returns the group
        clock.t += 3
        core.handle(b"W", P.Heartbeat(peer_id="w", time=0.0, version=0))
        core.poll()
    assert core.counters["samples/overdue_groups"] == 1 and "w" in core.members.workers
    assert isinstance(core.handle(b"V", hello("generator", "v"))[0][1], P.Welcome)
    core.handle(b"V", P.Heartbeat(peer_id="v", time=0.0, version=0))
    again = _assignments(core.handle(b"V", P.WorkRequest(worker_id="v", credits=G)))
    assert again[0].group_id == held[0].group_id and again[0].sample_ids == held[0].sample_ids
    answer(core, held[0], worker="w")  # the late result
    assert core.counters["samples/late"] == G and core.samples_logged == 0
    answer(core, again[0], worker="v")
    assert core.samples_logged == G
    core.close()
    assert {r.sample.worker_id for r in read_log(tmp_path / "trajectories").records if isinstance(r, SampleRecord)} == {"v"}


def _sample(a, *, ids=(5, 6, 2), logp=-0.5, version=0, prompt=None, index=0):
    ids = np.asarray(ids, np.int32)
    return P.FinishedSample(
        sample_id=a.sample_ids[index], group_id=a.group_id, prompt_ids=prompt or a.prompt_ids,
        response_ids=P.Array.from_numpy(ids), behav_logp=P.Array.from_numpy(np.full(len(ids), logp, np.float32)),
        versions=P.Array.from_numpy(np.full(len(ids), version, np.int32)), finish_reason="stop", worker_id="w")


def test_a_returned_sample_is_validated_field_by_field_and_a_bad_one_is_rejected_counted_and_reissued(
    tmp_path, model_dir
):
    clock = FakeClock()
    core = make_core(tmp_path, model_dir, extra=["rollout.max_new_tokens=4"], clock=clock)
    register(core)
    (a, *_) = _assignments(core.handle(b"W", P.WorkRequest(worker_id="w", credits=G)))
    vocab = core.vocab_size
    other_prompt = P.Array.from_numpy(np.asarray([7, 8, 9], np.int32))
    bad = {
        "token_ids": _sample(a, ids=(5, vocab, 2)),
        "length": _sample(a, ids=(5, 5, 5, 5, 2)),
        "behav_logp": _sample(a, logp=float("nan")),
        "versions": _sample(a, version=7),
        "prompt": _sample(a, prompt=other_prompt),
    }
    for key, msg in bad.items():
        assert core.on_sample(msg) == []
        assert core.counters[f"samples/invalid/{key}"] == 1, key
        # the group went back to pending: the worker (or another) gets it again, same ids, once its back-off
        # (tests/unit/controller/test_quarantine.py) is over
        clock.t += 60
        (again,) = _assignments(core.handle(b"W", P.WorkRequest(worker_id="w", credits=G)))
        assert again.sample_ids == a.sample_ids
    positive = _sample(a, logp=0.5)
    core.on_sample(positive)
    assert core.counters["samples/invalid/behav_logp"] == 2
    assert core.counters["samples/rejected_invalid"] == 6 and core.samples_logged == 0
    clock.t += 60
    (a,) = _assignments(core.handle(b"W", P.WorkRequest(worker_id="w", credits=G)))
    answer(core, a)  # valid answers are accepted as before
    assert core.samples_logged == G
    core.close()
    ids = [r.sample.response_ids.to_numpy() for r in read_log(tmp_path / "trajectories").records
           if isinstance(r, SampleRecord)]
    assert all(int(x.max()) < vocab for x in ids)


def _long_prompt_dataset(tmp_path):
    lines = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(12)]
    lines[3]["prompt"] = lines[5]["prompt"] = "1+" * 40 + "1="  # 82 prompt tokens
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_prompts_longer_than_the_model_takes_are_skipped_at_admission_and_counted(tmp_path, model_dir):
    path = _long_prompt_dataset(tmp_path)
    core = make_core(tmp_path / "run", model_dir, eta=3, extra=[
        "task.name=jsonl_math", f"task.path={path}", "task.eval_size=2", "task.max_prompt_tokens=20"])
    register(core)
    out = _assignments(core.handle(b"W", P.WorkRequest(worker_id="w", credits=64)))
    lengths = [len(a.prompt_ids.to_numpy()) for a in out]
    assert len(out) == 8 and max(lengths) <= 20  # (eta + 1) * B groups, none over the limit
    assert core.counters["data/prompts_too_long"] >= 1 and core.cursor == 8 + core.counters["data/prompts_too_long"]
    core.close()


def test_a_too_long_prompt_is_refused_up_front_or_reported_and_left_out_of_evaluation(tmp_path, model_dir):
    from asyncrl.engine.native.engine import NativeEngine
    from asyncrl.learner.evaluate import evaluate_greedy
    from asyncrl.models.prepare import check_prompt_lengths

    path = _long_prompt_dataset(tmp_path)
    over = ["task.name=jsonl_math", f"task.path={path}", "task.eval_size=10", "task.max_prompt_tokens=20"]
    with pytest.raises(ValueError, match="2 prompts are longer than 20 tokens.*task.too_long=skip"):
        check_prompt_lengths(load_train_config([*over, "task.too_long=error"]), model_dir)
    said = []
    report = check_prompt_lengths(load_train_config(over), model_dir, log=said.append)
    assert report["train_too_long"] + report["eval_too_long"] == 2 and "skipped and counted" in said[0]
    assert report["eval_too_long"] >= 1  # (the held-out draw of this file puts a long prompt in evaluation)
    # evaluation with a real engine whose context is shorter than the long prompts: they are left out
    cfg = load_train_config(over)
    scorer = build_scorer(cfg, model_dir)
    engine = NativeEngine.from_pretrained(model_dir, quant_format="fp32", version=-1, max_batch_size=16,
                                          max_seq_len=21)
    result = evaluate_greedy(engine, scorer, max_new_tokens=1)
    assert result["eval/skipped_too_long"] == report["eval_too_long"]
    assert result["eval/n"] == 10 - report["eval_too_long"]
    engine.close()


def test_workers_weight_sync_seconds_are_the_mean_per_version_over_workers_and_bad_stats_are_ignored(tmp_path, model_dir):
    core = make_core(tmp_path, model_dir)
    register(core)
    assert "workers/weight_sync_s" not in core.metrics()  # nobody has fetched a version yet
    assert isinstance(core.handle(b"V", hello("generator", "v"))[0][1], P.Welcome)
    core.handle(b"W", P.Heartbeat(peer_id="w", time=0.0, stats={"weight_sync_s": 3.0, "weight_syncs": 2.0}))
    core.handle(b"V", P.Heartbeat(peer_id="v", time=0.0, stats={"weight_sync_s": 1.0, "weight_syncs": 2.0}))
    assert core.metrics()["workers/weight_sync_s"] == pytest.approx(1.0)  # 4 s over 4 fetches
    core.handle(b"V", P.Heartbeat(peer_id="v", time=0.0, stats={"weight_sync_s": float("nan"), "weight_syncs": 9.0}))
    assert core.metrics()["workers/weight_sync_s"] == pytest.approx(1.0)  # a NaN from a peer changes nothing
    core.close()


def test_once_training_is_done_a_heartbeat_is_answered_with_shutdown_so_a_starting_worker_leaves(tmp_path, model_dir):
    core = make_core(tmp_path, model_dir)
    register(core)
    assert core.handle(b"W", P.Heartbeat(peer_id="w", time=0.0, version=-1)) == []  # still training: no reply
    core.handle(b"L", P.VersionUpdate(version=1, done=True))
    (peer, reply), = core.handle(b"W", P.Heartbeat(peer_id="w", time=1.0, version=-1))
    assert peer == b"W" and isinstance(reply, P.Shutdown) and reply.reason == "training finished"
