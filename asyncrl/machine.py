"""What this machine's processor can do: its model name, core count and instruction-set flags.

Owns: reading the CPU's ISA flags (Linux ``/proc/cpuinfo``; ``ASYNCRL_CPU_FLAGS``, a space-separated list,
replaces them, to ask what a run would pick on another CPU or to force a choice), and the two questions the
numerics ask of them:

    int8_dot_native()   an int8 dot-product instruction (AVX-512 VNNI, AVX-VNNI, AMX-INT8): `torch._int_mm`
                        runs at about 2x an fp32 GEMM with one, and at 0.01-0.1x without (it then falls back
                        to scalar int8 code), so the int8 kernel is chosen by it (asyncrl/quant/kernels.py)
    bf16_native()       bf16 matmul instructions (AVX-512 BF16, AMX-BF16): bf16 autocast is ~4.8x fp32 with
                        them and ~35x slower without (``learner.autocast=auto``)

and `describe()`, the one-line name of the CPU that start lines and benchmark records carry.
Never: imports anything but the standard library (the quant package and the learner both ask it; it is a
leaf beside ``asyncrl/_lazy.py``), or guesses: a CPU whose flags cannot be read has none, so every choice
falls to the kernel that is never many times slower than fp32.
"""

from __future__ import annotations

import functools
import os
import platform

FLAGS_ENV = "ASYNCRL_CPU_FLAGS"
"""Environment variable that replaces the CPU's flags (space-separated, as /proc/cpuinfo writes them)."""
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
"""Any one of these gives `torch._int_mm` a native int8 dot product on x86."""
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""Any one of these gives a CPU bf16 GEMM at more than the fp32 rate."""
SHOWN_FLAGS = ("avx2", "avx512f", *INT8_DOT_FLAGS, *BF16_FLAGS)
"""The flags `describe()` and benchmark records name (those the numerics' choices read, and their base)."""


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo; ("", empty) where there is none."""
    model, flags = "", frozenset[str]()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:  # x86, then Arm's spelling
                    flags = frozenset(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model, flags


def cpu_flags() -> frozenset[str]:
    """The CPU's ISA flags (lower case, as /proc/cpuinfo names them), or those of ``ASYNCRL_CPU_FLAGS``."""
    forced = os.environ.get(FLAGS_ENV)
    if forced is not None:
        return frozenset(forced.lower().replace(",", " ").split())
    return _cpuinfo()[1]


def real_cpu_flags() -> frozenset[str]:
    """The flags /proc/cpuinfo gives, whatever ``ASYNCRL_CPU_FLAGS`` says: what decides whether an instruction
    may run (a forced flag changes which kernel is chosen, never what the processor executes)."""
    return _cpuinfo()[1]


def flags_forced() -> bool:
    """Whether ``ASYNCRL_CPU_FLAGS`` replaces the CPU's own flags."""
    return os.environ.get(FLAGS_ENV) is not None


def cpu_model() -> str:
    """The processor's model name ("AMD EPYC 9B14"), or the platform's word for it where none is written."""
    return _cpuinfo()[0] or platform.processor() or platform.machine() or "unknown CPU"


def int8_dot_native(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU (``flags``, default `cpu_flags()`) has an int8 dot-product instruction."""
    return any(f in (cpu_flags() if flags is None else flags) for f in INT8_DOT_FLAGS)


def bf16_native(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU (``flags``, default `cpu_flags()`) has bf16 matmul instructions."""
    return any(f in (cpu_flags() if flags is None else flags) for f in BF16_FLAGS)


def shown_flags(flags: frozenset[str] | None = None) -> list[str]:
    """The flags of `SHOWN_FLAGS` this CPU has, in that order."""
    have = cpu_flags() if flags is None else flags
    return [f for f in SHOWN_FLAGS if f in have]


def describe() -> str:
    """One line naming the CPU: model, cores, and the flags the numerics choose by, e.g.
    ``AMD EPYC 7B13, 2 cores, flags avx2 (no int8 dot product, no bf16 matmul)``."""
    flags = cpu_flags()
    shown = " ".join(shown_flags(flags)) or "none of " + " ".join(SHOWN_FLAGS)
    lacks = [what for what, has in (("int8 dot product", int8_dot_native(flags)), ("bf16 matmul", bf16_native(flags)))
             if not has]
    tail = f" (no {', no '.join(lacks)})" if lacks else ""
    forced = f" [{FLAGS_ENV}]" if flags_forced() else ""
    return f"{cpu_model()}, {os.cpu_count()} cores, flags {shown}{forced}{tail}"


def machine_record() -> dict[str, object]:
    """The processor part of a benchmark's machine block: model, cores, flags the numerics read, and whether
    they were forced."""
    flags = cpu_flags()
    return {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "cpu_flags": shown_flags(flags),
            "int8_dot_native": int8_dot_native(flags), "bf16_native": bf16_native(flags),
            "cpu_flags_forced": flags_forced()}
