"""The worker's sample book-keeping, the run preparation's folder naming, and the learner's run-setup
request, each on real files and real loopback ZeroMQ sockets."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import zmq

import protocols as P
from asyncrl.config.loader import load_train_config, save_config
from asyncrl.engine.base import GenResult
from asyncrl.rundir.lock import acquire_run_lock
from asyncrl.transport import ZmqChannel
from tests.conftest import REPO_ROOT
from workers.generator.samples import SampleStream
from workers.prepare import new_run_dir, prepare_replay
from workers.run_setup import SETUP_REQUEST, ask_run_setup, setup_reply


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


def _run_folder(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    save_config(load_train_config([f"runs_dir={tmp_path}"]), run / "config.json")
    return run


def test_a_replay_of_a_run_still_training_is_refused_naming_its_pid_and_the_ways_on(tmp_path):
    run = _run_folder(tmp_path)
    fd = acquire_run_lock(run)  # as `asyncrl train` holds it while the run trains
    try:
        res = subprocess.run([sys.executable, "-m", "asyncrl", "replay", f"run={run}"], capture_output=True,
                             text=True, timeout=120, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    finally:
        os.close(fd)
    assert res.returncode == 2, res.stdout + res.stderr
    line = res.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in res.stdout + res.stderr, res.stderr
    assert line.startswith(f"asyncrl replay: {run} is still training (its run folder is held by PID {os.getpid()})")
    assert "wait for it to finish" in line and "replay.allow_prefix=true" in line, line
    assert not (tmp_path / "run-replay").exists()


@pytest.mark.parametrize("option, message", [
    ("replay.allow_prefix=maybe", "replay.allow_prefix=maybe is not a bool; allowed: true or false"),
    ("replay.allow_prefx=true", "unknown replay option 'replay.allow_prefx'; did you mean replay.allow_prefix?"),
])
def test_a_bad_replay_option_is_refused_naming_the_fix(tmp_path, option, message):
    with pytest.raises(ValueError, match=message.replace("?", "\\?")):
        prepare_replay([f"run={_run_folder(tmp_path)}", option])
