"""Quantised linear modules that replace `nn.Linear` in a Hugging Face decoder.

Owns: one module class per format. A module's persistent buffers are exactly the tensors of its
format (formats.py), under the same names, so `model.state_dict()` of a quantised model has the same
keys, dtypes and shapes as a publication and `load_published` is a plain copy. Non-persistent `_w*`
buffers are compute caches derived from the persistent ones; `refresh()` rebuilds them and must be
called after the persistent buffers change (load_published does). Every cache is an elementwise function
of the persistent buffers, so after a load that wrote only some of their elements (a delta,
`refresh(changed)`) a cache is rebuilt only at the elements those writes can change, the same bits as
a full rebuild; where that is not cheaper (most elements changed) or cannot be exact, it is rebuilt whole.

Compute paths (x [..., K] -> y [..., N], computed in fp32, cast back to x's dtype; the bias is added
in full precision after the scaled product). Which kernel runs is chosen per module from its device
and shape by `kernels.select_kernel` (module attribute `kernel`; kernels.py has the table):
    Bf16Linear     y = fp32(linear(bf16(x), weight_bf16)) + bias; q/k/v and gate/up siblings share
                   one cast and one GEMM (fused.py), equal to the unfused modules up to summation order
    Int8Linear     W8A8: per-token int8 activations, `torch._int_mm`, int32 accumulation (int8.py);
                   siblings share one activation quantisation and one matmul (fused.py), bit-identical;
                   on the GPU kernels the quantisation and the epilogue are one op each (ops.py; on CUDA
                   with Triton a Triton kernel and a compiled epilogue, same bits);
                   on a CPU without an int8 dot product an AVX2 kernel over the codes (`int_mm_avx2`,
                   cpu_int8.py), or where it cannot run the same sums from fp32 GEMMs over an fp32 copy
                   of the codes (`int_mm_fp32`); the same bits on every kernel
    Fp8Linear      E4M3 weights, optional per-token E4M3 activations: `torch._scaled_mm` on CUDA sm_89+,
                   elsewhere the emulated scaled-GEMM rule (fp8.py) over an fp32 copy of the codes
                   (siblings fuse, fused.py, as do the weight-only formats')
    DecodedLinear  int8_wo / nvfp4 / mxfp4, weight-only: decoded once per load into the compute dtype
                   (fp32 on CPU, bf16 on CUDA without Triton), y = linear(x, W) + bias; on CUDA with Triton
                   (`wo_triton`) one Triton GEMM reads the stored codes and scales and decodes in registers,
                   holding no decoded copy (triton_kernels.py). This CPU build has no fast kernel for them
                   (`_weight_int8pack_mm` is many times slower than an fp32 GEMM; docs/benchmarks.md §5).

Invariant (CUDA graphs, and references an engine holds): every buffer, cache included, keeps its
storage across `refresh()` and publication loads of the same model; only a move or cast (`.to()`)
makes new ones, and that re-selects the kernel for the new device.

Must never: re-quantise in `forward`, or keep any state other than the buffers above.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cpu_int8 import int8_linear_avx2
from .formats import (
    EMPTY_INDEX,
    dequantize_elements,
    dequantize_weight,
    quantize_weight,
    weight_elements,
    weight_suffixes,
)
from .fp8 import fp8_linear
from .int8 import int8_epilogue, int8_linear, int_mm, int_mm_fp32, quantize_act_int8, quantize_act_int8_f32
from .kernels import (
    HOLDS_DECODED,
    KERNELS,
    check_kernel,
    compute_dtype,
    linear_bf16,
    rowwise_fp32_supported,
    scaled_mm_fp8,
    select_kernel,
)
from .ops import int8_epilogue_op, quant_act_fp8, quant_act_int8
from .triton_kernels import wo_linear

CODES_REFRESH_FRAC = 1 / 40
"""Most elements of an fp32 code cache (`_w_codes`) converted one by one (`QuantLinear.refresh` with ``changed``):
where more were written the whole cache is converted, which then costs less (an indexed element ~10-20x a
converted one; on SmolLM2-135M int8, Zen 3, the two cost the same at ~1/35 of the codes)."""
DECODED_REFRESH_FRAC = 1 / 16
"""The same for a decoded weight (`_w_decoded`), whose full decode costs more per element (the same at ~1/12 of the
elements on SmolLM2-135M mxfp4, Zen 3)."""


class FusedGroup(Protocol):
    """What a member needs of the sibling group it belongs to (``fused.SiblingGroup``).

    Declared here so that ``fused.py`` imports this module and not the other way round."""

    def __call__(self, member: QuantLinear, x2: Tensor, x: Tensor) -> Tensor: ...

    def is_intact(self) -> bool: ...

    def dissolve(self) -> None: ...


class QuantLinear(nn.Module):
    """Base class. Buffers: the format's weight tensors (+ `bias` if the source had one)."""

    fmt: str = ""
    kernel: str = ""
    _group: FusedGroup | None = None
    # Buffers registered in __init__ (declared for the type checker; nn.Module stores them).
    bias: Tensor | None

    def __init__(
        self, in_features: int, out_features: int, tensors: Mapping[str, Tensor], bias: Tensor | None
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        assert set(tensors) == set(weight_suffixes(self.fmt)), (self.fmt, sorted(tensors))
        for suffix, t in tensors.items():
            self.register_buffer(suffix, t.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.kernel = self.default_kernel()
        self.refresh()

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, name: str | None = None, **opts: object) -> QuantLinear:
        """Quantise `linear.weight` with the format rule; the bias is copied in full precision."""
        tensors = quantize_weight(linear.weight, cls.fmt, name=name)
        return cls(linear.in_features, linear.out_features, tensors, linear.bias, **opts)

    def weight_tensors(self) -> dict[str, Tensor]:
        return {suffix: getattr(self, suffix) for suffix in weight_suffixes(self.fmt)}

    @property
    def device(self) -> torch.device:
        return next(iter(self.weight_tensors().values())).device

    def default_kernel(self) -> str:
        """The kernel this module runs where its buffers are (kernels.select_kernel)."""
        return select_kernel(self.fmt, self.device, self.out_features, self.in_features)

    def use_kernel(self, kernel: str) -> None:
        """Run `kernel` (one of kernels.KERNELS[fmt]) from now on, rebuilding the caches it needs: how a
        CPU test or benchmark runs a device kernel's computation on CPU tensors. ValueError if this
        format or shape cannot run it."""
        self.kernel = check_kernel(self.fmt, kernel, self.out_features, self.in_features)
        if self._group is not None:
            self._group.dissolve()
        self.refresh()

    def refresh(self, changed: Mapping[str, Tensor | None] | None = None,
                values: Mapping[str, Tensor] | None = None) -> None:
        """Rebuild compute caches from the persistent buffers, in place where they exist (so their
        storage survives every load); a sibling group whose storage was replaced is dissolved.

        ``changed``: after a load that wrote only some elements of the persistent buffers (a delta), which:
        {buffer name: flat int64 indices of the elements written (None: all of them)}, a buffer left out was
        not written. The caches are then rebuilt only where those writes can change them, which gives
        the bits of a full rebuild provided the caches matched the buffers before the load (they do after every
        load and every ``refresh``). ``values``: {buffer name: the values written at those indices, as the
        buffer's dtype or an integer view of its width}, where the caller has them (a cache of the codes is
        then rebuilt from them, without gathering them again)."""
        if self._group is not None and not self._group.is_intact():
            self._group.dissolve()
            changed = None  # the caches may no longer be the group's: rebuild them whole
        if changed is None or not self._refresh_caches_at(changed, values or {}):
            self._refresh_caches()

    def _refresh_caches(self) -> None:
        """Subclasses with caches rebuild them here (no-op by default)."""

    def _refresh_caches_at(self, changed: Mapping[str, Tensor | None], values: Mapping[str, Tensor]) -> bool:
        """Rebuild the caches only where the writes ``changed`` names can change them (see ``refresh``), in
        place; False, having changed nothing, where that is not exact or not cheaper: the caller then runs
        ``_refresh_caches``. Default: False."""
        return False

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> QuantLinear:
        out = super()._apply(fn, recurse)
        self.kernel = self.default_kernel()  # a move may change the device, and with it the kernel
        self.refresh()  # a move/cast that replaced the buffers ends the fusion
        return out

    def _compute(self, x2: Tensor) -> Tensor:  # x2: [M, K] fp32 -> [M, N] fp32 (bias included)
        raise AssertionError("subclasses define _compute")

    def forward(self, x: Tensor) -> Tensor:
        """x: [..., in_features] -> [..., out_features], same dtype as x."""
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        y = self._compute(x2) if self._group is None else self._group(self, x2, x)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, "
                f"kernel={self.kernel}")


