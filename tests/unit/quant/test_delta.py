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
    QuantLinear,
    apply_delta,
    fuse_siblings,
    load_published,
    make_delta,
    publish,
    quantize_model,
)
from asyncrl.quant.delta import UNDO_WHOLE_FRAC, element_bits
from asyncrl.quant.formats import quantize_weight
from asyncrl.quant.linear import LINEAR_CLASSES, DecodedLinear
from asyncrl.quant.publish import HELD_CHECKSUM
from tests.unit.quant.conftest import make_tiny_qwen2

FORMATS = ("int8", "nvfp4", "mxfp4", "fp8", "fp32")


def versions(n: int, seed: int = 0, step: float = 2e-5, *, hold_row_max: float = 0.0, tie: bool = False):
    """``n`` state dicts of one model, each a small update of the one before. ``hold_row_max``: the share of a
    step's 2-D updates that leave each row's largest |w| where it is, so its row and block scales mostly stay
    and only codes flip (what a cache rebuilt element by element must follow; the others move every element,
    scales too). ``tie``: a tied model, whose dicts keep the tie (one tensor under both names, as the learner's
    own state dict has it)."""
    model = make_tiny_qwen2(seed=seed, tie=tie)
    g = torch.Generator().manual_seed(seed + 100)
    out = []
    for _ in range(n):
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if tie:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        out.append(sd)
        with torch.no_grad():
            for p in model.parameters():
                d = torch.randn(p.shape, generator=g) * step
                if hold_row_max and p.dim() == 2 and float(torch.rand((), generator=g)) < hold_row_max:
                    d[p.abs() == p.abs().amax(dim=1, keepdim=True)] = 0.0
                p.add_(d)
    return out


def mixed_versions(n: int, seed: int = 0, step: float = 8e-6):
    """``versions`` with a smaller step (about a percent of the int8 codes flip, as under LoRA), most of whose
    2-D updates hold each row's largest |w|."""
    return versions(n, seed, step, hold_row_max=0.7)


