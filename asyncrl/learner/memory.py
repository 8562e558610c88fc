"""How much memory a torch process keeps that it no longer uses: glibc malloc's retention and
libtorch's per-shape kernel caches, bounded (the learner calls both at start, the generation
worker the second and ``malloc_trim``).

Owns two process-wide settings. On Linux/glibc, torch's CPU tensors come from
``malloc``. glibc serves a request of at least the *mmap threshold* with its own ``mmap`` (given
back to the kernel by ``free``) and smaller ones from its heap, whose freed chunks it keeps for
reuse. The threshold is dynamic: each time a mmapped chunk is freed the threshold rises to that
chunk's size (up to 32 MiB), so after the first layer of a forward almost every activation of a
2048-token micro-batch (0.1-12 MiB each) is served from the heap. Interleaved with tensors that
stay alive (the layer inputs kept for activation checkpointing, LoRA's small rank-r
activations), the freed chunks are rarely reusable as a whole and never given back (on SmolLM2-135M, more
than half of the RSS after one LoRA training forward; docs/benchmarks.md §6).

``bound_malloc_retention`` fixes the threshold (``mallopt(M_MMAP_THRESHOLD)``, which also turns
the dynamic adjustment off) and the heap-top trim threshold, so every tensor of at least that
size lives in its own mapping and goes back to the kernel when freed.

``bound_kernel_caches`` bounds the two per-shape caches of torch's oneDNN (mkldnn) CPU path, which
bf16 matmuls go through: oneDNN's primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and ideep's
(``LRU_CACHE_CAPACITY``), 1024 entries each by default. A rollout stream's micro-batches have a new
row count almost every time, every shape builds about a dozen primitives in each cache, and at the
default capacity the process grows by several MB per new shape until the caches are full; capped, it
stays flat at the same speed (docs/benchmarks.md §6). The caches read the variables at their first
use, so the call must come before the first bf16 (oneDNN) operation.

Never does: change any value computed (the allocator only decides where bytes live), allocate,
or act outside glibc (elsewhere it reports False and does nothing).

Invariants: idempotent; process-wide (every thread's allocations); call both once at process start,
before the model is loaded. ``bound_kernel_caches`` never overrides a capacity the user set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["DEFAULT_KERNEL_CACHE_CAPACITY", "DEFAULT_MMAP_THRESHOLD", "KERNEL_CACHE_VARS", "bound_kernel_caches",
           "bound_malloc_retention", "malloc_trim"]

DEFAULT_MMAP_THRESHOLD = 1 << 20
"""1 MiB: activations of a micro-batch are larger, so each is its own mapping; smaller objects
(Python, metadata, tiny tensors) keep the heap's speed."""

DEFAULT_KERNEL_CACHE_CAPACITY = 64
"""Entries per oneDNN/ideep cache. One micro-batch shape needs about 15 primitives in each (30 with
LoRA's adapter matmuls), so one step's shapes stay cached while it runs; entries for 2048-token
micro-batches are large, so a higher capacity still grows (docs/benchmarks.md §6)."""

KERNEL_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
"""The environment variables by which oneDNN and ideep (inside libtorch) size their caches."""

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):  # musl and others
        return None
    return libc


def bound_malloc_retention(mmap_threshold: int = DEFAULT_MMAP_THRESHOLD) -> bool:
    """Serve every allocation of at least ``mmap_threshold`` bytes by its own mmap (returned to
    the kernel when freed) and trim the heap top above twice that. True when glibc took both
    settings; False where the C library is not glibc (nothing changed)."""
    if mmap_threshold < 4096 or mmap_threshold > 32 << 20:
        raise ValueError(f"mmap_threshold must be in [4 KiB, 32 MiB] (glibc's range), got {mmap_threshold}")
    libc = _libc()
    if libc is None:
        return False
    ok_mmap = libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(mmap_threshold)) == 1
    ok_trim = libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(2 * mmap_threshold)) == 1
    return ok_mmap and ok_trim


def bound_kernel_caches(capacity: int = DEFAULT_KERNEL_CACHE_CAPACITY) -> dict[str, str]:
    """Cap oneDNN's and ideep's per-shape caches at ``capacity`` entries (``KERNEL_CACHE_VARS``) unless
    the environment already sets them; returns the values in force. Must run before the process's
    first oneDNN operation (they are read once); child processes inherit the setting."""
    if capacity < 1:
        raise ValueError(f"kernel cache capacity must be >= 1, got {capacity}")
    for var in KERNEL_CACHE_VARS:
        os.environ.setdefault(var, str(capacity))
    return {var: os.environ[var] for var in KERNEL_CACHE_VARS}


def malloc_trim() -> bool:
    """Give the kernel every whole free page of the heap now (glibc ``malloc_trim(0)``).
    True if memory was released; False if none was, or outside glibc."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
