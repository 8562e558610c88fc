"""Protocol 1.3's typed setup, versions and control flags: round trips, 1.2 peers, bad values refused."""

from __future__ import annotations

import json
import math

import msgspec
import pytest

import protocols as P

ARCH = json.dumps({"model_type": "llama", "vocab_size": 320})


def setup(**kw) -> P.WorkerSetup:
    base = dict(samples_address="tcp://h:1", weights_announce="tcp://h:2", weights_fetch="tcp://h:3",
                model_config=ARCH, worker_slots=8, heartbeat_s=0.5, quant_format="int8", eos_token_ids=[2, 7],
                model_id="tiny:x", model_dir="/m", max_seq_len=512)
    return P.WorkerSetup(**(base | kw))


# What a 1.2 peer's structs looked like (the same tags, the fields of 1.2 only).
class Welcome12(msgspec.Struct, kw_only=True, omit_defaults=True, tag="welcome"):
    protocol_version: str
    server_id: str
    latest_version: int = -1
    config: dict[str, str] = {}


class Heartbeat12(msgspec.Struct, kw_only=True, omit_defaults=True, tag="heartbeat"):
    peer_id: str
    time: float
    stats: dict[str, float] = {}


class VersionUpdate12(msgspec.Struct, kw_only=True, omit_defaults=True, tag="version_update"):
    version: int
    metrics: dict[str, float] = {}


class Hello12(msgspec.Struct, kw_only=True, omit_defaults=True, tag="hello"):
    protocol_version: str
    role: str
    peer_id: str
    capabilities: dict[str, str] = {}


def test_protocol_minor_is_bumped_and_typed_peers_are_told_apart():
    assert (P.PROTOCOL_MAJOR, P.PROTOCOL_MINOR) == (1, 4) and P.PROTOCOL_VERSION == "1.4"
    assert P.speaks_typed_control("1.3") and P.speaks_typed_control("1.9")
    assert not P.speaks_typed_control("1.2") and not P.speaks_typed_control("1.0")
    assert not P.speaks_typed_control("garbage")


def test_welcome_with_a_typed_setup_round_trips_with_real_types():
    w = P.Welcome(protocol_version=P.PROTOCOL_VERSION, server_id="controller", latest_version=3, setup=setup())
    out = P.decode(P.encode(w))
    assert out == w and out.worker_setup() == setup()
    s = out.worker_setup()
    assert (s.worker_slots, s.heartbeat_s, s.eos_token_ids, s.max_seq_len) == (8, 0.5, [2, 7], 512)
    assert s.vocab_size() == 320 and out.config == {}
    r = P.Welcome(protocol_version=P.PROTOCOL_VERSION, server_id="c",
                  run=P.RunSetup(run_dir="/r", model_dir="/m", publish_formats=["int8", "fp32"]))
    assert P.decode(P.encode(r)).run_setup() == P.RunSetup(run_dir="/r", model_dir="/m", publish_formats=["int8", "fp32"])


def test_a_1_2_controllers_string_config_is_read_into_the_same_typed_setup():
    wire = msgspec.msgpack.encode(Welcome12(protocol_version="1.2", server_id="c", config=setup().to_legacy()))
    w = P.decode(wire)
    assert w.setup is None and w.worker_setup() == setup()
    run = msgspec.msgpack.encode(Welcome12(protocol_version="1.2", server_id="c",
                                           config={"run_dir": "/r", "model_dir": "/m", "publish_formats": "int8,fp32"}))
    assert P.decode(run).run_setup() == P.RunSetup(run_dir="/r", model_dir="/m", publish_formats=["int8", "fp32"])


def test_a_1_2_peer_reads_a_1_3_welcome_written_for_it_and_ignores_the_typed_fields():
    s = setup()
    w = P.Welcome(protocol_version=P.PROTOCOL_VERSION, server_id="c", setup=s, config=s.to_legacy())
    old = msgspec.msgpack.decode(P.encode(w), type=Welcome12)
    assert old.config["worker_slots"] == "8" and float(old.config["heartbeat_s"]) == 0.5
    assert json.loads(old.config["eos_token_ids"]) == [2, 7] and old.config["weights_fetch"] == "tcp://h:3"


