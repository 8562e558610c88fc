"""Quantised linear modules that replace `nn.Linear` in a Hugging Face decoder.

Owns: one module class per compute path. A module's persistent buffers are exactly the tensors of
its format (formats.py), under the same names, so `model.state_dict()` of a quantised model has the
same keys, dtypes and shapes as a publication and `load_published` is a plain copy. Non-persistent
`_w*` buffers are compute caches derived from the persistent ones; `refresh()` rebuilds them and must
be called after the persistent buffers change (load_published does).

Compute paths (x [..., K] -> y [..., N], computed in fp32, cast back to x's dtype; the bias is added
in full precision after the scaled product):
    Bf16Linear     y = fp32(linear(bf16(x), weight_bf16)) + bias
    Int8Linear     W8A8: per-token int8 activations, `torch._int_mm`, int32 accumulation (int8.py);
                   q/k/v and gate/up siblings share one activation quantisation and one matmul
                   (fused.py), bit-identical to the unfused computation
    Fp8Linear      E4M3 weights, optional per-token E4M3 activations, scaled-GEMM rule (fp8.py)
    DecodedLinear  int8_wo / nvfp4 / mxfp4, weight-only: this CPU build has no fast kernel for them
                   (`_weight_int8pack_mm` measured ~15x slower than an fp32 GEMM), so the codes are
                   decoded once per load into an fp32 weight and y = linear(x, dequant(W)) + bias.

Must never: re-quantise in `forward`, or keep any state other than the buffers above.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .formats import dequantize_weight, quantize_weight, weight_suffixes
from .fp8 import fp8_linear
from .int8 import int8_linear, quantize_act_int8


class FusedGroup(Protocol):
    """What an ``Int8Linear`` needs of the sibling group it belongs to (``fused.SiblingGroup``).

    Declared here so that ``fused.py`` imports this module and not the other way round."""

    def __call__(self, member: Int8Linear, x2: Tensor, x: Tensor) -> Tensor: ...

    def is_intact(self) -> bool: ...

    def dissolve(self) -> None: ...


class QuantLinear(nn.Module):
    """Base class. Buffers: the format's weight tensors (+ `bias` if the source had one)."""

    fmt: str = ""
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
        self.refresh()

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, name: str | None = None, **opts: object) -> QuantLinear:
        """Quantise `linear.weight` with the format rule; the bias is copied in full precision."""
        tensors = quantize_weight(linear.weight, cls.fmt, name=name)
        return cls(linear.in_features, linear.out_features, tensors, linear.bias, **opts)

    def weight_tensors(self) -> dict[str, Tensor]:
        return {suffix: getattr(self, suffix) for suffix in weight_suffixes(self.fmt)}

    def refresh(self) -> None:
        """Rebuild compute caches from the persistent buffers (no-op by default)."""

    def _compute(self, x2: Tensor) -> Tensor:  # x2: [M, K] fp32 -> [M, N] fp32 (bias included)
        raise AssertionError("subclasses define _compute")

    def forward(self, x: Tensor) -> Tensor:
        """x: [..., in_features] -> [..., out_features], same dtype as x."""
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        y = self._compute(x2).reshape(*x.shape[:-1], self.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


class Bf16Linear(QuantLinear):
    fmt = "bf16"
    weight: Tensor

    def _compute(self, x2: Tensor) -> Tensor:
        y = F.linear(x2.to(torch.bfloat16), self.weight).float()
        return y if self.bias is None else y.add_(self.bias)


class Int8Linear(QuantLinear):
    """W8A8 with a real integer matmul. Siblings reading one input may be fused (fused.py)."""

    fmt = "int8"
    _group: FusedGroup | None = None

    qweight: Tensor
    weight_scale: Tensor

    def refresh(self) -> None:
        if self._group is not None and not self._group.is_intact():
            self._group.dissolve()

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Int8Linear:
        out = super()._apply(fn, recurse)
        self.refresh()  # a move/cast that replaced the buffers ends the fusion
        return out

    def forward(self, x: Tensor) -> Tensor:
        """x: [..., in_features] -> [..., out_features], same dtype as x."""
        if self._group is None:
            return super().forward(x)
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        y = self._group(self, x2, x).reshape(*x.shape[:-1], self.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def _compute(self, x2: Tensor) -> Tensor:
        qx, sx = quantize_act_int8(x2)
        return int8_linear(qx, sx, self.qweight, self.weight_scale, self.bias)


class Fp8Linear(QuantLinear):
    """E4M3 weights; per-token E4M3 activations unless `act_quant=False`."""

    fmt = "fp8"
    qweight: Tensor
    weight_scale: Tensor
    _w_codes: Tensor

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

    def refresh(self) -> None:
        # float8 -> fp32 is exact; the GEMM then multiplies the codes themselves (fp8.py rule).
        self.register_buffer("_w_codes", self.qweight.float(), persistent=False)

    def _compute(self, x2: Tensor) -> Tensor:
        return fp8_linear(x2, self._w_codes, self.weight_scale, self.bias, act_quant=self.act_quant)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", act_quant={self.act_quant}"


class DecodedLinear(QuantLinear):
    """Weight-only formats: decode once per load, fp32 GEMM per forward."""

    _w_decoded: Tensor

    def refresh(self) -> None:
        # Decode into the existing cache when it fits (a new version of the same model): no fresh
        # 4*N*K bytes to fault in per load, and references to the cache stay valid, as they do for
        # the persistent buffers `load_published` copies into.
        old = self._buffers.get("_w_decoded")
        codes = self.weight_tensors()["qweight"]
        fits = (old is not None and old.shape == (self.out_features, self.in_features)
                and old.dtype == torch.float32 and old.device == codes.device and old.is_contiguous())
        w = dequantize_weight(self.weight_tensors(), self.fmt, self.in_features, out=old if fits else None)
        self.register_buffer("_w_decoded", w.contiguous(), persistent=False)

    def _compute(self, x2: Tensor) -> Tensor:
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
