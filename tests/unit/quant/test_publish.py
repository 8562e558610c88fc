"""publish -> raw buffers -> load_published: bit-exact round trip and all-or-nothing validation."""

from __future__ import annotations

import copy
import dataclasses

import msgspec
import pytest
import torch

from asyncrl.quant import (
    FORMATS,
    ChecksumMismatchError,
    FormatMismatchError,
    ManifestMismatchError,
    NonFiniteWeightError,
    PublishedWeights,
    QuantError,
    load_published,
    publish,
    quantize_model,
)
from tests.unit.quant.conftest import make_tiny_qwen2


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu) else t


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        sa[k].dtype == sb[k].dtype and torch.equal(_bits(sa[k]), _bits(sb[k])) for k in sa
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_is_bit_exact_with_direct_quantisation(fmt, probe_ids):
    learner = make_tiny_qwen2(seed=1)
    direct = quantize_model(copy.deepcopy(learner), fmt)
    worker = quantize_model(make_tiny_qwen2(seed=2), fmt)  # different weights before the load
    pub = publish(learner.state_dict(), fmt, version=3)
    shipped = PublishedWeights.from_raw(pub.header(), [tuple(r) for r in pub.to_raw()])
    load_published(worker, shipped)
    assert _same_state(worker, direct)
    with torch.no_grad():
        assert torch.equal(worker(probe_ids).logits, direct(probe_ids).logits)


def test_publication_holds_contiguous_cpu_copies_and_a_deterministic_checksum(tiny_model):
    sd = tiny_model.state_dict()
    a = publish(sd, "int8", version=1)
    b = publish(sd, "int8", version=1)
    assert a.checksum == b.checksum and len(a.checksum) == 64
    assert publish(sd, "int8", version=2).checksum != a.checksum
    for t in a.tensors.values():
        assert t.is_contiguous() and t.device.type == "cpu"
        assert all(t.untyped_storage().data_ptr() != s.untyped_storage().data_ptr() for s in sd.values())
    names = [e.name for e in a.manifest]
    assert names == sorted(a.tensors) == sorted(names)
    q = next(e for e in a.manifest if e.name == "model.layers.0.self_attn.q_proj.qweight")
    assert (q.dtype, q.shape, q.role, q.fmt, q.nbytes, q.logical_shape) == (
        "int8",
        (48, 48),
        "codes",
        "int8",
        48 * 48,
        (48, 48),
    )
    assert a.total_bytes() == sum(t.numel() * t.element_size() for t in a.tensors.values())


@pytest.mark.parametrize("fmt", ["int8", "nvfp4", "fp32"])
def test_small_published_tensors_share_a_few_blocks_and_hold_exactly_their_values(tiny_model, fmt):
    # The small tensors of a publication live in 64 MiB blocks (each its own mapping, not glibc's heap):
    # every tensor is still its own contiguous, correctly typed view with the values published one by one.
    from asyncrl.quant.buffers import Blocks as _Blocks

    sd = tiny_model.state_dict()
    pub = publish(sd, fmt, version=1)
    storages = {t.untyped_storage().data_ptr() for t in pub.tensors.values()}
    assert len(pub.tensors) > 20 and len(storages) <= 2
    assert all(t.untyped_storage().nbytes() == _Blocks.BLOCK for t in pub.tensors.values())
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in pub.tensors.values())
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))  # no overlap
    assert all(t.data_ptr() % _Blocks.ALIGN == 0 for t in pub.tensors.values())
    pub.verify()  # every digest still matches its tensor's bytes
    blocks = _Blocks()
    for name, t in pub.tensors.items():
        src = t.clone()
        assert torch.equal(blocks.snapshot(src, src), t), name