def test_1_2_heartbeats_updates_and_hellos_decode_with_the_typed_defaults():
    hb = P.decode(msgspec.msgpack.encode(Heartbeat12(peer_id="w", time=1.0, stats={"version": 4.0})))
    assert hb.version == -1 and hb.stats["version"] == 4.0  # the controller falls back to the stats (test_core)
    vu = P.decode(msgspec.msgpack.encode(VersionUpdate12(version=2, metrics={"checkpoint": 1.0})))
    assert not (vu.checkpoint or vu.checkpointed or vu.done)  # flags of a 1.2 learner are read by who knows it
    hello = P.decode(msgspec.msgpack.encode(Hello12(protocol_version="1.2", role="learner", peer_id="l",
                                                    capabilities={"version": "5"})))
    assert hello.version == -1 and hello.capabilities["version"] == "5"
    # and the other way: a 1.2 peer ignores the new fields, and sees a checkpoint ack as a VersionUpdate
    ack = msgspec.msgpack.decode(P.encode(P.VersionUpdate(version=2, checkpointed=True)), type=VersionUpdate12)
    assert ack == VersionUpdate12(version=2)
    beat = msgspec.msgpack.decode(P.encode(P.Heartbeat(peer_id="w", time=1.0, version=3)), type=Heartbeat12)
    assert beat == Heartbeat12(peer_id="w", time=1.0)


def test_typed_control_flags_round_trip_and_are_not_metrics():
    for msg in (P.VersionUpdate(version=4, checkpoint=True), P.VersionUpdate(version=4, checkpointed=True),
                P.VersionUpdate(version=9, done=True, metrics={"eval/accuracy": 0.5})):
        out = P.decode(P.encode(msg))
        assert out == msg and set(out.metrics) <= {"eval/accuracy"}
    assert P.decode(P.encode(P.Heartbeat(peer_id="w", time=0.0, version=7))).version == 7
    assert P.decode(P.encode(P.Hello(protocol_version="1.3", role="learner", peer_id="l", version=12))).version == 12


@pytest.mark.parametrize("bad,match", [
    ({"worker_slots": 0}, "worker_slots must be >= 1"),
    ({"heartbeat_s": math.nan}, "heartbeat_s must be a finite number > 0"),
    ({"heartbeat_s": 0.0}, "rollout.heartbeat_s"),
    ({"max_seq_len": -1}, "max_seq_len must be >= 0"),
    ({"eos_token_ids": [3, -1]}, "eos_token_ids must be token ids >= 0"),
    ({"model_config": "[1, 2]"}, "model_config must be the JSON text of the model's config.json"),
    ({"model_config": "{not json"}, "model_config must be the JSON text"),
    ({"samples_address": ""}, "samples_address must be a non-empty string"),
    ({"weights_fetch": ""}, "weights_fetch must be a non-empty string"),
    ({"quant_format": ""}, "quant_format must be a non-empty string"),
])
def test_a_bad_worker_setup_is_refused_at_construction_and_at_decode(bad, match):
    with pytest.raises(ValueError, match=match):
        setup(**bad)
    wire = msgspec.msgpack.encode({"type": "welcome", "protocol_version": "1.3", "server_id": "c",
                                   "setup": msgspec.to_builtins(setup()) | bad})
    with pytest.raises(P.ProtocolError, match=match) as e:
        P.decode(wire)
    assert e.value.reason == "invalid"


@pytest.mark.parametrize("make,match", [
    (lambda: P.VersionUpdate(version=-1), "VersionUpdate.version must be >= 0"),
    (lambda: P.VersionUpdate(version=1, checkpoint=True, checkpointed=True), "not both"),
    (lambda: P.Heartbeat(peer_id="w", time=0.0, version=-2), "Heartbeat.version must be a weights version"),
    (lambda: P.Hello(protocol_version="1.3", role="learner", peer_id="l", version=-5), "Hello.version"),
    (lambda: P.RunSetup(run_dir="", model_dir="/m"), "RunSetup.run_dir must be a non-empty string"),
    (lambda: P.RunSetup(run_dir="/r", model_dir="/m", publish_formats=[""]), "publish_formats must name formats"),
])
def test_bad_typed_control_values_are_refused_with_the_fix(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("config,match", [
    ({}, "no 'samples_address'"),
    (setup().to_legacy() | {"worker_slots": "many"}, "legacy Welcome.config is unusable"),
    (setup().to_legacy() | {"eos_token_ids": "[1, \"x\"]"}, "eos_token_ids"),
    (setup().to_legacy() | {"worker_slots": "0"}, "worker_slots must be >= 1"),
])
def test_an_unusable_legacy_config_names_the_key(config, match):
    w = P.Welcome(protocol_version="1.2", server_id="c", config=config)
    with pytest.raises(ValueError, match=match):
        w.worker_setup()
    with pytest.raises(ValueError, match="does not describe its run"):
        P.Welcome(protocol_version="1.2", server_id="c", config={"model_dir": "/m"}).run_setup()
