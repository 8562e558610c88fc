"""ControllerCore's side of the protocol: typed worker setup, learner versions, checkpoint flags, worker
versions, and the refusal of a peer older than the protocol floor (1.4)."""

from __future__ import annotations

import json

import pytest

import protocols as P
from asyncrl.config.loader import load_train_config
from asyncrl.controller.core import ControllerCore, ModelInfo
from asyncrl.models import ensure_tiny_model
from asyncrl.tasks.scoring import build_scorer

WEIGHTS = {"weights_announce": "tcp://l:1", "weights_fetch": "tcp://l:2"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


@pytest.fixture
def core(tmp_path, model_dir):
    cfg = load_train_config(["algo.group_size=4", "rollout.groups_per_step=2", "rollout.worker_slots=8",
                             "rollout.heartbeat_s=0.25", "log.fsync=never"])
    c = ControllerCore(cfg, run_dir=tmp_path, scorer=build_scorer(cfg, model_dir), samples_address="tcp://c:9",
                       model=ModelInfo(config_json=(model_dir / "config.json").read_text(), eos_token_ids=(2,),
                                       model_id="tiny:test", model_dir=str(model_dir)),
                       publish_formats=["int8", "fp32"])
    yield c
    c.close()


def learner(proto=P.PROTOCOL_VERSION, **kw):
    return P.Hello(protocol_version=proto, role="learner", peer_id="learner", **kw)


def worker(proto=P.PROTOCOL_VERSION, fmt="int8", peer_id="w"):
    return P.Hello(protocol_version=proto, role="generator", peer_id=peer_id, capabilities={"quant_format": fmt})


def test_a_worker_is_welcomed_with_one_typed_setup_filled_from_the_run(core, model_dir):
    assert isinstance(core.handle(b"L", learner(version=0, capabilities=WEIGHTS))[0][1], P.Welcome)
    (_, w), = core.handle(b"W", worker(fmt="fp32"))
    assert isinstance(w, P.Welcome) and w.config == {}  # unused since 1.4
    s = w.worker_setup()
    assert (s.samples_address, s.weights_announce, s.weights_fetch) == ("tcp://c:9", "tcp://l:1", "tcp://l:2")
    assert (s.worker_slots, s.heartbeat_s, s.quant_format, s.eos_token_ids) == (8, 0.25, "fp32", [2])
    assert s.model_id == "tiny:test" and s.vocab_size() == json.loads((model_dir / "config.json").read_text())["vocab_size"]
    assert s == core.worker_setup(core.members.workers["w"]) and s.actor_format == "fp32"


@pytest.mark.parametrize("proto", ["1.0", "1.2", "1.3"])
def test_a_peer_older_than_the_floor_is_refused_at_hello_naming_the_upgrade(core, proto):
    (_, r), = core.handle(b"O", learner(proto=proto, version=0, capabilities=WEIGHTS))
    assert isinstance(r, P.Reject) and core.members.learner_peer is None
    assert f"speaks protocol {proto}, older than 1.4" in r.reason and "upgrade asyncrl" in r.reason
    core.handle(b"L", learner(version=0, capabilities=WEIGHTS))
    (_, r), = core.handle(b"O", worker(proto=proto, peer_id="old"))
    assert isinstance(r, P.Reject) and "upgrade asyncrl" in r.reason and "old" not in core.members.workers
    assert core.counters["control/rejected_hello"] == 2
    (_, r), = core.handle(b"W", worker(proto=f"1.{P.PROTOCOL_MINOR + 3}"))  # a newer minor still joins
    assert isinstance(r, P.Welcome) and "w" in core.members.workers


def test_a_workers_version_arrives_as_an_int_field_of_its_heartbeat(core):
    core.handle(b"L", learner(version=0, capabilities=WEIGHTS))
    core.handle(b"W", worker())
    core.handle(b"W", P.Heartbeat(peer_id="w", time=0.0, version=5, stats={"tokens_per_s": 12.0}))
    assert core.members.workers["w"].version == 5 and core.members.workers["w"].tokens_per_s == 12.0
    core.handle(b"W", P.Heartbeat(peer_id="w", time=0.0, version=-1))  # not loaded yet: never goes back
    assert core.members.workers["w"].version == 5


def test_the_learners_version_is_an_int_field_it_must_name(core, tmp_path):
    (_, r), = core.handle(b"L", learner(capabilities=WEIGHTS | {"version": "0"}))  # a string is not read
    assert isinstance(r, P.Reject) and "names no version (Hello.version)" in r.reason
    (_, r), = core.handle(b"L", learner(version=0, capabilities={"weights_announce": "tcp://l:1"}))
    assert isinstance(r, P.Reject) and "weights_announce and weights_fetch" in r.reason
    (_, r), = core.handle(b"L", learner(version=4, capabilities=WEIGHTS))  # batch 4 is not this controller's next
    assert isinstance(r, P.Reject) and "the learner is at version 4" in r.reason and core.members.learner_peer is None
    (_, r), = core.handle(b"L", learner(version=0, capabilities=WEIGHTS))
    assert isinstance(r, P.Welcome) and core.version.version == 0 and core.members.learner_peer == b"L"


def test_checkpoint_request_ack_and_done_are_typed_fields(core):
    core.handle(b"L", learner(version=0, capabilities=WEIGHTS))
    # a metric that happens to be named like a flag is a metric, never a flag
    assert core.handle(b"L", P.VersionUpdate(version=1, metrics={"checkpoint": 1.0, "done": 1.0})) == []
    assert not core.done and not core.checkpoint_path(1).exists()
    (peer, ack), = core.handle(b"L", P.VersionUpdate(version=2, checkpoint=True))
    assert peer == b"L" and ack == P.VersionUpdate(version=2, checkpointed=True)
    assert core.checkpoint_path(2).exists()
    core.handle(b"L", P.VersionUpdate(version=3, done=True))
    assert core.done and core.version.version == 3
