"""The fast paths of publication: exact finiteness by one reduction, the comparison-based E2M1
encoder, XXH3 digests (and the sha256 digests of older publishers), zero-copy rebuild from frames."""

from __future__ import annotations

import dataclasses
import hashlib

import msgspec
import numpy as np
import pytest
import torch

from asyncrl.quant import ChecksumMismatchError, load_published, publish, quantize_model
from asyncrl.quant.e2m1 import BOUNDARIES as _BOUNDARIES
from asyncrl.quant.fp4 import e2m1_encode
from asyncrl.quant.int8 import all_finite
from asyncrl.quant.wire import checksum_of, digest, digest_matches, header_dict, raw_bytes
from asyncrl.transport.publication import from_wire, to_wire
from tests.unit.quant.conftest import make_tiny_qwen2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_all_finite_finds_a_single_nan_or_inf_at_any_position(dtype):
    t = torch.randn(37, 19).to(dtype)  # odd sizes: vector bodies and scalar tails both covered
    assert all_finite(t) and all_finite(t[:0])
    flat = t.view(-1)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for i in range(flat.numel()):
            old = flat[i].item()
            flat[i] = bad
            assert not all_finite(t), (bad, i)
            flat[i] = old


def test_e2m1_encode_equals_bucketize_on_every_boundary_tie_and_random_values():
    edges = torch.cat([_BOUNDARIES, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])])
    specials = torch.tensor([0.0, -0.0, 6.0, 7.0, 1e30, float("inf"), 1e-45, 0.5, 1.0, 4.0])
    v = torch.cat([edges, torch.nextafter(edges, torch.full_like(edges, 10.0)),
                   torch.nextafter(edges, torch.zeros_like(edges)), specials,
                   torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 3])
    v = torch.cat([v, -v])
    ref = torch.bucketize(v.abs(), _BOUNDARIES, right=False).to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)
    assert torch.equal(e2m1_encode(v), ref)


def test_digests_are_xxh3_and_sha256_digests_of_older_publishers_still_verify():
    t = torch.arange(10, dtype=torch.float32)
    d = digest(t)
    assert d.startswith("xxh3_128:") and len(d) == len("xxh3_128:") + 32
    assert digest_matches(t, d) and not digest_matches(t + 1, d)
    legacy = "sha256:" + hashlib.sha256(raw_bytes(t)).hexdigest()
    assert digest_matches(t, legacy) and not digest_matches(t + 1, legacy)
    with pytest.raises(ValueError, match="no known algorithm"):
        digest_matches(t, "md5:abc")


def test_a_1_0_publication_with_sha256_manifest_loads_and_corruption_is_still_caught():
    model = make_tiny_qwen2(seed=0)
    pub = publish(model.state_dict(), "int8", version=3)
    # what a 1.0 publisher sent: sha256 digests in the manifest (TensorSpec.sha256 on the wire)
    manifest = [msgspec.structs.replace(e, digest="sha256:" + hashlib.sha256(raw_bytes(pub.tensors[e.name])).hexdigest())
                for e in pub.manifest]
    old = dataclasses.replace(pub, manifest=manifest, checksum=checksum_of(
        header_dict(pub.version, pub.fmt, pub.aqn_seed, pub.aqn_sigma, manifest)))
    announce, buffers = to_wire(old)
    assert all(s.sha256 and s.digest.startswith("sha256:") for s in announce.manifest)
    # a 1.0 peer sends no digest field at all
    wire = msgspec.to_builtins(announce)
    wire["manifest"] = [{k: v for k, v in e.items() if k != "digest"} for e in wire["manifest"]]
    legacy = msgspec.msgpack.decode(msgspec.msgpack.encode(wire), type=type(announce))
    assert all(s.digest == "sha256:" + s.sha256 for s in legacy.manifest)  # read as the same manifest
    actor = quantize_model(make_tiny_qwen2(seed=1), "int8")
    load_published(actor, from_wire(legacy, [bytes(b) for b in buffers]))
    bad = [bytearray(b) for b in buffers]
    bad[0][0] ^= 1
    fresh = quantize_model(make_tiny_qwen2(seed=1), "int8")  # `actor` holds these bytes already: it reads none
    with pytest.raises(ChecksumMismatchError, match="digest"):
        load_published(fresh, from_wire(legacy, [bytes(b) for b in bad]))


def _bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def test_from_wire_views_received_read_only_frames_without_copying():
    model = make_tiny_qwen2(seed=0)
    pub = publish(model.state_dict(), "nvfp4", version=1)
    announce, buffers = to_wire(pub)
    frames = [bytes(b) for b in buffers]  # read-only, like received zmq frames
    rebuilt = from_wire(announce, frames)
    for spec, frame in zip(announce.manifest, frames, strict=True):
        t = rebuilt.tensors[spec.name]
        assert _bytes(t) == frame
        if t.numel():  # the tensor is the frame's memory (aligned frames are never copied)
            assert t.data_ptr() == np.frombuffer(frame, np.uint8).ctypes.data
    own = from_wire(announce, frames, copy=True)
    assert all(_bytes(own.tensors[k]) == _bytes(rebuilt.tensors[k]) for k in own.tensors)
    actor = quantize_model(make_tiny_qwen2(seed=1), "nvfp4")
    load_published(actor, rebuilt)  # verifies digests and checksum on the views
