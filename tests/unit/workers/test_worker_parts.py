"""The worker's sample book-keeping, the run preparation's folder naming, and the learner's run-setup
request, each on real files and real loopback ZeroMQ sockets."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import zmq

import protocols as P
from asyncrl.config import load_train_config
from asyncrl.engine.base import GenResult
from asyncrl.transport import ZmqChannel
from workers.prepare import new_run_dir, prepare_replay
from workers.run_setup import SETUP_REQUEST, ask_run_setup, setup_reply
from workers.worker_samples import SampleStream


def _assignment(group: str, n: int = 2) -> P.RolloutAssignment:
    return P.RolloutAssignment(group_id=group, sample_ids=[f"{group}/{i}" for i in range(n)],
                               prompt_ids=P.Array.from_numpy(np.array([5, 6, 7], np.int32)),
                               params=P.SamplingParams(max_new_tokens=4, temperature=1.0, seed=3), n_samples=n)


def _result(sample_id: str, tokens: int, reason: str = "stop") -> GenResult:
    return GenResult(sample_id=sample_id, prompt_ids=[5, 6, 7], response_ids=list(range(tokens)),
                     behav_logp=np.full(tokens, -0.5, np.float32), versions=np.zeros(tokens, np.int32),
                     finish_reason=reason)


def test_a_group_that_comes_back_while_it_runs_is_not_submitted_twice():
    stream = SampleStream("w0", "native")
    first = stream.accept(_assignment("g"))
    assert [r.sample_id for r in first] == ["g/0", "g/1"] and first[0].prompt_ids == [5, 6, 7]
    assert first[0].params.max_new_tokens == 4 and first[0].params.seed == 3
    assert stream.accept(_assignment("g")) == []  # still running here: its results count for the group
    assert stream.outstanding == {"g/0": "g", "g/1": "g"}


def test_finished_samples_stream_once_and_aborted_ones_are_handed_back():
    pull = ZmqChannel.bind(zmq.PULL, "tcp://127.0.0.1:0")
    push = ZmqChannel.connect(zmq.PUSH, pull.address)
    try:
        stream = SampleStream("w0", "native")
        stream.accept(_assignment("g", 3))
        stream.finished(_result("g/0", 4))
        stream.finished(_result("g/1", 2, reason="abort"))  # a partial sample: never a result
        stream.finished(_result("other/0", 1))  # not assigned here (any more): dropped
        stream.flush(push, "int8")
        env = pull.recv(10.0)
        assert env is not None and isinstance(env.msg, P.FinishedSample)
        m = env.msg
        assert (m.sample_id, m.group_id, m.worker_id, m.engine, m.quant_format) == ("g/0", "g", "w0", "native", "int8")
        assert m.response_ids.to_numpy().tolist() == [0, 1, 2, 3]
        assert pull.recv(0.2) is None  # nothing else was sent
        assert (stream.sent, stream.tokens) == (1, 4)
        assert stream.unfinished() == ["g/1", "g/2"]
    finally:
        push.close()
        pull.close()


def test_a_taken_run_name_gets_the_next_free_number(tmp_path):
    cfg = load_train_config([f"runs_dir={tmp_path}", "run_name=exp"])
    assert [new_run_dir(cfg).name for _ in range(3)] == ["exp", "exp-2", "exp-3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp", "exp-2", "exp-3"]


def test_a_replay_without_its_source_run_says_how_to_name_it():
    with pytest.raises(ValueError, match=r"replay needs run=runs/<name>"):
        prepare_replay(["algo=tbpo"])


def test_a_learner_asking_where_the_run_is_gets_the_controllers_folders_and_formats(tmp_path):
    ctl = ZmqChannel.bind(zmq.ROUTER, "tcp://127.0.0.1:0", reply_errors=True)
    seen: list[P.Hello] = []

    def controller() -> None:  # the controller's side of the exchange (workers/controller.py)
        env = ctl.recv(30.0)
        if env is not None and isinstance(env.msg, P.Hello):
            seen.append(env.msg)
            ctl.send(P.Welcome(protocol_version=P.PROTOCOL_VERSION, server_id="controller",
                               run=setup_reply(tmp_path / "run", tmp_path / "model", ["int8", "fp32"])), to=env.peer)

    t = threading.Thread(target=controller)
    t.start()
    try:
        setup = ask_run_setup(ctl.address, timeout_s=30.0)
    finally:
        t.join()
        ctl.close()
    assert seen[0].role == "client" and seen[0].capabilities == {"request": SETUP_REQUEST}
    assert (setup.run_dir, setup.model_dir) == (str((tmp_path / "run").resolve()), str((tmp_path / "model").resolve()))
    assert setup.publish_formats == ["int8", "fp32"]
