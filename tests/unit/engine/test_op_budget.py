"""Op budgets of one static decode step, per format, on the kernels an sm_90 GPU runs.

A decode step is launch-bound on a GPU: every op that computes something is at least one kernel launch. Here a
2-layer Qwen2 with random weights (every dimension a multiple of 16, so fp8 takes ``scaled_mm``) is converted to
each format, every quantised linear is put on the kernel ``select_kernel`` picks for a CUDA device of compute
capability 9.0 with Triton (``int_mm_compiled``, ``scaled_mm``, ``wo_triton``, ``bf16``), and one static ``step()``
runs under a dispatch-mode counter. All of these kernels execute on a CPU: ``torch._int_mm`` and
``torch._scaled_mm`` have CPU implementations, the custom quantisation ops (asyncrl/quant/ops.py) dispatch once
whatever their device implementation is. Two things differ on a real GPU and are not seen here: ``int_mm`` pads
batches of <= 16 rows to 17 (one more launch per int8 GEMM), and ops the CUDA build implements with several
kernels (sort, SDPA) count once.

Two counts: ``ops``, every aten op dispatched (views included: each costs host time in an eager step), and
``launches``, the ops that compute (not views, not casts to the dtype a tensor already has: what a CUDA graph
replays). Each format is held to explicit numbers, per layer (the same for both layers) and per step, and the
quantised W8A8 formats to no more launches per layer than bf16. A change that adds an op fails here: raise the
number only with the reason in the commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from asyncrl.engine import GenRequest, SamplingParams
from asyncrl.engine.native import decoder
from asyncrl.engine.native.engine import NativeEngine
from asyncrl.quant import fuse_siblings
from asyncrl.quant.kernels import select_kernel
from asyncrl.quant.linear import QuantLinear

SM90 = (9, 0)
LAYERS = 2


@dataclass(frozen=True)
class Budget:
    layer_ops: int
    layer_launches: int
    step_ops: int
    step_launches: int


BUDGETS: dict[str, Budget] = {
    # Qwen2 layer on the sm_90 kernel choice: 2 RMSNorms (6 launches each), fused q/k/v GEMM + one epilogue,
    # one RoPE pass over the q and k heads, 2 K/V cache writes, SDPA, o_proj, fused gate/up + SiLU * up, down_proj,
    # 2 residual adds. fp32 runs HF's own nn.Linear modules (unfused, RoPE per q and k). The weight-only formats
    # run wo_triton, one custom op per projection (not fused by sibling group: 3 more ops, 1 fewer launch).
    "fp32": Budget(layer_ops=54, layer_launches=34, step_ops=221, step_launches=134),
    "bf16": Budget(layer_ops=65, layer_launches=35, step_ops=243, step_launches=136),
    "int8": Budget(layer_ops=69, layer_launches=35, step_ops=251, step_launches=136),
    "fp8": Budget(layer_ops=70, layer_launches=32, step_ops=253, step_launches=130),
    "nvfp4": Budget(layer_ops=68, layer_launches=34, step_ops=249, step_launches=134),
    "mxfp4": Budget(layer_ops=68, layer_launches=34, step_ops=249, step_launches=134),
    "int8_wo": Budget(layer_ops=68, layer_launches=34, step_ops=249, step_launches=134),
}


class _Counter(TorchDispatchMode):
    """Every aten (and custom) op dispatched, and whether it launches: it writes (a mutable schema) or returns a
    tensor whose storage is none of its inputs' (a view or a no-op cast returns an input's storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {a.untyped_storage().data_ptr() for a in _tensors((args, kwargs))}
        outs = [t.untyped_storage().data_ptr() for t in _tensors(out)]
        launches = func._schema.is_mutable or any(p not in ins for p in outs)
        self.ops.append((str(func.overloadpacket.__name__), launches))
        return out


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).eval()


def _engine(fmt: str) -> NativeEngine:
    """A static-step engine with 3 live rows, every quantised linear on the sm_90 kernel choice, siblings fused."""
    engine = NativeEngine(_model(), quant_format=fmt, max_batch_size=4, decode_step="static", max_seq_len=256)
    model = engine._model
    assert model is not None
    cuda = torch.device("cuda")  # asked about, nothing runs there
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.use_kernel(select_kernel(m.fmt, cuda, m.out_features, m.in_features, capability=SM90, compiler=True))
    fuse_siblings(model)
    engine.submit([GenRequest(f"g{i}", [1, 5, 6, 7 + i], SamplingParams(max_new_tokens=40, top_k=4,
                                                                        stop_token_ids=(), seed=i))
                   for i in range(3)])
    engine.step()  # prefill: the rows go live
    engine.step()
    return engine


