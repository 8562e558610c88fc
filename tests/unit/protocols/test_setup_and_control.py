"""The typed setup, versions and control flags: round trips, bad values refused, the protocol floor (1.4)."""

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


def test_the_floor_is_1_4_and_older_or_other_major_peers_are_refused_naming_the_fix():
    assert (P.PROTOCOL_MAJOR, P.PROTOCOL_MINOR, P.PROTOCOL_FLOOR_MINOR) == (1, 8, 4) and P.PROTOCOL_VERSION == "1.8"
    assert P.version_refusal("1.4", "w") is None and P.version_refusal("1.9", "w") is None
    for old in ("1.0", "1.2", "1.3"):
        why = P.version_refusal(old, "peer 'w'")
        assert why is not None and f"peer 'w' speaks protocol {old}, older than 1.4" in why
        assert "upgrade asyncrl on that side" in why
        hello = P.Hello(protocol_version=old, role="generator", peer_id="w")
        reject = P.check_hello(hello)
        assert isinstance(reject, P.Reject) and reject.reason == why and reject.server_version == "1.8"
    assert "major version mismatch" in (P.version_refusal("2.4", "w") or "")
    assert "not MAJOR.MINOR" in (P.version_refusal("garbage", "w") or "")


def test_a_welcome_without_a_setup_names_the_upgrade():
    w = P.decode(P.encode(P.Welcome(protocol_version="1.2", server_id="c", config={"worker_slots": "8"})))
    with pytest.raises(ValueError, match=r"carries no worker setup; run a controller of protocol 1.4 or newer"):
        w.worker_setup()
    with pytest.raises(ValueError, match=r"carries no run setup; .*upgrade asyncrl"):
        w.run_setup()


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


def test_control_flags_round_trip_and_are_not_metrics():
    for msg in (P.VersionUpdate(version=4, checkpoint=True), P.VersionUpdate(version=4, checkpointed=True),
                P.VersionUpdate(version=9, done=True, metrics={"eval/accuracy": 0.5})):
        out = P.decode(P.encode(msg))
        assert out == msg and set(out.metrics) <= {"eval/accuracy"}
    assert P.decode(P.encode(P.Heartbeat(peer_id="w", time=0.0, version=7))).version == 7
    assert P.decode(P.encode(P.Hello(protocol_version="1.4", role="learner", peer_id="l", version=12))).version == 12


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
    wire = msgspec.msgpack.encode({"type": "welcome", "protocol_version": "1.4", "server_id": "c",
                                   "setup": msgspec.to_builtins(setup()) | bad})
    with pytest.raises(P.ProtocolError, match=match) as e:
        P.decode(wire)
    assert e.value.reason == "invalid"


@pytest.mark.parametrize("make,match", [
    (lambda: P.VersionUpdate(version=-1), "VersionUpdate.version must be >= 0"),
    (lambda: P.VersionUpdate(version=1, checkpoint=True, checkpointed=True), "not both"),
    (lambda: P.Heartbeat(peer_id="w", time=0.0, version=-2), "Heartbeat.version must be a weights version"),
    (lambda: P.Hello(protocol_version="1.4", role="learner", peer_id="l", version=-5), "Hello.version"),
    (lambda: P.RunSetup(run_dir="", model_dir="/m"), "RunSetup.run_dir must be a non-empty string"),
    (lambda: P.RunSetup(run_dir="/r", model_dir="/m", publish_formats=[""]), "publish_formats must name formats"),
])
def test_bad_control_values_are_refused_with_the_fix(make, match):
    with pytest.raises(ValueError, match=match):
        make()
