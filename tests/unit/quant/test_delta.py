"""Delta publication (asyncrl/quant/delta.py): a worker that applies deltas holds the full version's bytes.

Versions come from small updates of a tiny Qwen2 (each weight moved by ~1e-5 of a ~0.02 scale, as an RL step
moves them), so most codes stay and a few flip, as in a real run.
"""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.quant import (
    ChecksumMismatchError,
    ManifestMismatchError,
    apply_delta,
    load_published,
    make_delta,
    publish,
    quantize_model,
)
from tests.unit.quant.conftest import make_tiny_qwen2

FORMATS = ("int8", "nvfp4", "mxfp4", "fp8", "fp32")


def versions(n: int, seed: int = 0, step: float = 2e-5):
    """``n`` state dicts of one model, each a small update of the one before."""
    model = make_tiny_qwen2(seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    out = []
    for _ in range(n):
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * step)
    return out


def same_bytes(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        torch.equal(sa[k].reshape(-1).view(torch.uint8), sb[k].reshape(-1).view(torch.uint8)) for k in sb)


def worker(fmt: str) -> torch.nn.Module:
    return quantize_model(make_tiny_qwen2(seed=99), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_delta_publication_over_many_versions_equals_the_full_publication_bit_for_bit(fmt, probe_ids):
    sds = versions(12)
    pubs = [publish(sd, fmt, version=v) for v, sd in enumerate(sds)]
    w = worker(fmt)
    load_published(w, pubs[0])
    sparse = 0
    for prev, cur in zip(pubs, pubs[1:], strict=False):
        delta = make_delta(prev, cur)
        assert delta.total_bytes() <= delta.full_bytes() and 0.0 < delta.changed_frac() <= 1.0
        sparse += sum(p.kind == "sparse" for p in delta.parts)
        apply_delta(w, delta)
        full = worker(fmt)
        load_published(full, cur)
        assert same_bytes(w, full), cur.version
        with torch.no_grad():
            assert torch.equal(w(probe_ids).logits, full(probe_ids).logits)  # caches refreshed too
    if fmt != "fp32":  # quantized codes mostly stay: their tensors travel as the few changed elements
        assert sparse > 0
        delta = make_delta(pubs[0], pubs[1])
        codes = [(p.nbytes, e.nbytes) for p, e in zip(delta.parts, delta.manifest, strict=True)
                 if e.name.endswith(".qweight")]
        assert sum(sent for sent, _ in codes) < 0.25 * sum(whole for _, whole in codes)


def test_delta_publication_to_a_worker_that_joined_late_starts_from_its_full_copy():
    pubs = [publish(sd, "int8", version=v) for v, sd in enumerate(versions(8, seed=3))]
    late = worker("int8")
    load_published(late, pubs[5])  # joined at version 5: a full copy
    for prev, cur in zip(pubs[5:], pubs[6:], strict=False):
        apply_delta(late, make_delta(prev, cur))
    full = worker("int8")
    load_published(full, pubs[7])
    assert same_bytes(late, full)


def test_delta_publication_to_a_worker_that_missed_a_version_is_refused_and_leaves_it_unchanged():
    pubs = [publish(sd, "int8", version=v) for v, sd in enumerate(versions(4, seed=4))]
    w = worker("int8")
    load_published(w, pubs[1])
    before = copy.deepcopy(w)
    with pytest.raises(ChecksumMismatchError, match="fetch the version whole"):
        apply_delta(w, make_delta(pubs[2], pubs[3]))  # it holds version 1, the delta starts at 2
    assert same_bytes(w, before)
    fresh = worker("int8")  # holds no publication at all
    with pytest.raises(ChecksumMismatchError, match="no publication"):
        apply_delta(fresh, make_delta(pubs[0], pubs[1]))


def test_delta_publication_with_a_damaged_value_is_refused_and_every_written_element_restored():
    pubs = [publish(sd, "int8", version=v) for v, sd in enumerate(versions(2, seed=5))]
    w = worker("int8")
    load_published(w, pubs[0])
    before = copy.deepcopy(w)
    delta = make_delta(pubs[0], pubs[1])
    damaged = [i for i, p in enumerate(p for p in delta.parts if p.kind != "same") if p.kind == "sparse"]
    assert damaged
    frame = delta.payloads[damaged[-1]].clone()
    frame[-1] ^= 1  # one bit of the last new value of the last sparse part
    delta.payloads[damaged[-1]] = frame
    with pytest.raises(ChecksumMismatchError, match="digest"):
        apply_delta(w, delta)
    assert same_bytes(w, before)


def test_delta_publication_with_indices_outside_a_tensor_is_refused():
    pubs = [publish(sd, "int8", version=v) for v, sd in enumerate(versions(2, seed=6))]
    w = worker("int8")
    load_published(w, pubs[0])
    delta = make_delta(pubs[0], pubs[1])
    i = next(i for i, p in enumerate([p for p in delta.parts if p.kind != "same"]) if p.kind == "sparse")
    frame = delta.payloads[i].clone()
    frame[:4].view(torch.int32).fill_(1 << 30)
    delta.payloads[i] = frame
    with pytest.raises(ManifestMismatchError, match="outside the tensor"):
        apply_delta(w, delta)


def test_no_delta_between_formats_or_backwards():
    a, b = versions(2, seed=7)
    p_int8, p_fp4 = publish(a, "int8", version=0), publish(b, "nvfp4", version=1)
    with pytest.raises(Exception, match="no delta"):
        make_delta(p_int8, p_fp4)
    with pytest.raises(ManifestMismatchError, match="older version"):
        make_delta(publish(b, "int8", version=1), p_int8)


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "int32", "int64"])
@pytest.mark.parametrize("n", [0, 1, 7, 9, 4099, 70_001])
def test_changed_elements_finds_exactly_the_elements_that_differ(dtype, n, monkeypatch):
    """The word-at-a-time search agrees with an element-by-element comparison: every size (tails that fill
    no word), every width, changes in one word side by side, chunk edges (small chunks), and the limit."""
    import numpy as np

    from asyncrl.quant import delta as delta_mod

    monkeypatch.setattr(delta_mod, "COMPARE_WORDS", 64)
    rng = np.random.default_rng(n)
    old = rng.integers(-100, 100, n).astype(dtype)
    new = old.copy()
    flip = rng.choice(n, size=min(n, 3 + n // 50), replace=False) if n else np.empty(0, dtype=np.int64)
    new[flip] += 1
    if n >= 2:
        new[:2] += 1  # two changes inside one word
    expected = np.flatnonzero(old != new)
    found = delta_mod.changed_elements(old, new, limit=n)
    assert found is not None and found.dtype == np.int64
    assert np.array_equal(found, expected)
    if expected.size:
        assert delta_mod.changed_elements(old, new, limit=expected.size - 1) is None
        assert np.array_equal(delta_mod.changed_elements(old, new, limit=expected.size), expected)


@pytest.mark.parametrize("dtype", ["int8", "int32"])
def test_changed_elements_counts_a_mostly_changed_chunk_and_still_finds_its_elements(dtype, monkeypatch):
    """Chunks where most words differ are counted first and searched at the end: the same indices, in order,
    beside sparse chunks; and None once the count passes the limit."""
    import numpy as np

    from asyncrl.quant import delta as delta_mod

    monkeypatch.setattr(delta_mod, "COMPARE_WORDS", 16)
    rng = np.random.default_rng(1)
    old = rng.integers(-100, 100, 1003).astype(dtype)
    new = old.copy()
    new[200:600] += 1  # dense chunks in the middle
    new[[3, 900, 1001]] += 1  # sparse ones around them, and the tail
    expected = np.flatnonzero(old != new)
    assert np.array_equal(delta_mod.changed_elements(old, new, limit=expected.size), expected)
    assert delta_mod.changed_elements(old, new, limit=expected.size - 1) is None
