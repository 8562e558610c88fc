"""The token embedding as int8 row codes (quant.embedding; asyncrl/quant/embedding.py): the actor's lookup, its
publication (one table with a tied int8 head), whole loads and deltas that leave a worker with the full
version's bytes."""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.quant import (
    ManifestMismatchError,
    QuantEmbedding,
    QuantError,
    apply_delta,
    code_change_frac,
    dequantize_int8,
    load_published,
    make_delta,
    publication_metrics,
    publish,
    quantize_int8_rows,
    quantize_model,
    quantizes_embedding,
)
from tests.unit.quant.conftest import make_tiny_qwen2
from tests.unit.quant.test_delta import same_bytes, versions

FORMATS = ("int8", "int8_wo", "fp8", "nvfp4", "mxfp4", "bf16")


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_embedding_looks_up_the_int8_rows(fmt):
    model = make_tiny_qwen2(seed=1)
    w = model.model.embed_tokens.weight.detach().clone()
    actor = quantize_model(copy.deepcopy(model), fmt, embedding=True)
    emb = actor.model.embed_tokens
    assert isinstance(emb, QuantEmbedding) and quantizes_embedding(actor)
    codes, scale = quantize_int8_rows(w)
    assert torch.equal(emb.qweight, codes) and torch.equal(emb.weight_scale, scale)
    ids = torch.tensor([[0, 5, 5, 63], [1, 2, 3, 4]])
    assert torch.equal(emb(ids), dequantize_int8(codes, scale)[ids])
    assert (emb(ids) - w[ids]).abs().max() <= scale.max() / 2 + 1e-9  # half a step at most
    assert not quantizes_embedding(quantize_model(copy.deepcopy(model), fmt))


@pytest.mark.parametrize("fmt", ["int8", "int8_wo", "nvfp4"])
def test_tied_int8_head_and_embedding_share_one_table(fmt):
    actor = quantize_model(make_tiny_qwen2(seed=2, tie=True), fmt, head=True, embedding=True)
    shared = actor.model.embed_tokens.qweight is getattr(actor.lm_head, "qweight", None)
    assert shared == (fmt in ("int8", "int8_wo"))  # nvfp4's head codes are no int8 table
    (sd,) = versions(1, seed=3, tie=True)
    pub = publish(sd, fmt, version=0, head=True, embedding=True)
    assert ("model.embed_tokens.qweight" in pub.tensors) == (not shared)
    assert "model.embed_tokens.weight" not in pub.tensors
    embed = [e for e in pub.manifest if e.name.startswith("model.embed_tokens.")]
    assert all(e.fmt == "int8" and not e.logical_shape for e in embed)
    # the per-weight metric counts the linears only
    n_linear = sum(e.logical_shape[0] * e.logical_shape[1] for e in pub.manifest if e.logical_shape)
    linear_bytes = sum(e.nbytes for e in pub.manifest if e.role != "full_precision" and e not in embed)
    assert publication_metrics(pub)["quant/linear_bytes_per_param"] == linear_bytes / n_linear


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("head", [False, True])
@pytest.mark.parametrize("fmt", ["int8", "nvfp4", "fp8"])
def test_delta_publication_with_an_int8_embedding_equals_the_full_publication_bit_for_bit(fmt, head, tie,
                                                                                          probe_ids):
    """Whole loads equal the worker's own conversion; a chain of deltas equals the whole load of every version,
    logits included; the embedding's codes travel as the few that flipped."""
    sds = versions(8, seed=3, tie=tie)
    pubs = [publish(sd, fmt, version=v, head=head, embedding=True) for v, sd in enumerate(sds)]

    def fresh() -> torch.nn.Module:
        return quantize_model(make_tiny_qwen2(seed=99, tie=tie), fmt, head=head, embedding=True)

    own = quantize_model(make_tiny_qwen2(seed=3, tie=tie), fmt, head=head, embedding=True)
    w = fresh()
    load_published(w, pubs[0])
    assert same_bytes(w, own)
    embed_sent = embed_whole = 0
    for prev, cur in zip(pubs, pubs[1:], strict=False):
        delta = make_delta(prev, cur)
        assert code_change_frac(prev, cur, delta) == code_change_frac(prev, cur)  # the linears' codes only
        for p, e in zip(delta.parts, delta.manifest, strict=True):
            if e.name.endswith("embed_tokens.qweight") or (tie and head and e.name == "lm_head.qweight"):
                embed_sent, embed_whole = embed_sent + p.nbytes, embed_whole + e.nbytes
        apply_delta(w, delta)
        full = fresh()
        load_published(full, cur)
        assert same_bytes(w, full), cur.version
        with torch.no_grad():
            assert torch.equal(w(probe_ids).logits, full(probe_ids).logits)
    assert 0 < embed_sent < 0.25 * embed_whole


def test_quantized_embedding_and_its_publication_must_agree():
    (sd,) = versions(1, seed=3)
    plain = quantize_model(make_tiny_qwen2(seed=9), "int8")
    with pytest.raises(ManifestMismatchError, match="quant.embedding the same"):
        load_published(plain, publish(sd, "int8", version=0, embedding=True))
    coded = quantize_model(make_tiny_qwen2(seed=9), "int8", embedding=True)
    with pytest.raises(ManifestMismatchError, match="quant.embedding the same"):
        load_published(coded, publish(sd, "int8", version=0))
    with pytest.raises(QuantError, match="set quant.embedding=false"):
        publish({k: v for k, v in sd.items() if "embed" not in k}, "int8", version=0, embedding=True)
    assert publish(sd, "fp32", version=0, embedding=True).checksum == publish(sd, "fp32", version=0).checksum
