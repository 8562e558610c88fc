"""The decode step's quantisation kernels as single opaque ops: per-token activation quantisation (int8, fp8
E4M3) and the int8 epilogue, each one `torch.library` custom op.

Owns: the ops and where each device's implementation of them lives.

    op                                   computes (x2 [M, K] fp32)                    rule
    asyncrl::quant_act_int8(x2)          codes [M, K] int8, scales [M, 1] fp32       int8.quantize_act_int8
    asyncrl::quant_act_fp8(x2)           codes [M, K] float8_e4m3fn, scales [M, 1]   fp8.quantize_act_fp8_codes
    asyncrl::int8_epilogue(acc, sx, sw,  [M, N] fp32 = fp32(fp32(acc * sx) * sw)     int8.int8_epilogue
                           bias?)        (+ bias)

Why ops: eagerly, the activation quantisation is 6-7 aten ops and the epilogue 2-3, each a kernel launch on a
GPU, where a decode step is launch-bound. As one op each, a decode step dispatches one call per projection group
for each, `torch.compile(fullgraph=True)` traces each as one node (a fake implementation gives the output shapes),
and a CUDA graph captures whatever kernels the device implementation launches.

Implementations: every device but CUDA runs the eager rule itself (the CPU reference, the same bits). CUDA runs
`CUDA_KERNELS[op]`, the single place a device kernel is plugged in: the activation quantisations are the
hand-written Triton kernels of triton_kernels.py (one kernel each, the rule's bits, tested under Triton's
interpreter in tests/unit/quant/test_triton_kernels.py and tests/unit/quant/test_ops.py), the epilogue is the
rule compiled into one kernel by Inductor under `kernels.EAGER_NUMERICS` (the same bits;
tests/unit/quant/test_kernels.py); where Triton is not installed each entry runs the eager rule. Another kernel
replaces an entry; it must give the rule's bits, which the tests compare against the CPU implementation.

Must never: change a rule (int8.py, fp8.py own them), or return a tensor aliasing an input (the ops are
declared functional).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .fp8 import FP8_DTYPE, quantize_act_fp8_codes
from .int8 import int8_epilogue, quantize_act_int8
from .kernels import Compiled, int8_epilogue_compiled, triton_available
from .triton_kernels import act_quant_fp8, act_quant_int8


def _compiled_or_eager(compiled: Compiled) -> Callable[..., Any]:
    """``compiled`` (one Inductor kernel) where Triton is installed, else its eager function."""
    return compiled if triton_available() else compiled.fn


CUDA_KERNELS: dict[str, Callable[..., Any]] = {
    "quant_act_int8": act_quant_int8,  # Triton where installed, else the eager rule
    "quant_act_fp8": act_quant_fp8,
    "int8_epilogue": _compiled_or_eager(int8_epilogue_compiled),
}
"""What each op runs on a CUDA device (see the module docstring): the seam for hand-written kernels."""


@torch.library.custom_op("asyncrl::quant_act_int8", mutates_args=())
def quant_act_int8(x2: Tensor) -> tuple[Tensor, Tensor]:
    """x2 [M, K] fp32 -> per-token int8 codes [M, K], scales [M, 1] fp32 (int8.quantize_act_int8)."""
    return quantize_act_int8(x2)


@quant_act_int8.register_kernel("cuda")
def _quant_act_int8_cuda(x2: Tensor) -> tuple[Tensor, Tensor]:
    return CUDA_KERNELS["quant_act_int8"](x2)


@quant_act_int8.register_fake
def _quant_act_int8_fake(x2: Tensor) -> tuple[Tensor, Tensor]:
    return x2.new_empty(x2.shape, dtype=torch.int8), x2.new_empty((x2.shape[0], 1), dtype=torch.float32)


@torch.library.custom_op("asyncrl::quant_act_fp8", mutates_args=())
def quant_act_fp8(x2: Tensor) -> tuple[Tensor, Tensor]:
    """x2 [M, K] fp32 -> per-token E4M3 codes [M, K], scales [M, 1] fp32 (fp8.quantize_act_fp8_codes)."""
    return quantize_act_fp8_codes(x2)


@quant_act_fp8.register_kernel("cuda")
def _quant_act_fp8_cuda(x2: Tensor) -> tuple[Tensor, Tensor]:
    return CUDA_KERNELS["quant_act_fp8"](x2)


@quant_act_fp8.register_fake
def _quant_act_fp8_fake(x2: Tensor) -> tuple[Tensor, Tensor]:
    return x2.new_empty(x2.shape, dtype=FP8_DTYPE), x2.new_empty((x2.shape[0], 1), dtype=torch.float32)


@torch.library.custom_op("asyncrl::int8_epilogue", mutates_args=())
def int8_epilogue_op(acc: Tensor, sx: Tensor, sw: Tensor, bias: Tensor | None) -> Tensor:
    """acc [M, N] int32 (any strides), sx [M, 1], sw [N], bias [N] or None -> contiguous [M, N] fp32
    (int8.int8_epilogue)."""
    return int8_epilogue(acc, sx, sw, bias)


@int8_epilogue_op.register_kernel("cuda")
def _int8_epilogue_cuda(acc: Tensor, sx: Tensor, sw: Tensor, bias: Tensor | None) -> Tensor:
    return CUDA_KERNELS["int8_epilogue"](acc, sx, sw, bias)


@int8_epilogue_op.register_fake
def _int8_epilogue_fake(acc: Tensor, sx: Tensor, sw: Tensor, bias: Tensor | None) -> Tensor:
    return acc.new_empty(acc.shape, dtype=torch.float32)
