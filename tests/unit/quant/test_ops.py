"""The quantisation custom ops (asyncrl/quant/ops.py): one op each, the rules' bits, a fake implementation that
`torch.compile(fullgraph=True)` traces, and the CUDA seam's entries giving the same bits as the CPU op."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from asyncrl.quant import ops
from asyncrl.quant.fp8 import FP8_DTYPE, quantize_act_fp8_codes
from asyncrl.quant.int8 import int8_epilogue, quantize_act_int8


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _activations(m: int, k: int = 96, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g))
    x[0, :4] = torch.tensor([0.5, 1.5, 2.5, -2.5]) * (x[0].abs().max() / 127)  # int8 ties: x / s exactly at .5
    if m > 1:
        x[1] = 0.0  # a zero row: scale 2**-126, zero codes
    if m > 2:
        x[2, :3] = torch.tensor([1e-40, -3e-39, 448.0])  # subnormal inputs
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


@pytest.mark.parametrize("m", [1, 5, 33])
def test_each_op_is_one_dispatched_op_with_its_rules_bits(m):
    x = _activations(m, seed=m)
    acc = torch.randint(-(2**20), 2**20, (m, 40), dtype=torch.int32, generator=torch.Generator().manual_seed(m))
    sw, bias, sx = torch.rand(40) + 0.5, torch.randn(40), x[:, :1].abs()
    cols, sw_cols = acc[:, 8:24], sw[8:24]  # a strided column slice, as a fused group's member reads
    cases = [
        ("asyncrl.quant_act_int8", lambda: ops.quant_act_int8(x), lambda: quantize_act_int8(x)),
        ("asyncrl.quant_act_fp8", lambda: ops.quant_act_fp8(x), lambda: quantize_act_fp8_codes(x)),
        ("asyncrl.int8_epilogue", lambda: ops.int8_epilogue_op(acc, sx, sw, bias),
         lambda: int8_epilogue(acc, sx, sw, bias)),
        ("asyncrl.int8_epilogue", lambda: ops.int8_epilogue_op(cols, sx, sw_cols, None),
         lambda: int8_epilogue(cols, sx, sw_cols, None)),
    ]
    for name, op, rule in cases:
        with torch.inference_mode(), _Ops() as log:
            got = op()
        assert log.names == [name], log.names  # the whole rule behind one dispatch
        want = rule()
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,),
                        strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous()
            assert torch.equal(_bits(g), _bits(w)), name


def test_fake_implementations_give_the_shapes_and_dtypes_and_compile_traces_one_node_each():
    with FakeTensorMode():
        x = torch.empty(3, 64)
        q8, s8 = ops.quant_act_int8(x)
        qf, sf = ops.quant_act_fp8(x)
        y = ops.int8_epilogue_op(torch.empty(3, 32, dtype=torch.int32), s8, torch.empty(32), None)
    assert (q8.shape, q8.dtype, s8.shape, s8.dtype) == ((3, 64), torch.int8, (3, 1), torch.float32)
    assert (qf.shape, qf.dtype, sf.shape, sf.dtype) == ((3, 64), FP8_DTYPE, (3, 1), torch.float32)
    assert (y.shape, y.dtype) == ((3, 32), torch.float32)

    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    def step(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
        q, s = ops.quant_act_int8(x)
        acc = torch._int_mm(q, qw.t())
        return ops.int8_epilogue_op(acc, s, sw, None) + ops.quant_act_fp8(x)[1]

    x = _activations(5, k=64)
    qw, sw = torch.randint(-127, 128, (24, 64), dtype=torch.int8), torch.rand(24)
    got = torch.compile(step, fullgraph=True, backend=backend)(x, qw, sw)
    assert torch.equal(got, step(x, qw, sw))
    (gm,) = graphs
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert sum("quant_act_int8" in t for t in targets) == 1 and sum("int8_epilogue" in t for t in targets) == 1
    assert sum("quant_act_fp8" in t for t in targets) == 1


@pytest.mark.parametrize("interpret", [True, False], ids=["triton-interpreter", "fallback"])
def test_the_cuda_seam_entries_give_the_cpu_ops_bits_triton_kernels_included(interpret, monkeypatch):
    """What ``ops.CUDA_KERNELS`` holds (the Triton activation kernels, here under Triton's interpreter, and the
    compiled epilogue; or their fallbacks) run on CPU tensors gives the bits of the op's CPU implementation: a
    kernel plugged in there is held to the same."""
    monkeypatch.setenv("TRITON_INTERPRET", "1" if interpret else "0")
    assert set(ops.CUDA_KERNELS) == {"quant_act_int8", "quant_act_fp8", "int8_epilogue"}
    for m in (1, 7):
        x = _activations(m, seed=10 + m)
        for name, op in (("quant_act_int8", ops.quant_act_int8), ("quant_act_fp8", ops.quant_act_fp8)):
            for g, w in zip(ops.CUDA_KERNELS[name](x), op(x), strict=True):
                assert torch.equal(_bits(g), _bits(w)), name
        acc = torch.randint(-(2**20), 2**20, (m, 16), dtype=torch.int32)
        sx, sw, bias = x[:, :1].abs(), torch.rand(16), torch.randn(16)
        assert torch.equal(ops.CUDA_KERNELS["int8_epilogue"](acc, sx, sw, bias), ops.int8_epilogue_op(acc, sx, sw, bias))
