"""Which GEMM a quantised linear runs on which device, and the device-only GEMMs themselves.

Owns: `select_kernel(fmt, device, out_features, in_features)`, the one place where a compute path is
chosen from the device (CPU, or a CUDA device's compute capability) and the weight's shape, and the
kernels that are not the CPU reference rules of int8.py / fp8.py:

    kernel       formats                  what runs (x2 [M, K] fp32 -> y [M, N] fp32)
    bf16         bf16                     y = fp32(linear(bf16(x), W_bf16)) + bias
    int_mm       int8 (CPU with an int8    int8.py: per-token int8 codes, `torch._int_mm`, exact int32 sums
                 dot product; CUDA
                 without Triton)
    int_mm_avx2  int8 on an x86 CPU with   cpu_int8.py: a C kernel built on first use that multiplies the int8
                 AVX2 and no int8 dot      codes themselves (vpmaddubsw on |w| and the sign-moved activation,
                 product                   widened to int32): the int32 sums of int_mm, bit for bit, reading a
                                          quarter of an fp32 GEMM's bytes (2-3x fp32 at batch 1, ~1.8x at 16)
    int_mm_fp32  int8 on a CPU without     int8.py: the same codes held as fp32 (the weight's refreshed in place
                 an int8 dot product       on each load), fp32 GEMMs over K slices of <= 1024 (every partial sum
                 where int_mm_avx2 cannot  an exact integer), slices added in int32: the int32 sums of int_mm,
                 run (no AVX2, no C        bit for bit, at about the fp32 GEMM's speed instead of 0.01-0.1x it
                 compiler)
    int_mm_compiled  int8 on CUDA with     the same, with the activation quantisation and the epilogue each
                 Triton                   one op (ops.py), on CUDA one `torch.compile`d kernel under Inductor's
                                          eager-numerics options (correctly rounded division, no FMA
                                          contraction, no flush to zero)
    fp8_emul     fp8 (CPU, CUDA < sm_89,  fp8.py: fp32 GEMM over the decoded E4M3 codes (an fp32 copy of
                 N or K not % 16)         the codes is held), then the scales
    scaled_mm    fp8 on CUDA sm_89+       `torch._scaled_mm` on the E4M3 codes themselves with row-wise
                 (N, K multiples of 16)   scales, fp32 output, `use_fast_accum=False` (no decoded copy); the
                                          activation quantisation is one op (ops.py)
    wo_fp32      int8_wo/nvfp4/mxfp4 CPU  W decoded once per load to fp32; y = linear(x, W) + bias
    wo_bf16      int8_wo/nvfp4/mxfp4 CUDA W decoded once per load to bf16 (W_bf16 = bf16_rne(dequant W));
                 without Triton           y = fp32(linear(bf16(x), W_bf16)) + bias (a W·A16 rule)
    wo_triton    int8_wo/nvfp4/mxfp4 CUDA the same W·A16 rule in one Triton kernel (triton_kernels.py) that
                 with Triton              reads the stored codes (fp4: packed, two a byte) and scales and decodes
                                          W in registers: no decoded copy is held, y stays fp32 (no bf16
                                          rounding of the output)

Which CPU kernel int8 runs is read from the processor's flags (asyncrl/machine.py: `int8_dot_native`, then
AVX2 with the C kernel built: `cpu_int8.kernel_status`).
The CPU path of every format is the reference the CUDA path must match: the same activation codes
(torch's elementwise ops are correctly rounded on both devices), the same int32 sums for int8, the fp8
sums up to fp32 summation order and the epilogue up to the order of its two scale products (at most one
fp32 rounding each, tests/unit/quant/test_kernels.py), and for the weight-only formats the bf16 rule above
(docs/algorithms.md D26).

Must never: pick a CUDA kernel for a CPU tensor implicitly (CPU tests select one only by name), or
change a published code: kernels read the buffers, they never write them.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from asyncrl.machine import bf16_native, int8_dot_native
from asyncrl.machine import cpu_flags as machine_flags

from .cpu_int8 import kernel_status
from .int8 import int8_epilogue

KERNELS: dict[str, tuple[str, ...]] = {
    "bf16": ("bf16",),
    "int8": ("int_mm", "int_mm_compiled", "int_mm_avx2", "int_mm_fp32"),
    "fp8": ("fp8_emul", "scaled_mm"),
    "int8_wo": ("wo_fp32", "wo_bf16", "wo_triton"),
    "nvfp4": ("wo_fp32", "wo_bf16", "wo_triton"),
    "mxfp4": ("wo_fp32", "wo_bf16", "wo_triton"),
}
"""The kernels each quantised format can run, the CPU reference first."""

FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper and later have E4M3 tensor cores
SCALED_MM_ALIGN = 16  # torch._scaled_mm needs K and N multiples of 16


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None for any other device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def triton_available(device: torch.device | None = None) -> bool:
    """Whether Triton can compile GPU kernels for ``device`` (default: for a CUDA device of this machine): the
    `triton` package is importable and the device is a CUDA device. Never for a CPU device, where Inductor
    compiles C++ whether or not triton is installed (it installs on CPU-only machines too)."""
    if device is None:
        if not torch.cuda.is_available():
            return False
    elif device.type != "cuda":
        return False
    return importlib.util.find_spec("triton") is not None


def select_kernel(fmt: str, device: torch.device, out_features: int, in_features: int,
                  capability: tuple[int, int] | None = None, compiler: bool | None = None,
                  cpu_flags: frozenset[str] | None = None) -> str:
    """The kernel a linear of `fmt` with an [out_features, in_features] weight runs on `device`.
    ``capability`` defaults to the device's own, ``compiler`` (whether Triton compiles kernels for it) to
    `triton_available(device)`, ``cpu_flags`` to this CPU's (asyncrl/machine.py; pass them to ask about a device
    that is not here). A CPU device always gets a CPU kernel, whatever ``compiler`` says."""
    if fmt not in KERNELS:
        raise ValueError(f"no quantised kernel for format {fmt!r}; choose one of {sorted(KERNELS)}")
    if fmt == "int8":
        if device.type != "cuda":
            if int8_dot_native(cpu_flags):
                return "int_mm"
            avx2 = "avx2" in (machine_flags() if cpu_flags is None else cpu_flags)
            return "int_mm_avx2" if avx2 and kernel_status() == "" else "int_mm_fp32"
        return "int_mm_compiled" if _compiles(device, compiler) else "int_mm"
    cap = capability if capability is not None else cuda_capability(device)
    if fmt == "fp8":
        aligned = out_features % SCALED_MM_ALIGN == 0 and in_features % SCALED_MM_ALIGN == 0
        return "scaled_mm" if cap is not None and cap >= FP8_MIN_CAPABILITY and aligned else "fp8_emul"
    if fmt in ("int8_wo", "nvfp4", "mxfp4"):
        if device.type != "cuda":
            return "wo_fp32"
        return "wo_triton" if _compiles(device, compiler) else "wo_bf16"
    return KERNELS[fmt][0]


def _compiles(device: torch.device, compiler: bool | None) -> bool:
    return triton_available(device) if compiler is None else compiler


KERNEL_NOTES: dict[str, str] = {
    "bf16": "bf16 GEMMs",
    "int_mm": "torch._int_mm on the int8 codes",
    "int_mm_compiled": "torch._int_mm with a Triton activation quantisation kernel and a compiled epilogue",
    "int_mm_avx2": ("exact int8 sums from an AVX2 kernel over the int8 codes (this CPU has no int8 dot product, "
                    "where torch._int_mm runs 10-75x slower than fp32; the same bits)"),
    "int_mm_fp32": ("exact int8 sums from fp32 GEMMs over the codes (this CPU has no int8 dot product, where "
                    "torch._int_mm runs 10-75x slower than fp32, and the AVX2 kernel cannot run: "
                    "{avx2_status}; the same bits)"),
    "fp8_emul": "an fp32 GEMM over the decoded E4M3 codes",
    "scaled_mm": "torch._scaled_mm on the E4M3 codes",
    "wo_fp32": "weights decoded to fp32 once per load",
    "wo_bf16": "weights decoded to bf16 once per load",
    "wo_triton": "a Triton GEMM decoding the packed codes in registers (no decoded copy)",
}
"""What each kernel runs, in words (the rollout worker's start line)."""


def explain_kernels(fmt: str, kernels: set[str] | frozenset[str], device_type: str,
                    cpu_flags: frozenset[str] | None = None) -> str:
    """One phrase naming what a ``fmt`` actor with linears on ``kernels`` runs on a ``device_type`` device, and
    the format to use instead where this one cannot pay here (bf16 on a CPU without bf16 matmul instructions)."""
    if fmt == "fp32" or not kernels:
        return f"{fmt}: full-precision GEMMs"
    notes = [KERNEL_NOTES[k].replace("{avx2_status}", kernel_status() or "it was not chosen") for k in sorted(kernels)]
    text = f"{fmt} on {', '.join(sorted(kernels))}: " + "; ".join(notes)
    if device_type == "cpu" and "bf16" in kernels and not bf16_native(cpu_flags):
        text += " (this CPU has no bf16 matmul instructions, so bf16 runs many times slower than fp32: use quant=fp32"
        text += " or int8 here)"
    return text


def check_kernel(fmt: str, kernel: str, out_features: int, in_features: int) -> str:
    """`kernel` if a linear of `fmt` and that shape can run it, else a ValueError naming the choices."""
    if kernel not in KERNELS.get(fmt, ()):
        raise ValueError(f"format {fmt!r} runs one of the kernels {KERNELS.get(fmt, ())}, not {kernel!r}")
    if kernel == "scaled_mm" and (out_features % SCALED_MM_ALIGN or in_features % SCALED_MM_ALIGN):
        raise ValueError(f"scaled_mm needs in/out features that are multiples of {SCALED_MM_ALIGN}, got "
                         f"[{out_features}, {in_features}]; use fp8_emul for this linear")
    return kernel


def compute_dtype(kernel: str) -> torch.dtype:
    """dtype of the weight operand of a weight-only kernel's GEMM: the decoded copy `wo_fp32` (fp32) and
    `wo_bf16` (bf16) hold, and the bf16 values `wo_triton` decodes in registers (it holds no copy)."""
    return torch.bfloat16 if kernel in ("wo_bf16", "wo_triton") else torch.float32


HOLDS_DECODED = ("wo_fp32", "wo_bf16")
"""Weight-only kernels that hold a decoded copy of the weight (`_w_decoded`); `wo_triton` holds none."""


def linear_bf16(x2: Tensor, w_bf16: Tensor) -> Tensor:
    """x2 [M, K] float, w_bf16 [N, K] bf16 -> [M, N] bf16 (the GEMM of the bf16 and wo_bf16 rules;
    fp32 accumulation inside the kernel, the output rounded to bf16 once)."""
    return F.linear(x2.to(torch.bfloat16), w_bf16)


def scaled_mm_fp8(qx: Tensor, sx: Tensor, qw: Tensor, sw: Tensor, *, rowwise: bool | None = None) -> Tensor:
    """Real FP8 GEMM: qx [M, K] and qw [N, K] float8_e4m3fn (qw.t() is the column-major operand the
    kernel wants), sx [M, 1] fp32, sw [N] fp32 -> [M, N] fp32, y = acc * sx[m] * sw[n] with acc the
    fp32 sum of the exact code products. `use_fast_accum=False`: Hopper's fast-accumulation mode keeps
    fewer bits of the running sum.

    ``rowwise`` (default: whether the device's `_scaled_mm` takes row-wise scales with an fp32
    output, probed once per device): True hands the per-token and per-channel scales to the kernel's
    epilogue; False runs it with unit tensor-wise scales and applies fp8.py's epilogue
    fp32(fp32(acc * sx) * sw) as two fp32 multiplies (the CUTLASS row-wise kernel only writes bf16)."""
    if rowwise is None:
        rowwise = rowwise_fp32_supported(qx.device)
    if rowwise:
        return torch._scaled_mm(qx, qw.t(), scale_a=sx.contiguous(), scale_b=sw[None, :].contiguous(),
                                out_dtype=torch.float32, use_fast_accum=False)
    one = _unit_scale(qx.device)
    y = torch._scaled_mm(qx, qw.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=False)
    return y.mul_(sx).mul_(sw)


_UNIT: dict[torch.device, Tensor] = {}
_ROWWISE: dict[torch.device, bool] = {}


def _unit_scale(device: torch.device) -> Tensor:
    if device not in _UNIT:
        _UNIT[device] = torch.ones((), dtype=torch.float32, device=device)
    return _UNIT[device]


def rowwise_fp32_supported(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` on `device` accepts row-wise fp32 scales with an fp32 output (cuBLASLt
    on sm_90 with cuBLAS >= 12.9, and the CPU reference; not the bf16-only CUTLASS kernel). Probed once
    per device with a 16 x 16 x 16 product, before any CUDA graph is captured (model conversion)."""
    if device not in _ROWWISE:
        a = torch.zeros((16, 16), device=device).to(torch.float8_e4m3fn)
        try:
            torch._scaled_mm(a, a.t(), scale_a=torch.ones((16, 1), device=device),
                             scale_b=torch.ones((1, 16), device=device), out_dtype=torch.float32,
                             use_fast_accum=False)
            _ROWWISE[device] = True
        except (RuntimeError, NotImplementedError):
            _ROWWISE[device] = False
    return _ROWWISE[device]


EAGER_NUMERICS: dict[str, str | int | bool | Callable[..., Any]] = {
    "emulate_precision_casts": True,  # also turns Triton's fp fusion (mul + add -> FMA) off
    "eager_numerics.division_rounding": True,  # div_rn instead of Triton's approximate div.full
    "eager_numerics.disable_ftz": True,  # subnormal activations keep their codes
}
"""Inductor options under which a compiled rule computes what the eager ops compute, bit for bit."""


class Compiled:
    """``fn`` compiled once per process with `EAGER_NUMERICS` (dynamic shapes: one kernel for every batch
    size), falling back to ``fn`` itself, with a warning, if compiling fails. Call it once before a CUDA
    graph is captured (the first call compiles). Traced by an enclosing `torch.compile` (a compiled decode
    step), it is the plain ``fn``, fused into the caller's graph under the caller's options."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._compiled: Callable[..., Any] | None = None
        self.failed = False

    def __call__(self, *args: Any) -> Any:
        if self.failed or torch.compiler.is_compiling():  # inside a caller's compiled region: its graph
            return self.fn(*args)
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, dynamic=True, options=EAGER_NUMERICS)
        try:
            return self._compiled(*args)
        except Exception as exc:  # an Inductor/Triton failure must not stop a rollout worker: run eagerly
            warnings.warn(f"torch.compile of {self.fn.__name__} failed ({exc!r}); running it eagerly",
                          RuntimeWarning, stacklevel=2)
            self.failed = True
            return self.fn(*args)


int8_epilogue_compiled = Compiled(int8_epilogue)
"""int8.int8_epilogue as one kernel: the same fp32 values."""