@pytest.mark.parametrize("fmt", ["int8", "nvfp4", "mxfp4"])
def test_codes_written_into_the_publication_buffers_equal_the_one_shot_quantiser(fmt):
    # publish passes its buffers to the quantiser (`alloc`): the codes are written once, where they are
    # sent from, small ones in a block and large ones (> _Blocks.SMALL) in a mapping of their own
    from asyncrl.quant import quantize_weight
    from asyncrl.quant.buffers import Blocks as _Blocks

    g = torch.Generator().manual_seed(3)
    sd = {"model.layers.0.mlp.down_proj.weight": torch.randn(96, 80, generator=g),
          "model.layers.0.mlp.up_proj.weight": torch.randn(2304, 2048, generator=g),  # int8 codes 4.5 MiB
          "model.embed_tokens.weight": torch.randn(1200, 1024, generator=g)}  # fp32, 4.7 MiB: copied
    pub = publish(sd, fmt, version=2)
    for name, w in sd.items():
        if "embed" in name:
            out = pub.tensors[name]
            assert torch.equal(out, w) and out.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
            continue
        prefix = name[: -len("weight")]
        for suffix, ref in quantize_weight(w, fmt).items():
            got = pub.tensors[prefix + suffix]
            assert got.dtype == ref.dtype and got.is_contiguous(), (name, suffix)
            assert torch.equal(got.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)), (name, suffix)
    big = pub.tensors["model.layers.0.mlp.up_proj.qweight"]
    small = pub.tensors["model.layers.0.mlp.down_proj.qweight"]
    assert small.untyped_storage().nbytes() == _Blocks.BLOCK
    big_bytes = big.numel() * big.element_size()  # int8: 4.5 MiB; fp4's packed codes: 2.25 MiB
    assert big.untyped_storage().nbytes() == (big_bytes if big_bytes > _Blocks.SMALL else _Blocks.BLOCK)
    pub.verify()
    sd["model.embed_tokens.weight"].add_(1.0)  # the learner moves on: the publication does not
    pub.verify()


@pytest.mark.parametrize("fmt", ["int8", "fp32"])
def test_a_pool_reuses_the_buffers_of_a_publication_nothing_views_any_more(tiny_model, fmt):
    # A publisher's BufferPool gives a version the memory of an earlier one only once no tensor,
    # numpy array or memoryview (what a zmq frame holds while it is sent) shows it; the bytes are
    # those of a publication without a pool.
    import gc

    from asyncrl.quant import BufferPool
    from asyncrl.quant.wire import raw_bytes

    sd = tiny_model.state_dict()
    pool = BufferPool()
    first = publish(sd, fmt, version=1, pool=pool)
    first_ptrs = {t.untyped_storage().data_ptr() for t in first.tensors.values()}
    frame = raw_bytes(next(iter(first.tensors.values())))  # a sender still holds one tensor's bytes
    del first
    gc.collect()
    second = publish(sd, fmt, version=2, pool=pool)  # the block under `frame` is still in use
    second_ptrs = {t.untyped_storage().data_ptr() for t in second.tensors.values()}
    assert not first_ptrs & second_ptrs
    del frame
    gc.collect()
    assert pool.free_bytes() > 0
    third = publish(sd, fmt, version=3, pool=pool)  # the first version's memory, given back
    assert {t.untyped_storage().data_ptr() for t in third.tensors.values()} <= first_ptrs
    assert not second_ptrs & {t.untyped_storage().data_ptr() for t in third.tensors.values()}
    fresh = publish(sd, fmt, version=3)
    assert third.checksum == fresh.checksum
    third.verify()
    for name, t in fresh.tensors.items():
        assert torch.equal(third.tensors[name].view(torch.uint8), t.view(torch.uint8)), name
    # free memory the pool keeps is bounded by one publication's buffers (trim, called by publish)
    del second, third
    gc.collect()
    from asyncrl.quant.buffers import Blocks as _Blocks

    assert pool.free_bytes() == 2 * _Blocks.BLOCK  # the tiny model's publications fit one block each
    fourth = publish(sd, fmt, version=4, pool=pool)  # takes one, and trims the rest to one publication
    assert pool.free_bytes() <= _Blocks.BLOCK
    fourth.verify()


def test_publish_does_not_modify_the_learner_state(tiny_model):
    sd = tiny_model.state_dict()
    before = {k: v.clone() for k, v in sd.items()}
    pub = publish(sd, "fp32", version=0, aqn_sigma=0.1, aqn_seed=5)
    pub.tensors["model.norm.weight"].add_(1.0)
    assert all(torch.equal(before[k], v) for k, v in tiny_model.state_dict().items())


