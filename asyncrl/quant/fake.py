"""Rollout-aligned linears: the learner computes a quantised linear exactly as the actor does, on the low-bit
tensors of its own weight, with straight-through gradients to the full-precision weights (QaRL §3.1;
docs/algorithms.md §8b).

Owns: the rounding each format applies to a linear's input (`act_rule`, `round_act`), the weight's round trip
through the published tensors (`weight_codes`, `codes_to_weight`) and `AlignedLinear`, the autograd function
whose value is the actor's and whose gradient is the straight-through estimator's.

Value: the actor's own module (linear.py: `Int8Linear`, `Fp8Linear`, `Bf16Linear`, the decoded weight-only
formats) built on the low-bit tensors, running the kernel it runs on this device. So an int8 linear sums the
integer codes exactly and scales them as the actor does, a bf16 one rounds its inputs and its output to bf16, a
weight-only one multiplies by the decoded weight: the same numbers, not an imitation in fp32 (on a model with
large activation outliers, SmolLM2, one flipped activation code per token compounds over 30 layers into log-prob
differences as large as quantisation itself, so an imitation that sums in another order is no alignment).
What still differs from the sampler is the batch shape (prefill vs decode, padding) and the attention kernel.

Gradient (straight-through): with W = Deq(codes) and x_hat the actor's rounding of the input x,
    dx = dy @ W,   dW_master = dy^T @ x_hat,   dbias = sum dy,
as if the roundings were the identity: the master weights get the gradient of the quantised forward.

The token embedding held as int8 codes (``quant.embedding``, embedding.py) is aligned the same way by
`AlignedEmbedding`: its value is the actor's lookup of rows of the codes, its gradient that of a plain lookup
(each row's gradient to the master table's row, none to ``padding_idx``).

Must never: change a tensor in place, or round with any rule other than the formats' own.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from .embedding import dequantize_rows
from .formats import check_format, dequantize_weight, quantize_weight
from .fp8 import quantize_act_fp8
from .int8 import quantize_act_int8_f32
from .linear import LINEAR_CLASSES

ACT_RULES = ("int8", "fp8", "bf16")
"""The activation roundings `fake_quant_act` applies (None: activations untouched)."""


def act_rule(fmt: str, *, fp8_activations: bool = True) -> str | None:
    """The rounding the actor of format ``fmt`` applies to a linear's input, or None."""
    check_format(fmt)
    if fmt == "int8":
        return "int8"
    if fmt == "fp8":
        return "fp8" if fp8_activations else None
    if fmt == "bf16":
        return "bf16"
    return None


def round_act(x: Tensor, rule: str | None) -> Tensor:
    """``x`` ([..., K], any float dtype) rounded per token (row of the last dim) as the actor rounds a
    linear's input, as fp32 [M, K] rows, no gradient; ``x`` itself (as fp32 rows) for None."""
    x2 = x.detach().reshape(-1, x.shape[-1]).float()
    if rule is None:
        return x2
    if rule == "int8":
        codes, scale = quantize_act_int8_f32(x2)
        return codes.mul_(scale)
    if rule == "fp8":
        codes, scale = quantize_act_fp8(x2)
        return codes.mul_(scale)
    if rule == "bf16":
        return x2.to(torch.bfloat16).float()
    raise ValueError(f"unknown activation rounding {rule!r}; use one of {ACT_RULES}")


class AlignedLinear(torch.autograd.Function):
    """The value of the actor's linear on the learner's low-bit tensors, the gradients of the straight-through
    estimator (module docstring).

    ``apply(x, weight, bias, codes, fmt, fp8_activations)``: x [..., K]; ``weight`` the full-precision weight the
    estimator passes the gradient to (None: no weight gradient, e.g. a LoRA base); ``codes`` the format's
    tensors of the weight (formats.py). Forward: the actor's own module (linear.py) built on ``codes`` computes
    ``y`` with the kernel it runs on this device: the same integer sums, the same bf16 rounding, the same order
    of scale multiplications. Backward, with W = Deq(codes) and x_hat = the actor's rounding of x:
    dx = dy @ W, dweight = dy^T @ x_hat, dbias = sum dy."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, bias: Tensor | None,
                codes: Mapping[str, Tensor], fmt: str, fp8_activations: bool) -> Tensor:
        k = x.shape[-1]
        n = next(iter(codes.values())).shape[0]
        opts = {"act_quant": fp8_activations} if fmt == "fp8" else {}
        actor = LINEAR_CLASSES[fmt](k, n, codes, None if bias is None else bias.detach(), **opts)
        ctx.save_for_backward(x)
        ctx.codes, ctx.fmt, ctx.k, ctx.n = codes, fmt, k, n
        ctx.rule = act_rule(fmt, fp8_activations=fp8_activations)
        with torch.no_grad():
            return actor(x.detach())

    @staticmethod
    def backward(ctx, *grads: Tensor):
        (x,) = ctx.saved_tensors
        gy = grads[0].reshape(-1, ctx.n).float()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = (gy @ dequantize_weight(ctx.codes, ctx.fmt, ctx.k)).reshape(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            gw = gy.t() @ round_act(x, ctx.rule)
        if ctx.needs_input_grad[2]:
            gb = gy.sum(0)
        return gx, gw, gb, None, None, None


class AlignedEmbedding(torch.autograd.Function):
    """``apply(weight, ids, codes, scale, padding_idx)``: rows ``ids`` of the actor's int8 table (``codes``
    [V, H], ``scale`` [V]; embedding.py `dequantize_rows`), with the gradient of ``F.embedding(ids, weight)``
    to the full-precision ``weight`` (straight through the rounding; ``padding_idx`` None or a row)."""

    @staticmethod
    def forward(ctx, weight: Tensor, ids: Tensor, codes: Tensor, scale: Tensor, padding_idx: int | None) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.rows, ctx.padding_idx = weight.shape[0], -1 if padding_idx is None else padding_idx
        return dequantize_rows(codes, scale, ids).to(weight.dtype)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        (ids,) = ctx.saved_tensors
        gw = None
        if ctx.needs_input_grad[0]:
            gw = torch.ops.aten.embedding_dense_backward(grads[0], ids, ctx.rows, ctx.padding_idx, False)
        return gw, None, None, None, None


def weight_codes(w: Tensor, fmt: str, *, name: str | None = None) -> dict[str, Tensor]:
    """The tensors publication makes of the linear weight ``w`` ([N, K]) in ``fmt`` (formats.py)."""
    return quantize_weight(w.detach(), fmt, name=name)


def codes_to_weight(codes: Mapping[str, Tensor], fmt: str, in_features: int) -> Tensor:
    """The [N, in_features] fp32 weight the actor computes with, from its published tensors."""
    return dequantize_weight(codes, fmt, in_features)
