"""One manifest type: ``protocols.TensorSpec`` is what quant builds, the transport ships and engines load."""

from __future__ import annotations

import msgspec
import pytest

import protocols as P
from asyncrl.quant import load_published, publish, quantize_model
from asyncrl.quant.wire import checksum_of, entry_dict, entry_from_dict, header_dict
from asyncrl.transport.publication import from_wire, to_wire
from tests.unit.quant.conftest import make_tiny_qwen2

# The keys a 1.0-1.2 publisher's canonical header held per entry (its checksum covers exactly these).
HEADER_KEYS = {"name", "dtype", "shape", "fmt", "role", "nbytes", "digest", "logical_shape"}


@pytest.mark.parametrize("fmt", ["int8", "nvfp4"])
def test_the_published_manifest_travels_unchanged_and_loads(fmt):
    pub = publish(make_tiny_qwen2(seed=0).state_dict(), fmt, version=2)
    assert all(type(e) is P.TensorSpec for e in pub.manifest)
    announce, buffers = to_wire(pub)
    assert announce.manifest == pub.manifest  # no conversion on the way out
    received = P.decode(P.encode(announce))
    assert received.manifest == pub.manifest  # nor on the way in
    rebuilt = from_wire(received, [bytes(b) for b in buffers])
    assert rebuilt.manifest == pub.manifest and rebuilt.checksum == pub.checksum
    load_published(quantize_model(make_tiny_qwen2(seed=1), fmt), rebuilt)


def test_the_canonical_header_keeps_its_1_2_form():
    pub = publish(make_tiny_qwen2(seed=0).state_dict(), "int8", version=1)
    for e in pub.manifest:
        d = entry_dict(e)
        assert set(d) == HEADER_KEYS and entry_from_dict(d) == e
        assert d["logical_shape"] is None if e.role in ("full_precision", "scale") else isinstance(d["logical_shape"], list)
    codes = next(e for e in pub.manifest if e.role == "codes")
    assert entry_dict(codes)["logical_shape"] == list(codes.logical_shape) and codes.logical_shape
    # a header written with the 1.2 dict form (sha256 digests, no digest key) gives the same checksum
    legacy = [{k: v for k, v in entry_dict(e).items() if k != "digest"} | {"sha256": "ab" * 32} for e in pub.manifest]
    entries = [entry_from_dict(d) for d in legacy]
    assert all(e.digest == "sha256:" + "ab" * 32 and e.sha256 == "ab" * 32 for e in entries)
    assert checksum_of(header_dict(1, "int8", None, 0.0, entries)) == checksum_of(
        header_dict(1, "int8", None, 0.0, [msgspec.structs.replace(e, sha256="") for e in entries]))


def test_digest_and_the_1_0_sha256_field_always_agree():
    a = P.TensorSpec(name="w", dtype="int8", shape=(4,), nbytes=4, sha256="cd" * 32)
    assert a.digest == "sha256:" + "cd" * 32
    b = P.TensorSpec(name="w", dtype="int8", shape=(4,), nbytes=4, digest="sha256:" + "cd" * 32)
    assert b.sha256 == "cd" * 32 and a == b and P.decode(P.encode(a), P.TensorSpec) == a
    c = P.TensorSpec(name="w", dtype="int8", shape=(4,), nbytes=4, digest="xxh3_128:" + "0" * 32)
    assert c.sha256 == ""  # a 1.0 reader finds no sha256 it could check, as before


def test_a_weight_chunk_is_built_from_and_checked_against_its_manifest_entry():
    spec = P.TensorSpec(name="m.q.qweight", dtype="int8", shape=(4, 4), nbytes=16, role="codes", fmt="int8")
    chunk = P.WeightChunk.for_entry(spec, version=7, index=2, count=3)
    assert (chunk.name, chunk.dtype, chunk.shape, chunk.nbytes, chunk.count) == ("m.q.qweight", "int8", (4, 4), 16, 3)
    assert chunk.describes(spec, version=7, index=2)
    assert not chunk.describes(spec, version=6, index=2) and not chunk.describes(spec, version=7, index=1)
    assert not chunk.describes(msgspec.structs.replace(spec, shape=(16,)), version=7, index=2)
    assert not chunk.describes(msgspec.structs.replace(spec, nbytes=15), version=7, index=2)