def test_linear_bytes_per_parameter_per_format():
    from asyncrl.quant import publication_metrics

    sd = make_tiny_qwen2(hidden=64, inter=96).state_dict()  # every K divisible by 32: no padding
    n_rows = 2 * (64 + 32 + 32 + 64 + 96 + 96 + 64)  # out_features of q, k, v, o, gate, up, down
    n_param = 2 * (64 * 64 * 2 + 32 * 64 * 2 + 96 * 64 * 2 + 64 * 96)
    expected = {
        "fp32": 4.0,
        "bf16": 2.0,
        "int8": 1.0 + 4 * n_rows / n_param,
        "int8_wo": 1.0 + 4 * n_rows / n_param,
        "fp8": 1.0 + 4 * n_rows / n_param,
        "nvfp4": 0.5 + 1 / 16 + 4 * 14 / n_param,
        "mxfp4": 0.5 + 1 / 32,
    }
    for fmt, bpp in expected.items():
        got = publication_metrics(publish(sd, fmt, version=0))["quant/linear_bytes_per_param"]
        assert got == pytest.approx(bpp, rel=1e-12), fmt


def _published_and_worker(fmt="int8"):
    learner = make_tiny_qwen2(seed=1)
    worker = quantize_model(make_tiny_qwen2(seed=2), fmt)
    return publish(learner.state_dict(), fmt, version=4), worker


def _assert_unchanged(worker, snapshot):
    assert all(torch.equal(_bits(snapshot[k]), _bits(v)) for k, v in worker.state_dict().items())


def test_checksum_mismatch_names_the_corrupted_tensor_and_keeps_the_old_weights():
    pub, worker = _published_and_worker()
    snapshot = {k: v.clone() for k, v in worker.state_dict().items()}
    raw = pub.to_raw()
    i = next(i for i, r in enumerate(raw) if r.name == "model.layers.1.mlp.down_proj.qweight")
    data = bytearray(raw[i].data)
    data[7] ^= 0x01
    raw[i] = raw[i]._replace(data=bytes(data))
    bad = PublishedWeights.from_raw(pub.header(), raw)
    with pytest.raises(ChecksumMismatchError, match="model.layers.1.mlp.down_proj.qweight"):
        load_published(worker, bad)
    _assert_unchanged(worker, snapshot)


def test_tampered_manifest_fails_the_publication_checksum():
    pub, worker = _published_and_worker()
    header = pub.header()
    header["version"] = 5
    with pytest.raises(ChecksumMismatchError, match="checksum"):
        load_published(worker, PublishedWeights.from_raw(header, pub.to_raw()))


def test_manifest_tensor_mismatches_are_named():
    pub, worker = _published_and_worker()
    missing = dataclasses.replace(
        pub, tensors={k: v for k, v in pub.tensors.items() if k != "model.norm.weight"}
    )
    with pytest.raises(ManifestMismatchError, match="model.norm.weight"):
        load_published(worker, missing)
    extra = dataclasses.replace(pub, tensors={**pub.tensors, "stray": torch.zeros(1)})
    with pytest.raises(ManifestMismatchError, match="stray"):
        load_published(worker, extra)
    name = "model.layers.0.self_attn.k_proj.weight_scale"
    wrong = dataclasses.replace(pub, tensors={**pub.tensors, name: pub.tensors[name].double()})
    with pytest.raises(ManifestMismatchError, match=name):
        load_published(worker, wrong)


def test_wrong_byte_count_in_a_raw_buffer_is_named():
    pub, _ = _published_and_worker()
    raw = pub.to_raw()
    raw[0] = raw[0]._replace(data=bytes(raw[0].data)[:-1])
    with pytest.raises(ManifestMismatchError, match=raw[0].name):
        PublishedWeights.from_raw(pub.header(), raw)


def test_format_mismatch_is_refused_before_anything_is_copied():
    pub, _ = _published_and_worker("int8")
    worker = quantize_model(make_tiny_qwen2(seed=2), "fp8")
    snapshot = {k: v.clone() for k, v in worker.state_dict().items()}
    with pytest.raises(FormatMismatchError, match="'int8'"):
        load_published(worker, pub)
    _assert_unchanged(worker, snapshot)


def test_publication_for_another_architecture_is_refused_and_model_kept():
    learner = make_tiny_qwen2(seed=1, hidden=64)
    worker = quantize_model(make_tiny_qwen2(seed=2), "nvfp4")
    snapshot = {k: v.clone() for k, v in worker.state_dict().items()}
    with pytest.raises(ManifestMismatchError, match="model.embed_tokens.weight"):
        load_published(worker, publish(learner.state_dict(), "nvfp4", version=1))
    _assert_unchanged(worker, snapshot)