class Bf16Linear(QuantLinear):
    """bf16 weights, bf16 GEMM. Siblings reading one input may be fused (fused.py)."""

    fmt = "bf16"
    weight: Tensor

    def default_kernel(self) -> str:
        return "bf16"

    def _compute(self, x2: Tensor) -> Tensor:
        y = linear_bf16(x2, self.weight).float()
        return y if self.bias is None else y.add_(self.bias)


class Int8Linear(QuantLinear):
    """W8A8 with exact integer sums. Siblings reading one input may be fused (fused.py).

    Kernels: ``int_mm`` and ``int_mm_compiled`` multiply the int8 codes themselves (`torch._int_mm`);
    ``int_mm_avx2`` runs the whole linear (quantisation, GEMM over the codes, epilogue) in one C call (cpu_int8.py);
    ``int_mm_fp32`` (a CPU without an int8 dot product) holds `_w_codes`, the codes as fp32 (exact),
    refreshed in place on every load, and computes the same int32 sums with fp32 GEMMs (int8.int_mm_fp32)."""

    fmt = "int8"
    qweight: Tensor
    weight_scale: Tensor
    _w_codes: Tensor | None

    def _refresh_caches(self) -> None:
        if self.kernel != "int_mm_fp32":
            self.register_buffer("_w_codes", None, persistent=False)
            return
        refresh_codes_f32(self)

    def _refresh_caches_at(self, changed: Mapping[str, Tensor | None], values: Mapping[str, Tensor]) -> bool:
        return self.kernel == "int_mm_fp32" and refresh_codes_f32_at(self, changed, values)

    def _compute(self, x2: Tensor) -> Tensor:
        if self.kernel == "int_mm_fp32":
            assert self._w_codes is not None
            qf, sx = quantize_act_int8_f32(x2)
            return int8_epilogue(int_mm_fp32(qf, self._w_codes.t()), sx, self.weight_scale, self.bias)
        if uses_int8_ops(self.kernel, x2):
            qx, sx = quant_act_int8(x2)
            return int8_epilogue_op(int_mm(qx, self.qweight.t()), sx, self.weight_scale, self.bias)
        if self.kernel == "int_mm_avx2":
            return int8_linear_avx2(x2, self.qweight, self.weight_scale, self.bias)
        qx, sx = quantize_act_int8(x2)
        return int8_linear(qx, sx, self.qweight, self.weight_scale, self.bias)


