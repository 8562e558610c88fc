"""What a worker's model holds (asyncrl/quant/held.py): a whole load skips the tensors the model holds already,
and the model still ends up with the version's bytes, and the caches a fresh load builds, bit for bit.

Versions are small updates of a tiny Qwen2 (test_delta.py) in which, as under LoRA, the full-precision tensors
(the embedding, the norms) and one decoder layer stay as they were: a whole version repeats them.
"""

from __future__ import annotations

import pytest
import torch

from asyncrl.quant import ChecksumMismatchError, apply_delta, load_published, make_delta, publish
from asyncrl.quant.held import held_digests
from asyncrl.quant.published import PublishedWeights
from asyncrl.transport.publication import from_wire, to_wire
from tests.unit.quant.test_delta import CACHED, mixed_versions, same_bytes, worker, worker_on


def lora_like_versions(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``mixed_versions`` in which every 1-D tensor, the embedding and layer 1 keep their first value."""
    sds = mixed_versions(n, seed)
    for sd in sds[1:]:
        for k, v in sds[0].items():
            if v.dim() == 1 or "embed_tokens" in k or ".layers.1." in k:
                sd[k] = v.clone()
    return sds


def received(pub: PublishedWeights) -> PublishedWeights:
    """``pub`` as a worker rebuilds it from the frames it received (tensors over writable buffers)."""
    ann, frames = to_wire(pub)
    return from_wire(ann, [bytearray(f) for f in frames])


def fresh(fmt: str, pub: PublishedWeights, kernel: str | None = None, fused: bool = False) -> torch.nn.Module:
    w = worker(fmt) if kernel is None else worker_on(fmt, kernel, fused)
    load_published(w, received(pub))
    return w


@pytest.mark.parametrize(("fmt", "kernel", "fused"), CACHED)
def test_whole_loads_of_consecutive_versions_equal_a_fresh_load_caches_included(fmt, kernel, fused):
    pubs = [publish(sd, fmt, version=v) for v, sd in enumerate(lora_like_versions(4))]
    digests = [{e.name: e.digest for e in p.manifest} for p in pubs]
    same = [k for k in digests[0] if digests[1][k] == digests[0][k]]
    assert "model.embed_tokens.weight" in same and len(same) < len(digests[0])  # some tensors repeat, not all
    w = worker_on(fmt, kernel, fused)
    for pub in pubs:
        load_published(w, received(pub))
        assert same_bytes(w, fresh(fmt, pub, kernel, fused))
        assert held_digests(w) == {e.name: e.digest for e in pub.manifest}


def test_a_whole_load_reads_no_byte_of_a_tensor_the_model_holds_and_checks_every_other():
    pubs = [publish(sd, "int8", version=v) for v, sd in enumerate(lora_like_versions(2))]
    w = worker("int8")
    load_published(w, received(pubs[0]))
    same = [e.name for e, old in zip(pubs[1].manifest, pubs[0].manifest, strict=True) if e.digest == old.digest]
    moved = [e.name for e, old in zip(pubs[1].manifest, pubs[0].manifest, strict=True) if e.digest != old.digest]
    assert "model.embed_tokens.weight" in same and moved
    bad = received(pubs[1])
    bad.tensors[moved[0]].reshape(-1).view(torch.uint8)[0] ^= 1  # a byte the model needs: refused, unchanged
    with pytest.raises(ChecksumMismatchError, match="digest"):
        load_published(w, bad)
    assert same_bytes(w, fresh("int8", pubs[0]))
    unused = received(pubs[1])
    unused.tensors["model.embed_tokens.weight"].reshape(-1).view(torch.uint8)[0] ^= 1  # held: never read
    load_published(w, unused)
    assert same_bytes(w, fresh("int8", pubs[1]))


@pytest.mark.parametrize("name", ["model.norm.weight", "model.layers.1.self_attn.q_proj.qweight",
                                  "model.layers.1.self_attn.q_proj.weight_scale"])
def test_a_held_tensor_written_since_its_load_is_loaded_again(name):
    """The record is a hint: a tensor whose bytes changed since the load that recorded it (written by anything
    else) no longer hashes to its digest, and the next version loads it, and rebuilds its linear's cache."""
    pubs = [publish(sd, "int8", version=v) for v, sd in enumerate(lora_like_versions(2))]
    w = worker_on("int8", "int_mm_fp32", False)
    load_published(w, received(pubs[0]))
    digest = {e.name: e.digest for e in pubs[1].manifest}[name]
    assert held_digests(w)[name] == digest  # the record says the model holds the next version's bytes
    t = w.state_dict()[name]
    with torch.no_grad():
        t.reshape(-1).view(torch.uint8)[:3] ^= 1  # and its bytes are not those any more
    load_published(w, received(pubs[1]))
    assert same_bytes(w, fresh("int8", pubs[1], "int_mm_fp32", False))


def test_a_delta_records_what_the_model_holds_and_a_whole_load_after_it_skips_the_same_tensors():
    pubs = [publish(sd, "int8", version=v) for v, sd in enumerate(lora_like_versions(3))]
    w = worker_on("int8", "int_mm_fp32", True)
    load_published(w, received(pubs[0]))
    apply_delta(w, make_delta(pubs[0], pubs[1]))
    assert held_digests(w) == {e.name: e.digest for e in pubs[1].manifest}
    load_published(w, received(pubs[2]))
    assert same_bytes(w, fresh("int8", pubs[2], "int_mm_fp32", True))