def test_non_finite_weight_is_refused_at_publish_naming_the_tensor(tiny_model):
    sd = dict(tiny_model.state_dict())
    sd["model.layers.0.mlp.gate_proj.weight"] = sd["model.layers.0.mlp.gate_proj.weight"].clone()
    sd["model.layers.0.mlp.gate_proj.weight"][3, 3] = float("inf")
    with pytest.raises(NonFiniteWeightError, match="model.layers.0.mlp.gate_proj.weight"):
        publish(sd, "mxfp4", version=1)
    sd2 = dict(tiny_model.state_dict())
    sd2["model.norm.weight"] = torch.full_like(sd2["model.norm.weight"], float("nan"))
    with pytest.raises(NonFiniteWeightError, match="model.norm.weight"):
        publish(sd2, "int8", version=1)


def test_non_finite_value_in_a_received_publication_is_refused_and_model_kept():
    pub, worker = _published_and_worker("fp8")
    snapshot = {k: v.clone() for k, v in worker.state_dict().items()}
    name = "model.layers.1.self_attn.o_proj.weight_scale"
    t = pub.tensors[name].clone()
    t[0] = float("nan")
    # A peer that computes digests of its own bytes: manifest and checksum are consistent.
    sd_like = {**pub.tensors, name: t}
    forged = _reseal(pub, sd_like)
    with pytest.raises(NonFiniteWeightError, match=name):
        load_published(worker, forged)
    _assert_unchanged(worker, snapshot)


def test_an_e8m0_nan_scale_byte_in_a_received_publication_is_refused_and_model_kept():
    pub, worker = _published_and_worker("mxfp4")
    snapshot = {k: v.clone() for k, v in worker.state_dict().items()}
    name = next(e.name for e in pub.manifest if pub.tensors[e.name].dtype == torch.float8_e8m0fnu)
    t = pub.tensors[name].clone()
    t.view(torch.uint8)[0, 0] = 255  # the NaN byte of E8M0 (fp4.E8M0_NAN), which no quantiser writes
    with pytest.raises(NonFiniteWeightError, match="E8M0 scale byte 255"):
        load_published(worker, _reseal(pub, {**pub.tensors, name: t}))
    _assert_unchanged(worker, snapshot)


def _reseal(pub: PublishedWeights, tensors: dict) -> PublishedWeights:
    from asyncrl.quant.wire import checksum_of, digest, header_dict

    manifest = [msgspec.structs.replace(e, digest=digest(tensors[e.name])) for e in pub.manifest]
    checksum = checksum_of(header_dict(pub.version, pub.fmt, pub.aqn_seed, pub.aqn_sigma, manifest))
    return dataclasses.replace(pub, tensors=tensors, manifest=manifest, checksum=checksum)


def test_tied_embeddings_load_from_either_name():
    learner = make_tiny_qwen2(seed=1, tie=True)
    worker = quantize_model(make_tiny_qwen2(seed=2, tie=True), "int8")
    sd = {k: v for k, v in learner.state_dict().items() if k != "lm_head.weight"}
    load_published(worker, publish(sd, "int8", version=1))
    assert torch.equal(worker.lm_head.weight, learner.model.embed_tokens.weight)


def test_version_must_be_a_non_negative_integer(tiny_model):
    with pytest.raises(QuantError, match="version"):
        publish(tiny_model.state_dict(), "int8", version=-1)


def test_tied_weights_are_published_once_and_loaded_through_the_tie(probe_ids):
    learner = make_tiny_qwen2(seed=1, tie=True)
    pub = publish(learner.state_dict(), "nvfp4", version=1)
    # the first name in sorted order is kept
    assert "lm_head.weight" in pub.tensors and "model.embed_tokens.weight" not in pub.tensors
    worker = quantize_model(make_tiny_qwen2(seed=2, tie=True), "nvfp4")
    load_published(worker, pub)
    direct = quantize_model(copy.deepcopy(learner), "nvfp4")
    with torch.no_grad():
        assert torch.equal(worker(probe_ids).logits, direct(probe_ids).logits)


def test_malformed_header_is_a_manifest_error():
    pub, _ = _published_and_worker()
    header = pub.header()
    del header["manifest"]
    with pytest.raises(ManifestMismatchError, match="malformed publication header"):
        PublishedWeights.from_raw(header, pub.to_raw())