def uses_int8_ops(kernel: str, x2: Tensor) -> bool:
    """Whether an int8 linear on ``kernel`` quantises ``x2`` and applies its epilogue through the single ops of
    ops.py: on the GPU kernels (``int_mm_compiled``; ``int_mm`` on CUDA), where each saves kernel launches. A CPU
    kernel runs the same rule's eager ops, which cost less there than a custom op's dispatch."""
    return kernel == "int_mm_compiled" or (kernel == "int_mm" and x2.is_cuda)


def refresh_codes_f32(m: QuantLinear) -> None:
    """`m._w_codes` = its ``qweight`` codes as fp32 (int8 and E4M3 codes convert exactly), copied into the
    existing cache when it fits, so the cache's storage (and a sibling group's view of it) survives a load."""
    old, codes = m._buffers.get("_w_codes"), m._buffers["qweight"]
    assert codes is not None
    if old is not None and old.shape == codes.shape and old.device == codes.device and old.is_contiguous():
        old.copy_(codes)
    else:
        m.register_buffer("_w_codes", codes.float(), persistent=False)


def refresh_codes_f32_at(m: QuantLinear, changed: Mapping[str, Tensor | None],
                         values: Mapping[str, Tensor] | None = None) -> bool:
    """`refresh_codes_f32` after a load that wrote only the ``qweight`` elements ``changed`` names (QuantLinear.
    refresh): those codes (``values["qweight"]`` where given, else gathered from the codes) converted into the
    existing cache (the scales are not in it). False, changing nothing, when the cache does not fit the codes
    or more than `CODES_REFRESH_FRAC` of them were written."""
    cache, codes = m._buffers.get("_w_codes"), m._buffers["qweight"]
    assert codes is not None
    idx = changed.get("qweight", EMPTY_INDEX)
    if (idx is None or idx.numel() > codes.numel() * CODES_REFRESH_FRAC or cache is None
            or cache.shape != codes.shape or cache.device != codes.device or not cache.is_contiguous()):
        return False
    if idx.numel():
        new = (values or {}).get("qweight")
        if new is None or new.numel() != idx.numel() or new.device != codes.device:
            new = torch.index_select(codes.reshape(-1), 0, idx)
        cache.view(-1).scatter_(0, idx, new.view(codes.dtype).float())
    return True


