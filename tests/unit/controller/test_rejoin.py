"""Rejoining a running controller (``asyncrl.controller.membership``): a learner started again at its
checkpoint, a live learner after the controller restarted, a second process under a live worker's id."""

from __future__ import annotations

import protocols as P
from asyncrl.controller.state import read_state
from tests.unit.controller.test_core import (
    LEARNER_CAPS,
    answer,
    fill_first_batch,
    hello,
    make_core,
    model_dir,  # noqa: F401 - the module fixture
    register,
)

MOVED = {"weights_announce": "tcp://l2:1", "weights_fetch": "tcp://l2:2"}


def learner_at(version: int, caps=LEARNER_CAPS) -> P.Hello:
    return P.Hello(protocol_version=P.PROTOCOL_VERSION, role="learner", peer_id="learner", version=version,
                   capabilities=caps)


def test_a_learner_started_again_from_its_checkpoint_is_welcomed_and_workers_follow_its_weights(tmp_path, model_dir):  # noqa: F811
    core = make_core(tmp_path, model_dir)
    register(core)
    fill_first_batch(core)  # the learner asked for batch 0 and got it
    assert core.assembler.next_step == 1 and core.assembler.retained_steps() == [0]
    # stopped before it trained batch 0: started again at version 0, it gets the same batch 0 again
    out = core.handle(b"L", learner_at(0, MOVED))
    assert [type(m) for _, m in out] == [P.Welcome, P.Welcome]
    (to_worker, w), = [(p, m) for p, m in out if p == b"W"]
    assert (w.setup.weights_announce, w.setup.weights_fetch) == ("tcp://l2:1", "tcp://l2:2")
    (_, again), = core.handle(b"L", P.BatchRequest(step=0))
    assert isinstance(again, P.TrainBatch) and again.step == 0 and core.counters["batches/resent"] == 1
    core.handle(b"L", P.VersionUpdate(version=1, checkpoint=True))  # batch 0 trained: released
    # the same learner saying Hello again where it stands (a probe while it waits): nothing moves, no worker told
    assert [type(m) for _, m in core.handle(b"L", learner_at(1, MOVED))] == [P.Welcome]
    # behind the controller (killed after its checkpoint, and batch 0 released): refused, naming the fix
    (_, r), = core.handle(b"L", learner_at(0, MOVED))
    assert isinstance(r, P.Reject) and "asyncrl controller resume=RUN_DIR" in r.reason
    # ahead of it (the controller resumed from an older checkpoint than the live learner's state)
    (_, r), = core.handle(b"L", learner_at(3, MOVED))
    assert isinstance(r, P.Reject) and "the learner is at version 3" in r.reason and "asyncrl learner" in r.reason
    assert core.counters["control/rejected_hello"] == 2 and core.version.version == 1


def test_a_resumed_controller_takes_back_the_live_learner_at_the_same_version(tmp_path, model_dir):  # noqa: F811
    first = make_core(tmp_path / "a", model_dir)
    register(first)
    fill_first_batch(first)
    first.handle(b"L", P.VersionUpdate(version=1, checkpoint=True))
    state = read_state(first.checkpoint_path(1))  # what a resumed controller reads
    first.close()
    resumed = make_core(tmp_path / "b", model_dir)  # another controller process, from the checkpoint of version 1
    resumed.version.set(1)
    resumed.load_state(state)
    (_, r), = resumed.handle(b"L", P.BatchRequest(step=1))  # the live learner's request reaches a stranger
    assert isinstance(r, P.Error) and r.code == "not_learner"
    (_, r), = resumed.handle(b"L", learner_at(1))
    assert isinstance(r, P.Welcome) and resumed.members.learner_peer == b"L" and resumed.batches.pending is None
    (_, batch), = resumed.handle(b"L", P.BatchRequest(step=1))  # the groups answered before the checkpoint
    assert isinstance(batch, P.TrainBatch) and batch.step == 1
    resumed.close()


def test_a_second_worker_under_a_live_id_is_refused_by_name_and_a_silent_one_is_taken_over(tmp_path, model_dir):  # noqa: F811
    clock = [100.0]
    core = make_core(tmp_path, model_dir, clock=lambda: clock[0])
    register(core)
    out = core.handle(b"W", P.WorkRequest(worker_id="w", credits=64))
    a = next(m for _, m in out if isinstance(m, P.RolloutAssignment))
    second = P.Hello(protocol_version=P.PROTOCOL_VERSION, role="generator", peer_id="w",
                     capabilities={"quant_format": "int8", "pid": "4242", "host": "gen-2"})
    (_, r), = core.handle(b"W2", second)
    assert isinstance(r, P.Reject) and "worker id 'w' is already taken by a live worker" in r.reason
    assert "worker_id=NAME" in r.reason and core.members.workers["w"].peer == b"W"
    assert core.counters["control/duplicate_worker_id"] == 1 and core.counters["workers/left"] == 0
    answer(core, a)  # the live worker's work still counts
    assert core.counters["samples/accepted"] + core.counters["samples/completed"] == 4
    # the same process saying Hello again (a lost Welcome) is welcomed as before
    assert isinstance(core.handle(b"W", hello("generator", "w"))[0][1], P.Welcome)
    # silent for more than three heartbeats (killed): a new process under its id takes over
    clock[0] += 3 * core.cfg.rollout.heartbeat_s + 0.1
    (_, r), = core.handle(b"W2", second)
    assert isinstance(r, P.Welcome) and core.members.workers["w"].peer == b"W2" and core.members.workers["w"].pid == "4242"
