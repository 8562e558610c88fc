"""The int8 GEMM of x86 CPUs with AVX2 and no int8 dot-product instruction (`int_mm_avx2`, asyncrl/quant/kernels.py).

Owns: building the C kernel (``csrc/int8_gemm_avx2.c``) with the machine's C compiler into a cache folder the
first time a process asks for it, loading it, and its two entry points:

    int_mm_avx2(a, b)                   the exact int32 sums of int8 codes (those of `torch._int_mm`, bit for bit),
                                        read from the int8 codes themselves: a quarter of the bytes an fp32 GEMM
                                        reads (2-3x an fp32 GEMM at M = 1, about 1.8x at M = 16 on SmolLM2's
                                        projections, docs/benchmarks.md §15), where `torch._int_mm` falls back to
                                        scalar code on such a CPU
    int8_linear_avx2(x, qw, sw, bias)   the whole W8A8 linear (activation codes, that GEMM, the fp32 epilogue) in
                                        one call, with the bits of int8.py's torch ops: what an `int_mm_avx2`
                                        linear runs (linear.py, fused.py)

Built once per source and flags: ``$ASYNCRL_KERNEL_CACHE`` (default ``~/.cache/asyncrl/kernels``) holds
``int8_gemm_avx2-<hash>.so``, written to a temporary name and renamed, so processes that build at once never
load a half-written file. `kernel_status()` says whether the kernel is here and, if not, why (no AVX2 in this
CPU's own flags, no C compiler, a failed build): the kernel choice then falls back to `int_mm_fp32` and the
worker's start line names the reason.
Never: loads the library on a CPU whose own /proc/cpuinfo lacks AVX2 (``ASYNCRL_CPU_FLAGS`` may fake a choice,
never an instruction), or is asked for activation codes of -128 (the quantiser never makes one).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from asyncrl.machine import real_cpu_flags

SOURCE = Path(__file__).with_name("csrc") / "int8_gemm_avx2.c"
CFLAGS = ("-O3", "-mavx2", "-shared", "-fPIC", "-std=c99", "-ffp-contract=off")
"""-ffp-contract=off: the epilogue's multiplies and add are never contracted into an FMA (torch's bits)."""
CACHE_ENV = "ASYNCRL_KERNEL_CACHE"
"""Environment variable naming the folder the built kernel is kept in (default ``~/.cache/asyncrl/kernels``)."""
BUILD_TIMEOUT_S = 120.0


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "asyncrl" / "kernels")


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    """(library, "") or (None, why not)."""
    if "avx2" not in real_cpu_flags():
        return None, "this CPU has no AVX2"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler (cc or gcc) to build it"
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(CFLAGS).encode()).hexdigest()[:16]
    target = cache_dir() / f"int8_gemm_avx2-{key}.so"
    if not target.is_file():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
            os.close(fd)
            try:
                run = subprocess.run([compiler, *CFLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                                     timeout=BUILD_TIMEOUT_S, check=False)
                if run.returncode != 0:
                    return None, f"{compiler} could not build {SOURCE.name}: {run.stderr.strip()[-300:]}"
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"building {SOURCE.name} into {target.parent} failed ({e}); set {CACHE_ENV} to a writable folder"
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        return None, f"{target} does not load ({e}); delete it to build it again"
    lib.asyncrl_int8_gemm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 6
    lib.asyncrl_int8_gemm.restype = None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.asyncrl_int8_linear.argtypes = [p, i64, i64, i64, p, i64, i64, p, p, p, p, p, i64]
    lib.asyncrl_int8_linear.restype = None
    return lib, ""


def kernel_status() -> str:
    """"" when `int_mm_avx2` can run here, else why not (in words)."""
    return _load()[1]


def int_mm_avx2(a: Tensor, b: Tensor) -> Tensor:
    """Exact int8 matmul on the CPU: a [M, K] int8 codes in [-127, 127], b [N, K] int8 (a weight's own layout,
    not transposed) -> [M, N] int32, equal to ``torch._int_mm(a, b.t())``. Rows must be contiguous in K."""
    if torch.compiler.is_compiling():
        return torch.ops.asyncrl.int_mm_avx2(a, b)
    return _int_mm_avx2(a, b)


def _library() -> ctypes.CDLL:
    lib, why = _load()
    if lib is None:
        raise RuntimeError(f"int_mm_avx2 cannot run here: {why}; the int8 kernel for this CPU is int_mm_fp32")
    return lib


def _int_mm_avx2(a: Tensor, b: Tensor) -> Tensor:
    lib = _library()
    m, k = a.shape
    n = b.shape[0]
    if a.dtype != torch.int8 or b.dtype != torch.int8 or b.shape[1] != k or a.device.type != "cpu" \
            or b.device.type != "cpu":
        raise ValueError(f"int_mm_avx2 takes CPU int8 [M, K] and [N, K], got {a.dtype} {tuple(a.shape)} on "
                         f"{a.device} and {b.dtype} {tuple(b.shape)} on {b.device}")
    if k and a.stride(1) != 1:
        a = a.contiguous()
    if k and b.stride(1) != 1:
        b = b.contiguous()
    out = torch.empty((m, n), dtype=torch.int32)
    if m and n:
        lib.asyncrl_int8_gemm(a.data_ptr(), b.data_ptr(), out.data_ptr(), m, n, k, a.stride(0), b.stride(0), n)
    return out


@torch.library.custom_op("asyncrl::int_mm_avx2", mutates_args=(), device_types="cpu")
def _int_mm_avx2_op(a: Tensor, b: Tensor) -> Tensor:
    """`int_mm_avx2` as one op, for a compiled decode step (eager calls go to the library directly: a custom op's
    dispatch costs more than the smallest GEMMs of a decode step)."""
    return _int_mm_avx2(a, b)


@_int_mm_avx2_op.register_fake
def _(a: Tensor, b: Tensor) -> Tensor:
    return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.int32)


def int8_linear_avx2(x2: Tensor, qw: Tensor, sw: Tensor, bias: Tensor | None) -> Tensor:
    """The whole W8A8 linear in one call: x2 [M, K] fp32 -> y [M, N] fp32, the bits of int8.py's rules in torch
    ops (`quantize_act_int8`, `int_mm`, `int8_epilogue`): per-token activation codes, exact int32 sums against the
    weight codes qw [N, K], then fp32(fp32(fp32(acc) * sx) * sw) + bias. One call instead of about ten torch ops,
    each of which costs more in dispatch than its arithmetic at decode sizes."""
    if torch.compiler.is_compiling():
        return torch.ops.asyncrl.int8_linear_avx2(x2, qw, sw, bias)
    return _int8_linear_avx2(x2, qw, sw, bias)


def _int8_linear_avx2(x2: Tensor, qw: Tensor, sw: Tensor, bias: Tensor | None) -> Tensor:
    lib = _library()
    m, k = x2.shape
    n = qw.shape[0]
    if x2.dtype != torch.float32 or qw.dtype != torch.int8 or qw.shape[1] != k or sw.dtype != torch.float32 \
            or sw.shape != (n,) or (bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,))):
        raise ValueError(f"int8_linear_avx2 takes fp32 x [M, K], int8 w [N, K], fp32 scales and bias [N], got x "
                         f"{x2.dtype} {tuple(x2.shape)}, w {qw.dtype} {tuple(qw.shape)}, scales {sw.dtype} "
                         f"{tuple(sw.shape)}, bias {None if bias is None else (bias.dtype, tuple(bias.shape))}")
    if k and x2.stride(1) != 1:
        x2 = x2.contiguous()
    if k and qw.stride(1) != 1:
        qw = qw.contiguous()
    sw, bias = sw.contiguous(), None if bias is None else bias.contiguous()
    y = torch.empty((m, n), dtype=torch.float32)
    if m and n:
        q = torch.empty((m, k), dtype=torch.int8)
        sx = torch.empty(m, dtype=torch.float32)
        lib.asyncrl_int8_linear(x2.data_ptr(), m, k, x2.stride(0), qw.data_ptr(), n, qw.stride(0), sw.data_ptr(),
                                None if bias is None else bias.data_ptr(), q.data_ptr(), sx.data_ptr(), y.data_ptr(), n)
    return y


@torch.library.custom_op("asyncrl::int8_linear_avx2", mutates_args=(), device_types="cpu")
def _int8_linear_avx2_op(x2: Tensor, qw: Tensor, sw: Tensor, bias: Tensor | None) -> Tensor:
    """`int8_linear_avx2` as one op, for a compiled decode step."""
    return _int8_linear_avx2(x2, qw, sw, bias)


@_int8_linear_avx2_op.register_fake
def _(x2: Tensor, qw: Tensor, sw: Tensor, bias: Tensor | None) -> Tensor:
    return x2.new_empty((x2.shape[0], qw.shape[0]), dtype=torch.float32)
