"""A quantized base under LoRA (``learner.base_format``; QeRL, docs/algorithms.md §8c): the frozen weights of
the adapted linears are held packed in a low-bit format, so the learner's base takes a fraction of fp32.

Owns ``PackedLinear`` (a frozen linear holding its weight as the format's tensors: codes and scales, the
ones publication makes; asyncrl/quant/formats.py) and ``pack_lora_base``, which swaps each LoRA layer's
``base_layer`` for one.

How a packed linear computes: ``y = x @ Deq(codes)^T + b``, weight-only (activations untouched). The fp32
weight is decoded for the matmul and dropped; backward decodes it again for the input's gradient
(``_PackedMatmul``), so no decoded weight lives between forward and backward and the base costs its codes
(nvfp4: 4.5 bits a weight, int8: 8) plus one layer's decode at a time. The weight gets no gradient (frozen).

After packing, the parameters left (embedding, norms, adapters) are given their own memory: a model loaded from
safetensors is views of one memory-mapped file, which they would otherwise keep mapped, fp32 base and all
(SmolLM2-135M: 0.92 GB resident after packing to nvfp4, 0.63 GB with the copies).

The policy is then W' + s*B@A with W' = Deq(Quant(W)): what training, the KL reference (adapters disabled),
publication, export and evaluation all see (``policy.MergedLoraState`` reads a packed base through
``PackedLinear.dequantized``). Checkpoints keep the adapters and the codes (persistent buffers).

Never: packs a trainable weight, or anything but a LoRA layer's base.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from asyncrl.constants import BASE_FORMATS
from asyncrl.quant.formats import dequantize_weight, quantize_weight, weight_suffixes

__all__ = ["PackedLinear", "pack_lora_base"]


class _PackedMatmul(torch.autograd.Function):
    """x @ Deq(codes)^T, decoding again in backward instead of keeping the decoded weight."""

    @staticmethod
    def forward(ctx, x: Tensor, layer: PackedLinear) -> Tensor:
        ctx.layer = layer
        return F.linear(x, layer.dequantized().to(x.dtype))

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad @ ctx.layer.dequantized().to(grad.dtype), None


class PackedLinear(torch.nn.Module):
    """A frozen ``nn.Linear`` held as its weight's ``fmt`` tensors (module docstring)."""

    def __init__(self, linear: torch.nn.Linear, fmt: str, *, name: str | None = None) -> None:
        super().__init__()
        if linear.weight.requires_grad:
            raise ValueError(f"{name or 'this linear'} is trainable; only a frozen base is packed")
        self.fmt, self.in_features, self.out_features = fmt, linear.in_features, linear.out_features
        self._suffixes = tuple(weight_suffixes(fmt))
        for suffix, t in quantize_weight(linear.weight.detach().float(), fmt, name=name).items():
            self.register_buffer(suffix, t)
        self.bias = linear.bias  # frozen with the base (None for Llama/Qwen projections but q/k/v of Qwen2)

    def codes(self) -> dict[str, Tensor]:
        return {s: self.get_buffer(s) for s in self._suffixes}

    def dequantized(self) -> Tensor:
        """The [out, in] fp32 weight this layer computes with (a new tensor)."""
        return dequantize_weight(self.codes(), self.fmt, self.in_features)

    def forward(self, x: Tensor) -> Tensor:
        y = _PackedMatmul.apply(x, self)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


def pack_lora_base(model: torch.nn.Module, fmt: str) -> int:
    """Swap the ``base_layer`` of every LoRA layer of ``model`` (a PEFT model) for a ``PackedLinear`` in
    ``fmt``; returns how many. Call after the adapters exist and before sharding or an optimiser."""
    if fmt not in BASE_FORMATS or not fmt:
        raise ValueError(f"learner.base_format={fmt!r}: choose one of {', '.join(f for f in BASE_FORMATS if f)} "
                         "(or leave it empty for an fp32 base)")
    n = 0
    for name, mod in model.named_modules():
        base = getattr(mod, "base_layer", None)
        if isinstance(base, torch.nn.Linear) and hasattr(mod, "lora_A"):
            mod.base_layer = PackedLinear(base, fmt, name=f"{name}.base_layer.weight")
            n += 1
    if not n:
        raise ValueError("learner.base_format packs the base of LoRA layers, and this policy has none; set "
                         "learner.lora.rank > 0 or leave learner.base_format empty")
    # Hugging Face loads a safetensors file as views of one memory map; while any tensor (the embedding, the
    # norms) still views it, the fp32 bytes of every packed weight stay mapped. Own copies release it.
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    return n
