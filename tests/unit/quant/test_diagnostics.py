"""Per-publication diagnostics: code change fraction, quantisation error, KL vs full precision."""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.quant import (
    FORMATS,
    FormatMismatchError,
    ManifestMismatchError,
    code_change_frac,
    kl_vs_full_precision,
    make_delta,
    publication_metrics,
    publish,
    quantization_error,
    quantize_model,
)
from protocols.values import QUANTIZED_FORMATS
from tests.unit.quant.conftest import make_tiny_qwen2
from tests.unit.quant.test_delta import mixed_versions


def test_code_change_frac_counts_changed_elements_of_all_code_tensors():
    model = make_tiny_qwen2()
    sd = model.state_dict()
    a = publish(sd, "int8", version=0)
    assert code_change_frac(a, publish(sd, "int8", version=1)) == 0.0
    sd2 = dict(sd)
    w = sd["model.layers.0.mlp.up_proj.weight"].clone()
    w[0, :10] += 1.0  # moves weights of row 0 (a new row amax rescales the whole row)
    sd2["model.layers.0.mlp.up_proj.weight"] = w
    b = publish(sd2, "int8", version=1)
    qa = a.tensors["model.layers.0.mlp.up_proj.qweight"]
    qb = b.tensors["model.layers.0.mlp.up_proj.qweight"]
    n_total = sum(e.logical_shape[0] * e.logical_shape[1] for e in a.manifest if e.role == "codes")
    assert code_change_frac(a, b) == pytest.approx(int((qa != qb).sum()) / n_total)
    assert 0 < code_change_frac(a, b) < 0.05


def test_code_change_frac_compares_fp4_nibbles_and_ignores_padding():
    model = make_tiny_qwen2()  # down_proj in_features 80 -> mxfp4 pads to 96
    sd = model.state_dict()
    a = publish(sd, "mxfp4", version=0)
    sd2 = {k: (v.neg() if k.endswith("down_proj.weight") else v) for k, v in sd.items()}
    b = publish(sd2, "mxfp4", version=1)
    n_down = 2 * 48 * 80
    n_total = sum(e.logical_shape[0] * e.logical_shape[1] for e in a.manifest if e.role == "codes")
    # negation flips the sign bit of every nonzero code (zeros become -0, also a change)
    assert code_change_frac(a, b) == pytest.approx(n_down / n_total)


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
def test_code_change_frac_from_the_delta_equals_comparing_the_versions(fmt):
    """Counted from the delta's parts (a sparse part's listed codes, for fp4 their changed nibbles inside the
    logical columns; nothing for a same part; a dense part compared again), the fraction is the one comparing
    the two versions gives, exactly, over consecutive versions whose code tensors travel in all three kinds."""
    sds = mixed_versions(5, seed=31)
    sds[4] = {**sds[4], **{k: v for k, v in sds[3].items() if k.startswith("model.layers.1.")}}  # layer 1 stays
    q = sds[4]["model.layers.0.self_attn.q_proj.weight"] = sds[4]["model.layers.0.self_attn.q_proj.weight"].clone()
    q[:4, :2] *= -1  # both codes of a packed fp4 byte change
    sds.append({k: (v.neg() if k.endswith("down_proj.weight") else v) for k, v in sds[4].items()})  # flips all
    pubs = [publish(sd, fmt, version=v) for v, sd in enumerate(sds)]
    kinds = set()
    for prev, cur in zip(pubs, pubs[1:], strict=False):
        delta = make_delta(prev, cur)
        kinds |= {p.kind for p in delta.parts if p.name.endswith(".qweight")}
        frac = code_change_frac(prev, cur, delta)
        assert frac == code_change_frac(prev, cur) and frac > 0
    assert kinds == {"same", "sparse", "dense"}
    with pytest.raises(ManifestMismatchError, match="the delta is from version 0 to 1"):
        code_change_frac(pubs[1], pubs[2], make_delta(pubs[0], pubs[1]))


def test_code_change_frac_refuses_mixed_formats():
    sd = make_tiny_qwen2().state_dict()
    with pytest.raises(FormatMismatchError):
        code_change_frac(publish(sd, "int8", version=0), publish(sd, "fp8", version=1))


def test_quantization_error_orders_formats_by_precision():
    sd = make_tiny_qwen2().state_dict()
    err = {f: quantization_error(sd, publish(sd, f, version=0))["quant/rel_error_mean"] for f in FORMATS}
    assert err["fp32"] == 0.0
    assert err["bf16"] < err["int8"] < err["fp8"] < err["nvfp4"] < err["mxfp4"] < 0.2
    assert err["int8"] == err["int8_wo"]


def test_kl_vs_full_precision_is_zero_for_identical_models_and_respects_the_mask(probe_ids):
    model = make_tiny_qwen2()
    assert kl_vs_full_precision(model, copy.deepcopy(model), probe_ids) == pytest.approx(0.0, abs=1e-7)
    q = quantize_model(copy.deepcopy(model), "nvfp4")
    kl = kl_vs_full_precision(q, model, probe_ids)
    mask = torch.ones_like(probe_ids)
    assert kl_vs_full_precision(q, model, probe_ids, attention_mask=mask) == pytest.approx(kl, rel=1e-6)
    assert kl > 0


def test_publication_metrics_collects_everything_to_log():
    sd = make_tiny_qwen2().state_dict()
    prev = publish(sd, "nvfp4", version=0)
    cur = publish(sd, "nvfp4", version=1, aqn_sigma=0.01, aqn_seed=9)
    m = publication_metrics(cur, previous=prev, state_dict=sd)
    assert m["quant/code_change_frac"] == 0.0 and m["aqn/sigma"] == 0.01
    assert m["quant/bytes"] == cur.total_bytes() and 0.5 < m["quant/linear_bytes_per_param"] < 0.6
    assert 0 < m["quant/rel_error_mean"] <= m["quant/rel_error_max"]