def same_bytes(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Every tensor of the state dicts and every buffer, the compute caches included, bit for bit."""
    sa, sb = a.state_dict(), b.state_dict()
    ba, bb = dict(a.named_buffers()), dict(b.named_buffers())
    return sa.keys() == sb.keys() and ba.keys() == bb.keys() and all(
        torch.equal(x[k].reshape(-1).view(torch.uint8), y[k].reshape(-1).view(torch.uint8))
        for x, y in ((sa, sb), (ba, bb)) for k in y)


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


CACHED = [("int8", "int_mm_fp32", False), ("int8", "int_mm_fp32", True), ("fp8", "fp8_emul", False),
          ("fp8", "fp8_emul", True), *((f, k, fused) for f in ("int8_wo", "nvfp4", "mxfp4")
                                       for k, fused in (("wo_fp32", False), ("wo_bf16", False), ("wo_bf16", True)))]
"""(format, kernel, sibling groups fused) of every compute cache a quantised linear holds."""


def worker_on(fmt: str, kernel: str, fused: bool) -> torch.nn.Module:
    """A converted worker whose linears run ``kernel`` (the cache it holds), siblings fused or each on its own."""
    w = worker(fmt)
    for m in w.modules():
        if isinstance(m, QuantLinear):
            m.use_kernel(kernel)  # dissolves the groups quantize_model formed
    if fused:
        assert fuse_siblings(w) == 4
    assert any(n.endswith(("_w_codes", "_w_decoded")) for n, _ in w.named_buffers())
    return w


def written_linears(delta) -> tuple[int, int]:
    """(linears whose codes alone changed, linears whose scales changed) in ``delta``."""
    by_mod: dict[str, set[str]] = {}
    for p in delta.parts:
        if p.kind != "same":
            mod, _, suffix = p.name.rpartition(".")
            by_mod.setdefault(mod, set()).add(suffix)
    return (sum(s == {"qweight"} for s in by_mod.values()),
            sum(bool(s & {"weight_scale", "weight_global_scale"}) for s in by_mod.values()))


@pytest.mark.parametrize(("fmt", "kernel", "fused"), CACHED)
def test_delta_publication_rebuilds_the_caches_a_full_load_builds_bit_for_bit(fmt, kernel, fused, probe_ids):
    """After each delta of a chain the caches are rebuilt only where the delta wrote; every buffer, caches
    included, equals a worker that loaded the version whole, for linears whose codes alone changed and for
    linears whose row, block or global scales changed too."""
    pubs = [publish(sd, fmt, version=v) for v, sd in enumerate(mixed_versions(10, seed=21))]
    w = worker_on(fmt, kernel, fused)
    load_published(w, pubs[0])
    storage = {n: b.data_ptr() for n, b in w.named_buffers()}
    codes_only = scales = 0
    for prev, cur in zip(pubs, pubs[1:], strict=False):
        delta = make_delta(prev, cur)
        a, b = written_linears(delta)
        codes_only, scales = codes_only + a, scales + b
        apply_delta(w, delta)
        full = worker_on(fmt, kernel, fused)
        load_published(full, cur)
        assert same_bytes(w, full), cur.version
        with torch.no_grad():
            assert torch.equal(w(probe_ids).logits, full(probe_ids).logits)
    assert codes_only > 0 and scales > 0  # both kinds of change were applied
    assert {n: b.data_ptr() for n, b in w.named_buffers()} == storage  # caches rebuilt in place


@pytest.mark.parametrize(("fmt", "kernel"), sorted({(f, k) for f, k, _ in CACHED}))
@pytest.mark.parametrize("change", ["codes", "row", "block", "all"])
def test_delta_publication_of_codes_and_scales_rebuilds_a_linear_cache_bit_for_bit(fmt, kernel, change):
    """A linear whose codes alone, a row's scale, a block's scales or every scale changed, written element by
    element as a delta writes them: its cache, rebuilt where they were written, is the cache of a linear made
    from the new tensors (80 inputs: mxfp4 pads the last block)."""
    lin = torch.nn.Linear(80, 48)
    top = int(lin.weight.abs().amax(dim=1).argmax())  # the row holding the weight's amax: the global scale
    w = lin.weight.detach().clone()
    rows = [r for r in range(48) if r != top]
    w[rows[5], 3] *= -1  # a few codes change sign (their blocks' amax stays)
    w[rows[9], 40] *= -1
    if change == "row":
        w[rows[3]] *= 0.5  # its row scale, or every block scale of the row, halves
    elif change == "block":
        w[rows[7], :32] *= 0.25
    elif change == "all":
        w *= 1.5
    m = LINEAR_CLASSES[fmt].from_linear(lin)
    m.use_kernel(kernel)
    new = quantize_weight(w, fmt)
    changed = {}
    with torch.no_grad():
        for suffix, t in new.items():
            mine = element_bits(getattr(m, suffix))
            idx = torch.nonzero(mine != element_bits(t)).reshape(-1)
            mine[idx] = element_bits(t)[idx]
            changed[suffix] = idx
        m.refresh(changed)
    assert changed["qweight"].numel()
    ref = LINEAR_CLASSES[fmt](80, 48, new, lin.bias)
    ref.use_kernel(kernel)
    name = "_w_decoded" if isinstance(m, DecodedLinear) else "_w_codes"
    assert torch.equal(element_bits(getattr(m, name)), element_bits(getattr(ref, name)))


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


@pytest.mark.parametrize(("step", "many"), [(2e-5, False), (4e-5, True), (1e-4, True)])
def test_delta_publication_that_fails_after_sparse_parts_of_many_elements_restores_every_one(step, many):
    """A sparse part that writes more than 1/UNDO_WHOLE_FRAC of its tensor is recorded as a copy of the tensor,
    one of fewer by its old elements: either way a failure after it puts every byte back."""
    pubs = [publish(sd, "int8", version=v) for v, sd in enumerate(versions(2, seed=9, step=step))]
    w = worker_on("int8", "int_mm_fp32", False)
    load_published(w, pubs[0])
    before = copy.deepcopy(w)
    delta = make_delta(pubs[0], pubs[1])
    sizes = {e.name: e.nbytes for e in delta.manifest}  # int8 codes: a byte an element
    sparse = [p for p in delta.parts if p.kind == "sparse" and p.name.endswith(".qweight")]
    assert any(p.count * UNDO_WHOLE_FRAC > sizes[p.name] for p in sparse) == many  # recorded whole, or not
    moving = [p for p in delta.parts if p.kind != "same"]
    last = max(i for i, p in enumerate(moving) if p.kind == "sparse")
    frame = delta.payloads[last].clone()
    frame[-1] ^= 1  # the last new value of the last sparse part: its digest fails after every other is written
    delta.payloads[last] = frame
    with pytest.raises(ChecksumMismatchError, match="digest"):
        apply_delta(w, delta)
    assert same_bytes(w, before)


def test_delta_publication_with_a_damaged_dense_part_is_refused_before_anything_is_written():
    pubs = [publish(sd, "int8", version=v) for v, sd in enumerate(versions(2, seed=5))]
    w = worker_on("int8", "int_mm_fp32", False)
    load_published(w, pubs[0])
    before = copy.deepcopy(w)
    delta = make_delta(pubs[0], pubs[1])
    moving = [p for p in delta.parts if p.kind != "same"]
    dense = [i for i, p in enumerate(moving) if p.kind == "dense" and p.name.endswith(".weight_scale")]
    assert dense and any(p.kind == "sparse" for p in moving)
    good = delta.payloads[dense[-1]]
    frame = good.clone()
    frame[0] ^= 1  # the lowest mantissa bit of a scale: still finite and > 0, the bytes are not the version's
    delta.payloads[dense[-1]] = frame
    with pytest.raises(ChecksumMismatchError, match="dense part"):
        apply_delta(w, delta)
    assert same_bytes(w, before)
    delta.payloads[dense[-1]] = good  # undamaged, it applies: every tensor, caches included, as a full load
    apply_delta(w, delta)
    full = worker_on("int8", "int_mm_fp32", False)
    load_published(full, pubs[1])
    assert same_bytes(w, full)


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


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj._w_codes", "model.layers.0.self_attn.q_proj.nope",
                                  "model.nowhere.weight_scale"])
def test_delta_publication_of_a_tensor_the_state_dict_lacks_is_refused(name):
    """A delta's tensors are the model's state-dict tensors: a compute cache, or a name no module holds, is not."""
    sds = versions(2, seed=8)
    extra = [{**sd, name: torch.full((4,), float(v + 1))} for v, sd in enumerate(sds)]
    pubs = [publish(sd, "int8", version=v) for v, sd in enumerate(extra)]
    w = worker_on("int8", "int_mm_fp32", True)
    load_published(w, publish(sds[0], "int8", version=0))
    vars(w)[HELD_CHECKSUM] = pubs[0].checksum  # as if it held the publication with the extra tensor
    before = copy.deepcopy(w)
    with pytest.raises(ManifestMismatchError, match="no such tensor"):
        apply_delta(w, make_delta(pubs[0], pubs[1]))
    assert same_bytes(w, before)


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