@pytest.mark.parametrize("fmt", ["int8", "nvfp4"])
def test_a_quantized_head_is_published_beside_its_tied_embedding_and_loads_bit_identically(fmt, probe_ids):
    from asyncrl.engine.native.weights import apply_weights
    from asyncrl.quant import quantizes_head

    learner = make_tiny_qwen2(seed=1, tie=True)
    pub = publish(learner.state_dict(), fmt, version=1, head=True)
    assert "model.embed_tokens.weight" in pub.tensors and "lm_head.weight" not in pub.tensors
    assert pub.tensors["lm_head.qweight"].dtype == (torch.uint8 if fmt == "nvfp4" else torch.int8)
    # the same publication from a state dict that leaves the tied duplicate out
    sd = {k: v for k, v in learner.state_dict().items() if k != "lm_head.weight"}
    assert publish(sd, fmt, version=1, head=True).checksum == pub.checksum
    # fp32 converts nothing: the head changes neither its publication nor its actor
    assert publish(sd, "fp32", version=1, head=True).checksum == publish(sd, "fp32", version=1).checksum
    assert not quantizes_head(quantize_model(make_tiny_qwen2(tie=True), "fp32", head=True))
    worker = quantize_model(make_tiny_qwen2(seed=2, tie=True), fmt, head=True)
    assert quantizes_head(worker) and not quantizes_head(quantize_model(make_tiny_qwen2(tie=True), fmt))
    load_published(worker, pub)
    direct = quantize_model(copy.deepcopy(learner), fmt, head=True)
    plain = quantize_model(copy.deepcopy(learner), fmt)
    engine_path = quantize_model(make_tiny_qwen2(seed=3, tie=True), fmt, head=True)
    apply_weights(engine_path, sd, fmt, version=1)  # a plain state dict, as a local update
    with torch.no_grad():
        got = worker(probe_ids).logits
        assert torch.equal(got, direct(probe_ids).logits) and torch.equal(engine_path(probe_ids).logits, got)
        assert not torch.equal(got, plain(probe_ids).logits)  # the head's rounding shows in the logits
        assert torch.equal(worker.model.embed_tokens.weight, learner.model.embed_tokens.weight)  # lookup stays fp32


def test_a_worker_and_a_publication_that_disagree_on_the_head_name_quant_lm_head():
    learner = make_tiny_qwen2(seed=1, tie=True)
    with_head = publish(learner.state_dict(), "int8", version=1, head=True)
    without = publish(learner.state_dict(), "int8", version=1)
    plain_worker = quantize_model(make_tiny_qwen2(seed=2, tie=True), "int8")
    head_worker = quantize_model(make_tiny_qwen2(seed=2, tie=True), "int8", head=True)
    for worker, pub in ((plain_worker, with_head), (head_worker, without)):
        snapshot = copy.deepcopy(worker.state_dict())
        with pytest.raises(ManifestMismatchError, match="quant.lm_head"):
            load_published(worker, pub)
        _assert_unchanged(worker, snapshot)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int8_wo", "fp8", "nvfp4", "mxfp4"])
def test_quantizing_on_the_weights_device_gives_the_bytes_of_the_host_quantiser(fmt):
    # A CUDA learner's weights are quantised on its GPU and only the results are copied to the host. That
    # branch is run here on CPU tensors: the same code path, with the host as the device.
    from asyncrl.quant.buffers import Blocks, quantize_for_send, quantizes_on_device

    g = torch.Generator().manual_seed(21)
    for shape in ((96, 80), (40, 200), (2304, 520)):  # fp4 padding; a large one in a mapping of its own
        w = torch.randn(*shape, generator=g) * torch.exp(torch.randn(shape[0], 1, generator=g))
        direct, staged = Blocks(), Blocks()
        a = quantize_for_send(w, fmt, name="w", blocks=direct, on_device=False)
        b = quantize_for_send(w, fmt, name="w", blocks=staged, on_device=True)
        assert a.keys() == b.keys()
        for suffix in a:
            assert b[suffix].device.type == "cpu" and b[suffix].is_contiguous()
            assert b[suffix].data_ptr() in staged._made  # copied once, into a send buffer
            assert torch.equal(a[suffix].reshape(-1).view(torch.uint8), b[suffix].reshape(-1).view(torch.uint8))
    assert not quantizes_on_device(torch.zeros(2, 2))
    assert quantizes_on_device(torch.zeros(2, 2, device="meta"))  # any accelerator: quantise where it lives
