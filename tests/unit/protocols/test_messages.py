"""Round trips, validation and fuzzing of the wire contract."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import protocols as P
from tests.unit.protocols.strategies import MESSAGES, any_message, payload_for

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_protocols_imports_without_torch_zmq_or_numpy():
    code = ("import sys, protocols; bad = [m for m in ('torch', 'zmq', 'numpy') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_message_type_has_a_strategy():
    assert set(MESSAGES) == set(P.MESSAGE_TYPES)


@pytest.mark.parametrize("typ", P.MESSAGE_TYPES, ids=lambda t: t.__name__)
def test_every_message_round_trips_through_the_union_decoder(typ):
    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(MESSAGES[typ])
    def check(msg):
        frames = P.encode_frames(msg, payload_for(msg))
        out, payload = P.decode_frames(frames)
        assert out == msg and type(out) is typ
        assert P.decode(frames[0], typ) == msg  # the cached per-type decoder agrees
        if payload is not None:
            assert bytes(payload) == payload_for(msg)

    check()


def test_decoder_is_cached_per_type():
    assert P.decoder_for(P.Hello) is P.decoder_for(P.Hello)


@FUZZ
@given(st.binary(max_size=256))
def test_random_bytes_raise_only_protocol_error(data):
    try:
        P.decode(data)
    except P.ProtocolError as e:
        assert e.reason in {"malformed", "unknown_tag", "invalid"}


@FUZZ
@given(any_message, st.data())
def test_truncated_and_bitflipped_frames_raise_only_protocol_error(msg, data):
    buf = bytearray(P.encode(msg))
    if data.draw(st.booleans()):
        buf = buf[: data.draw(st.integers(0, max(0, len(buf) - 1)))]
    elif buf:
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] ^= data.draw(st.integers(1, 255))
    try:
        P.decode(bytes(buf))
    except P.ProtocolError:
        pass


def test_unknown_tag_is_reported_as_such():
    with pytest.raises(P.ProtocolError) as e:
        P.decode(msgspec.msgpack.encode({"type": "launch_missiles"}))
    assert e.value.reason == "unknown_tag"


def test_array_length_mismatch_names_dtype_shape_and_sizes():
    with pytest.raises(ValueError, match="byte length 7 does not match dtype float32"):
        P.check_array("x", P.Array(dtype="float32", shape=(2,), data=b"1234567"))
    with pytest.raises(ValueError, match="prompt_ids: array byte length 3 does not match dtype int32"):
        P.RolloutAssignment(group_id="g", sample_ids=["g/0"], n_samples=1, params=P.SamplingParams(),
                            prompt_ids=P.Array(dtype="int32", shape=(1,), data=b"abc"))
    wire = msgspec.msgpack.encode(
        {"type": "finished_sample", "sample_id": "s", "group_id": "g", "worker_id": "w", "finish_reason": "stop",
         "prompt_ids": ["int32", [1], b"\0\0\0\0"], "response_ids": ["int32", [2], b"\0" * 8],
         "behav_logp": ["float32", [2], b"\0" * 4], "versions": ["int32", [2], b"\0" * 8]}
    )
    with pytest.raises(P.ProtocolError, match="does not match dtype float32"):
        P.decode(wire)


def test_finished_sample_requires_one_logprob_and_version_per_token():
    a = P.Array.from_numpy(np.arange(3, dtype=np.int32))
    with pytest.raises(ValueError, match="every response token needs one log-prob and one version"):
        P.FinishedSample(sample_id="s", group_id="g", prompt_ids=a, response_ids=a,
                         behav_logp=P.Array.from_numpy(np.zeros(2, np.float32)), versions=a,
                         finish_reason="stop", worker_id="w")


def test_array_numpy_round_trip_is_a_view_with_dtype_and_shape():
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    arr = P.Array.from_numpy(x)
    np.testing.assert_array_equal(arr.to_numpy(), x)
    assert arr.to_numpy().shape == (3, 4)


def test_weight_chunk_needs_its_payload_frame_of_the_declared_size():
    chunk = P.WeightChunk(version=1, index=0, count=1, name="w", dtype="uint8", shape=(4,), nbytes=4)
    with pytest.raises(P.ProtocolError, match="without its payload"):
        P.decode_frames([P.encode(chunk)])
    with pytest.raises(P.ProtocolError, match="declares 4 bytes, payload has 3"):
        P.decode_frames([P.encode(chunk), b"abc"])
    with pytest.raises(P.ProtocolError, match="single frame"):
        P.decode_frames([P.encode(P.Shutdown()), b"extra"])


def test_handshake_refuses_another_major_version_and_says_both():
    ok = P.Hello(protocol_version=f"{P.PROTOCOL_MAJOR}.{P.PROTOCOL_MINOR + 7}", role="generator", peer_id="w")
    assert P.check_hello(ok) is None
    bad = P.Hello(protocol_version=f"{P.PROTOCOL_MAJOR + 1}.0", role="generator", peer_id="w")
    reject = P.check_hello(bad)
    assert isinstance(reject, P.Reject)
    assert f"{P.PROTOCOL_MAJOR + 1}.0" in reject.reason and P.PROTOCOL_VERSION in reject.reason


def test_appended_field_with_default_is_readable_by_old_and_new_peers():
    class HeartbeatV2(msgspec.Struct, kw_only=True, omit_defaults=True, tag="heartbeat"):
        peer_id: str
        time: float
        stats: dict[str, float] = {}
        gpu_util: float = 0.0

    new_wire = msgspec.msgpack.encode(HeartbeatV2(peer_id="p", time=1.0, gpu_util=0.5))
    assert P.decode(new_wire) == P.Heartbeat(peer_id="p", time=1.0)
    old_wire = P.encode(P.Heartbeat(peer_id="p", time=1.0))
    assert msgspec.msgpack.decode(old_wire, type=HeartbeatV2).gpu_util == 0.0