@dataclass(frozen=True)
class Count:
    layers: list[list[tuple[str, bool]]]  # each decoder layer's ops, in order
    step: list[tuple[str, bool]]  # the whole step's


def _count(engine: NativeEngine) -> Count:
    """One static step (3 rows, the bucket path CUDA graphs take), split at each layer's input RMSNorm and at the
    final norm (forward pre-hooks mark where the counter stands)."""
    model = engine._model
    assert model is not None and engine._static is not None
    marks: list[int] = []
    counter = _Counter()
    norms = [layer.input_layernorm for layer in model.model.layers] + [model.model.norm]
    handles = [n.register_forward_pre_hook(lambda *_: marks.append(len(counter.ops))) for n in norms]
    st = engine._static
    st.pad = True
    try:
        st.decode(3, 8, True)  # the bucket's first run, then the step counted
        marks.clear()
        with counter:
            st.decode(3, 9, True)
    finally:
        for h in handles:
            h.remove()
    assert len(marks) == LAYERS + 1
    return Count([counter.ops[a:b] for a, b in pairwise(marks)], counter.ops)


def _launches(ops: list[tuple[str, bool]]) -> int:
    return sum(launch for _, launch in ops)


@pytest.fixture(scope="module")
def counts() -> dict[str, Count]:
    out = {}
    for fmt in BUDGETS:
        engine = _engine(fmt)
        out[fmt] = _count(engine)
        engine.close()
    return out


@pytest.mark.parametrize("fmt", list(BUDGETS))
def test_op_budget_per_layer_and_per_step(counts, fmt):
    c, budget = counts[fmt], BUDGETS[fmt]
    # the last window also holds the step's ``x[:, 0]`` before the final norm
    assert c.layers[1][: len(c.layers[0])] == c.layers[0], "every layer runs the same ops"
    layer = c.layers[0]
    got = Budget(len(layer), _launches(layer), len(c.step), _launches(c.step))
    assert got == Budget(budget.layer_ops, budget.layer_launches, budget.step_ops, budget.step_launches), (
        f"{fmt}: {got} (one layer: {' '.join(n + ('' if launch else '*') for n, launch in layer)}; * = no launch)")


def test_op_budget_w8a8_layers_launch_no_more_than_bf16(counts):
    bf16 = _launches(counts["bf16"].layers[0])
    for fmt in ("int8", "fp8"):
        assert _launches(counts[fmt].layers[0]) <= bf16, fmt


def test_op_budget_w8a8_quantise_each_projection_group_in_one_op(counts):
    """int8 and fp8 layers: one activation quantisation op per projection group (q/k/v, o, gate/up, down), and
    for int8 one epilogue op per group: no eager quantisation ops between the norm and the GEMM."""
    names = {fmt: [n for n, _ in counts[fmt].layers[0]] for fmt in ("int8", "fp8")}
    assert names["int8"].count("quant_act_int8") == 4 and names["int8"].count("int8_epilogue") == 4
    assert names["int8"].count("_int_mm") == 4
    assert names["fp8"].count("quant_act_fp8") == 4 and names["fp8"].count("_scaled_mm") == 4
    for layer in names.values():
        assert not {"abs", "amax", "div", "div_", "clamp_", "round_", "linalg_vector_norm"} & set(layer), layer


def test_op_budget_counts_an_added_op(monkeypatch):
    """The budgets see one more op per layer: here a copy of every MLP output."""
    engine = _engine("int8")
    before = _count(engine)
    real = decoder.mlp_decode
    monkeypatch.setattr("asyncrl.engine.native.static_step.mlp_decode", lambda layer, h: real(layer, h).clone())
    after = _count(engine)
    engine.close()
    for a, b in zip(before.layers, after.layers, strict=True):
        assert (len(b), _launches(b)) == (len(a) + 1, _launches(a) + 1)
    assert (len(after.step), _launches(after.step)) == (len(before.step) + LAYERS, _launches(before.step) + LAYERS)