class Fp8Linear(QuantLinear):
    """E4M3 weights; per-token E4M3 activations unless `act_quant=False`.

    Kernels: ``scaled_mm`` (CUDA sm_89+, N and K multiples of 16, W8A8 only) multiplies the codes
    themselves and holds no other copy of the weight; ``fp8_emul`` (everywhere else, and weight-only
    mode) holds `_w_codes`, the codes decoded to fp32 (exact), refreshed in place on every load."""

    fmt = "fp8"
    qweight: Tensor
    weight_scale: Tensor
    _w_codes: Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tensors: Mapping[str, Tensor],
        bias: Tensor | None,
        act_quant: bool = True,
    ) -> None:
        self.act_quant = bool(act_quant)
        super().__init__(in_features, out_features, tensors, bias)

    def default_kernel(self) -> str:
        return super().default_kernel() if self.act_quant else "fp8_emul"

    def use_kernel(self, kernel: str) -> None:
        if kernel == "scaled_mm" and not self.act_quant:
            raise ValueError("scaled_mm multiplies fp8 activations; weight-only fp8 (fp8_activations=False) "
                             "runs fp8_emul")
        super().use_kernel(kernel)

    def _refresh_caches(self) -> None:
        if self.kernel == "scaled_mm":
            self.register_buffer("_w_codes", None, persistent=False)
            rowwise_fp32_supported(self.device)  # probe now, never inside a captured step
            return
        refresh_codes_f32(self)

    def _refresh_caches_at(self, changed: Mapping[str, Tensor | None], values: Mapping[str, Tensor]) -> bool:
        return self.kernel != "scaled_mm" and refresh_codes_f32_at(self, changed, values)

    def _compute(self, x2: Tensor) -> Tensor:
        if self.kernel == "scaled_mm":
            qx, sx = quant_act_fp8(x2)
            y = scaled_mm_fp8(qx, sx, self.qweight, self.weight_scale)
            return y if self.bias is None else y.add_(self.bias)
        assert self._w_codes is not None
        return fp8_linear(x2, self._w_codes, self.weight_scale, self.bias, act_quant=self.act_quant)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", act_quant={self.act_quant}"


