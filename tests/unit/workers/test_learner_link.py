"""Rank 0's link to the controller (``workers/learner/link.py``) against a controller stand-in on loopback:
it rejoins a controller that no longer knows it, stops with one line naming the fix when refused or when
the controller is gone, and drops a second copy of a batch it already trained on."""

from __future__ import annotations

import threading

import pytest
import zmq

import protocols as P
from asyncrl.config.loader import load_train_config
from asyncrl.transport import WeightServer, ZmqChannel
from workers.learner import link as learner_link
from workers.learner.link import ControllerSource


@pytest.fixture
def link():
    """(stand-in control ROUTER, a ControllerSource at version 3 welcomed by it)."""
    ctl = ZmqChannel.bind(zmq.ROUTER, "tcp://127.0.0.1:0")
    server = WeightServer()
    made: dict = {}
    t = threading.Thread(target=lambda: made.update(src=ControllerSource(
        ctl.address, server, 3, threading.Event(), load_train_config([]).transport)))
    t.start()
    env = ctl.recv(30.0)
    assert isinstance(env.msg, P.Hello) and env.msg.role == "learner" and env.msg.version == 3
    ctl.send(P.Welcome(protocol_version=P.PROTOCOL_VERSION, server_id="stand-in", latest_version=3), to=env.peer)
    t.join(30.0)
    yield ctl, made["src"], env.peer
    made["src"].close()
    server.close()
    ctl.close()


def reply(ctl, peer, msg) -> None:
    ctl.send(msg, to=peer)


def test_a_learner_rejoins_a_controller_that_restarted_and_drops_a_second_copy_of_a_batch(link):
    ctl, src, peer = link
    done: dict = {}
    t = threading.Thread(target=lambda: done.update(batch=src.next_batch(3)))
    t.start()
    assert isinstance(ctl.recv(30.0).msg, P.BatchRequest)
    reply(ctl, peer, P.Error(code="not_learner", message="only the registered learner may ask for batches"))
    hello = ctl.recv(30.0).msg  # joins again where it stands
    assert isinstance(hello, P.Hello) and hello.version == 3 and hello.capabilities["weights_fetch"]
    reply(ctl, peer, P.Welcome(protocol_version=P.PROTOCOL_VERSION, server_id="stand-in", latest_version=3))
    again = ctl.recv(30.0).msg
    assert isinstance(again, P.BatchRequest) and again.step == 3  # asks the new controller again
    reply(ctl, peer, P.TrainBatch(step=2, samples=[]))  # an earlier batch sent twice: dropped
    reply(ctl, peer, P.TrainBatch(step=3, samples=[]))
    t.join(30.0)
    assert done["batch"].step == 3 and not src.lost and not src.stop.is_set()


def test_a_refused_learner_stops_with_the_controllers_reason(link):
    ctl, src, peer = link
    done: dict = {}
    t = threading.Thread(target=lambda: done.update(batch=src.next_batch(3)))
    t.start()
    ctl.recv(30.0)
    reply(ctl, peer, P.Error(code="not_learner", message="only the registered learner may ask for batches"))
    ctl.recv(30.0)
    reply(ctl, peer, P.Reject(reason="the learner is at version 3, ...; start it again with `asyncrl learner`"))
    t.join(30.0)
    assert done["batch"] is None and src.stop.is_set()
    assert src.lost.startswith(f"the controller at {ctl.address} refused this learner: the learner is at version 3")
    assert not src.sync_checkpoint(3)  # no checkpoint without a controller state of its version


def test_a_silent_controller_is_asked_again_and_then_given_up_with_the_fix(link, monkeypatch):
    ctl, src, _ = link
    monkeypatch.setattr(learner_link, "STOP_CHECK_S", 0.1)
    monkeypatch.setattr(learner_link, "PROBE_S", 0.2)
    monkeypatch.setattr(learner_link, "CONTROLLER_SILENT_S", 4.0)  # 20 probes' time: two Hellos however loaded
    assert src.next_batch(3) is None and src.stop.is_set()
    assert "no answer from the controller" in src.lost and "asyncrl controller resume=RUN_DIR" in src.lost
    seen = []
    while (env := ctl.recv(0.5)) is not None:
        seen.append(type(env.msg))
    assert seen[0] is P.BatchRequest and seen.count(P.Hello) >= 2  # it said Hello while it waited


def test_a_learner_welcomed_by_a_controller_older_than_the_floor_stops_naming_the_upgrade():
    ctl = ZmqChannel.bind(zmq.ROUTER, "tcp://127.0.0.1:0")
    server = WeightServer()
    out: dict = {}

    def start() -> None:
        try:
            ControllerSource(ctl.address, server, 0, threading.Event(), load_train_config([]).transport)
        except SystemExit as e:
            out["exit"] = str(e)

    t = threading.Thread(target=start)
    t.start()
    try:
        env = ctl.recv(30.0)
        assert isinstance(env.msg, P.Hello) and "version" not in env.msg.capabilities  # only the int field
        ctl.send(P.Welcome(protocol_version="1.3", server_id="stand-in", latest_version=0), to=env.peer)
        t.join(30.0)
        assert "speaks protocol 1.3, older than 1.4" in out["exit"] and "upgrade asyncrl" in out["exit"]
    finally:
        server.close()
        ctl.close()
