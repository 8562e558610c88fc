"""Host memory for publications: the send buffers one publication is written into, and their reuse.

Owns: `Blocks` (where one publication's tensors live: small ones packed into 64 MiB blocks, large ones
in mappings of their own, huge pages asked for), `BufferPool` (a publisher's mappings, handed out
again once nothing views them) and the staging of one target weight into them (`quantize_for_send`).

Device: a weight is quantised on the device that holds it (`quantizes_on_device`): a CUDA learner's
weights on its GPU, and only codes, scales and the untouched tensors are copied to the host, each once,
into these buffers (`Blocks.to_host`); CPU weights have their codes written straight into them. The
bytes are the same either way (one rule, `formats.quantize_weight`).

Must never: hand out memory that a live tensor, array or zmq frame still views, or copy a tensor
more than once on its way into a buffer.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import threading
import weakref

import torch
from torch import Tensor

from .formats import quantize_weight


class Blocks:
    """Where one publication's tensors live: the small ones packed into a few 64 MiB blocks, the
    large ones in buffers of their own, every one an anonymous mapping of its own (given back whole
    when the last tensor viewing it is dropped) that asks for transparent huge pages.

    Why blocks: published one by one, a SmolLM2-135M int8 publication is ~270 tensors under 1 MiB:
    they stayed in glibc's heap, and with a publication every step between the step's own
    allocations the heap kept growing (docs/benchmarks.md §9, "Publication buffers"). Why huge pages: a
    publication is written into fresh memory every version (its buffers are sent zero-copy and must
    not change), and touching fresh 4 KiB pages one by one is a fault each; with 2 MiB pages
    (``MADV_HUGEPAGE``, honoured where the kernel's THP mode is ``madvise`` or ``always``) an int8
    publication takes about half the time (docs/benchmarks.md §9, "Publication buffers"). Where mmap
    or madvise is missing, plain ``torch.empty``."""

    BLOCK = 64 << 20
    SMALL = 4 << 20
    ALIGN = 64

    def __init__(self, pool: BufferPool | None = None) -> None:
        self._pool = pool
        self._block: Tensor | None = None
        self._used = 0
        self.mapped = 0
        """Bytes of the buffers made so far (what `BufferPool.trim` keeps for the next version)."""
        # data pointers of the tensors `empty` handed out; publish keeps every one of them in its
        # output until it returns, so no other tensor can take one of these addresses meanwhile
        self._made: set[int] = set()

    def _buffer(self, nbytes: int) -> Tensor:
        """``nbytes`` of uint8 CPU memory in a mapping of its own, with huge pages asked for: from the
        pool when it has a free one of that size, else fresh."""
        self.mapped += nbytes
        if self._pool is not None:
            return self._pool.take(nbytes)
        mapping = _new_mapping(nbytes)
        if mapping is None:
            return torch.empty(nbytes, dtype=torch.uint8)
        return torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps the mapping alive

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """An uninitialised contiguous CPU tensor, in a block when it is small; ``snapshot`` of it
        is itself (a quantiser writes its codes here once instead of into a tensor copied later)."""
        n = math.prod(shape) * dtype.itemsize
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        view = (self._buffer(n) if n > self.SMALL else self._take(n)).view(dtype).view(shape)
        self._made.add(view.data_ptr())
        return view

    def snapshot(self, t: Tensor, source: Tensor) -> Tensor:
        """A contiguous CPU copy of ``t`` (or ``t`` itself when it came from ``empty``, or when it is a
        large contiguous CPU tensor that shares no memory with the learner's ``source``); a tensor on
        another device is copied once, straight into a send buffer (`to_host`)."""
        if t.device.type != "cpu":
            return self.to_host(t)
        t = t.detach()
        n = t.numel() * t.element_size()
        if n == 0:
            return t.contiguous()
        if t.is_contiguous() and t.data_ptr() in self._made:
            return t
        if n > self.SMALL:
            t = t.contiguous()
            if t.untyped_storage().data_ptr() != source.untyped_storage().data_ptr():
                return t
            view = self._buffer(n)
        else:
            view = self._take(n)
        view = view.view(t.dtype).view(t.shape)
        view.copy_(t)
        return view

    def to_host(self, t: Tensor) -> Tensor:
        """``t`` (on any device, any strides) copied once into a contiguous send buffer from `empty`:
        one device-to-host copy for a tensor an accelerator quantised or holds."""
        if t.numel() == 0:
            return torch.empty(tuple(t.shape), dtype=t.dtype)
        return self.empty(tuple(t.shape), t.dtype).copy_(t.detach())

    def _take(self, n: int) -> Tensor:
        if self._block is None or self._used + n > self.BLOCK:
            self._block, self._used = self._buffer(self.BLOCK), 0
        view = self._block[self._used:self._used + n]
        self._used += -(-n // self.ALIGN) * self.ALIGN
        return view


def _new_mapping(nbytes: int) -> mmap.mmap | None:
    """A fresh anonymous mapping of ``nbytes`` with transparent huge pages asked for; None where mmap
    or madvise is missing."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if advice is None or not flags:
        return None
    mapping = mmap.mmap(-1, nbytes, flags=flags)
    with contextlib.suppress(OSError):  # a kernel without THP: ordinary pages
        mapping.madvise(advice)
    return mapping


class BufferPool:
    """The publication buffers of one publisher, reused from version to version.

    A publication's buffers are sent zero-copy and kept while any worker may still fetch them, so
    each version is written into memory no live publication views. Fresh memory costs a page fault
    (and the kernel zeroing the page) per page touched, every version: in the 22M Qwen2 int8
    publication that was most of the time spent writing the codes (docs/benchmarks.md, weight sync).
    The pool hands out a mapping again once nothing views it any more: each buffer is handed out
    through a `memoryview` of its mapping, and a finalizer on that view returns the mapping to the
    free list when the last tensor, numpy array or zmq frame showing it is gone (from whichever thread
    drops it). A buffer in use is therefore never handed out twice, and nothing is copied.

    `trim(keep)` (called by `publish`) frees the free mappings beyond ``keep`` bytes, so the pool
    holds at most about one publication's worth of memory nobody uses; a publisher of one format
    keeps one pool (a different layout would find few mappings of its sizes)."""

    def __init__(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()  # between take and trim; _give_back only appends (atomic), so a
        # finalizer that the garbage collector runs inside take or trim cannot deadlock on it

    def take(self, nbytes: int) -> Tensor:
        """A uint8 tensor of ``nbytes`` over a free mapping of exactly that size, or a fresh one."""
        with self._lock:
            mapping = next((m for m in list(self._free) if len(m) == nbytes), None)
            if mapping is not None:
                self._free.remove(mapping)
        if mapping is None:
            mapping = _new_mapping(nbytes)
            if mapping is None:
                return torch.empty(nbytes, dtype=torch.uint8)
        view = memoryview(mapping)
        weakref.finalize(view, self._give_back, mapping)
        return torch.frombuffer(view, dtype=torch.uint8)  # the tensor keeps the view (and the mapping) alive

    def _give_back(self, mapping: mmap.mmap) -> None:
        self._free.append(mapping)

    def trim(self, keep: int) -> None:
        """Unmap free mappings, oldest first, until at most ``keep`` bytes of them are left."""
        with self._lock:
            while self._free and self.free_bytes() > keep:
                self._free.pop(0).close()

    def free_bytes(self) -> int:
        """Bytes of the mappings held for reuse (none of them viewed by anything)."""
        return sum(len(m) for m in list(self._free))


def quantizes_on_device(t: Tensor) -> bool:
    """Where `publish` quantises a weight: on the device that holds it. True for an accelerator (a CUDA
    learner's weights are quantised on its GPU, and only the codes and scales, 1/4 to 1/7 of the fp32
    bytes, cross to the host); False for the CPU (the codes are written straight into the send buffers)."""
    return t.device.type != "cpu"


def quantize_for_send(t: Tensor, fmt: str, *, name: str, blocks: Blocks,
                      on_device: bool | None = None) -> dict[str, Tensor]:
    """Quantise one target weight into host send buffers ({suffix: contiguous CPU tensor}).

    ``on_device`` (default `quantizes_on_device(t)`): True quantises where ``t`` lives with the one
    rule of formats.py, then copies each result once into a buffer (`Blocks.to_host`); False writes
    the codes of a CPU weight straight into the buffers. Both give the same bytes: the rule's ops are
    correctly rounded on every device (tested on CPU tensors through the on-device branch)."""
    if on_device is None:
        on_device = quantizes_on_device(t)
    if not on_device:
        if t.device.type != "cpu":
            t = t.to("cpu")
        return quantize_weight(t, fmt, name=name, alloc=blocks.empty)
    return {suffix: blocks.to_host(q) for suffix, q in quantize_weight(t, fmt, name=name).items()}