class DecodedLinear(QuantLinear):
    """Weight-only formats: decode once per load into the compute dtype (`wo_fp32`: fp32 on CPU;
    `wo_bf16`: bf16 on CUDA), one GEMM per forward; or (`wo_triton`) no decoded copy at all, one Triton GEMM
    over the stored codes and scales per forward (nothing to rebuild on a load)."""

    qweight: Tensor
    _w_decoded: Tensor | None

    def _refresh_caches(self) -> None:
        if self.kernel not in HOLDS_DECODED:
            self.register_buffer("_w_decoded", None, persistent=False)
            return
        # Decode into the existing cache when it fits (a new version of the same model): no fresh bytes
        # to fault in per load, and references to the cache (a captured CUDA graph) stay valid, as they
        # do for the persistent buffers `load_published` copies into.
        dtype = compute_dtype(self.kernel)
        old = self._buffers.get("_w_decoded")
        codes = self.qweight
        fits = (old is not None and old.shape == (self.out_features, self.in_features)
                and old.dtype == dtype and old.device == codes.device and old.is_contiguous())
        if dtype == torch.float32:
            w = dequantize_weight(self.weight_tensors(), self.fmt, self.in_features, out=old if fits else None)
        else:  # bf16_rne of the fp32 dequantised weight (exact for mxfp4, one rounding otherwise)
            w32 = dequantize_weight(self.weight_tensors(), self.fmt, self.in_features)
            w = old.copy_(w32) if fits and old is not None else w32.to(dtype)
        if not fits:
            self.register_buffer("_w_decoded", w.contiguous(), persistent=False)

    def _refresh_caches_at(self, changed: Mapping[str, Tensor | None], values: Mapping[str, Tensor]) -> bool:
        if self.kernel not in HOLDS_DECODED:
            return True  # no cache: the kernel reads the buffers the load wrote
        # the elements the writes can change (formats.weight_elements), decoded by the same ops, in place
        cache, codes = self._buffers.get("_w_decoded"), self.qweight
        n, k = self.out_features, self.in_features
        if (cache is None or cache.shape != (n, k) or cache.dtype != compute_dtype(self.kernel)
                or cache.device != codes.device or not cache.is_contiguous()):
            return False
        elements = weight_elements(self.fmt, n, k, changed, limit=int(n * k * DECODED_REFRESH_FRAC))
        if elements is None:
            return False
        if elements.numel():
            w = dequantize_elements(self.weight_tensors(), self.fmt, k, elements)
            cache.view(-1).index_copy_(0, elements, w if w.dtype == cache.dtype else w.to(cache.dtype))
        return True

    def _compute(self, x2: Tensor) -> Tensor:
        if self.kernel == "wo_triton":
            return wo_linear(x2, self.fmt, self.weight_tensors(), self.in_features, self.bias)
        assert self._w_decoded is not None
        if self.kernel == "wo_bf16":
            y = linear_bf16(x2, self._w_decoded).float()
            return y if self.bias is None else y.add_(self.bias)
        return F.linear(x2, self._w_decoded, self.bias)


class Int8WeightOnlyLinear(DecodedLinear):
    fmt = "int8_wo"


class Nvfp4Linear(DecodedLinear):
    fmt = "nvfp4"


class Mxfp4Linear(DecodedLinear):
    fmt = "mxfp4"


LINEAR_CLASSES: dict[str, type[QuantLinear]] = {
    cls.fmt: cls
    for cls in (Bf16Linear, Int8Linear, Int8WeightOnlyLinear, Fp8Linear, Nvfp4Linear, Mxfp4Linear)
}
assert set(LINEAR_CLASSES) == set(KERNELS)
