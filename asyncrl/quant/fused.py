"""Sibling fusion: q/k/v (and gate/up) projections as one GEMM, for the int8 and bf16 paths.

Owns: `SiblingGroup`, which makes the linears that read the same input (the q/k/v projections of one
attention block, the gate/up projections of one MLP) share one input conversion and one matmul, and
`fuse_siblings(model)`, which forms the groups.
    Int8Linear  one activation quantisation, one `torch._int_mm` over the stacked codes, then each
                member's own fp32 epilogue: bit-identical to the unfused modules (same codes, same
                per-token scales, exact int32 sums, same fp32 ops per column)
    Bf16Linear  one cast of x to bf16, one bf16 GEMM over the stacked weights, then each member's
                cast to fp32 and bias add: equal to the unfused modules up to the GEMM's summation
                order (every output element is the same K-term sum, rounded to bf16 once)

Storage: the group owns one contiguous [sum N_i, K] weight (codes and scales for int8) and bias; each
member's buffers are row-slice views of it. So state_dict names, shapes and bytes are unchanged, and
in-place loads (`load_published`, `load_state_dict`) update the fused storage directly: nothing can go
stale, and no storage moves across loads.

Call protocol: when a member is called with input x, the whole group is computed, the member gets
its slice and the other members' slices are kept for x. A sibling called next with the same tensor
object x takes its kept slice; any other input recomputes. This matches how Llama/Qwen2 attention
and MLP (and asyncrl's engine) call the projections: consecutively, on one unmodified hidden state.
Every returned output is contiguous, as an unfused module's is.

Must never: return a kept slice for a different input object. Moving the model (`.to()`, `.cuda()`)
dissolves the groups (members fall back to their own, now separate, buffers); call `fuse_siblings`
again afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .int8 import int8_epilogue, int_mm, quantize_act_int8
from .kernels import act_quant_int8_compiled, int8_epilogue_compiled, linear_bf16
from .linear import Bf16Linear, Int8Linear, QuantLinear

SIBLINGS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
FUSED_BUFFERS: dict[type[QuantLinear], tuple[str, ...]] = {
    Int8Linear: ("qweight", "weight_scale"),
    Bf16Linear: ("weight",),
}
"""Member classes that fuse, and the weight buffers their group stacks (the bias is stacked too)."""


class SiblingGroup:
    """Members of one class sharing input and fused storage (see the module docstring)."""

    def __init__(self, members: Sequence[QuantLinear]) -> None:
        kind = type(members[0])
        assert kind in FUSED_BUFFERS and all(type(m) is kind for m in members)
        k = members[0].in_features
        assert all(m.in_features == k for m in members)
        has_bias = [m.bias is not None for m in members]
        assert all(has_bias) or not any(has_bias)
        self.kind = kind
        self.members = list(members)
        self.names = FUSED_BUFFERS[kind]
        self.fused = {n: torch.cat([getattr(m, n) for m in members]).contiguous() for n in self.names}
        biases = [m.bias for m in members if m.bias is not None]
        self.bias = torch.cat(biases).contiguous() if has_bias[0] else None
        self.bounds: list[tuple[int, int]] = []
        start = 0
        for m in members:
            stop = start + m.out_features
            self.bounds.append((start, stop))
            for n in self.names:
                m._buffers[n] = self.fused[n][start:stop]
            if self.bias is not None:
                m._buffers["bias"] = self.bias[start:stop]
            m._group = self
            start = stop
        self._x: Tensor | None = None
        self._kept: dict[int, Tensor] = {}

    @property
    def codes(self) -> Tensor:
        """The stacked int8 codes [sum N, K] (int8 groups)."""
        return self.fused["qweight"]

    def is_intact(self) -> bool:
        """True while every member's buffers are still views of the fused storage."""
        for m, (a, _) in zip(self.members, self.bounds, strict=True):
            for n in self.names:
                if getattr(m, n).data_ptr() != self.fused[n][a:].data_ptr():
                    return False
            if self.bias is not None and (m.bias is None or m.bias.data_ptr() != self.bias[a:].data_ptr()):
                return False
        return True

    def dissolve(self) -> None:
        for m in self.members:
            m._group = None
        self._x, self._kept = None, {}

    def __call__(self, member: QuantLinear, x2: Tensor, x: Tensor) -> Tensor:
        """x2: [M, K] fp32 view of x -> member's output [M, N_member] fp32."""
        idx = self.members.index(member)
        if self._x is x and idx in self._kept:
            out = self._kept.pop(idx)
            if not self._kept:
                self._x = None
            return out
        parts = self._int8(x2) if self.kind is Int8Linear else self._bf16(x2)
        self._kept = {i: p for i, p in enumerate(parts) if i != idx}
        self._x = x
        return parts[idx]

    def _int8(self, x2: Tensor) -> list[Tensor]:
        compiled = self.members[0].kernel == "int_mm_compiled"
        qx, sx = (act_quant_int8_compiled if compiled else quantize_act_int8)(x2)
        acc = int_mm(qx, self.codes.t())  # [M, sum N] int32, exact
        scales = self.fused["weight_scale"]
        # Per-member epilogue (the fp32 ops of int8_linear) writing contiguous outputs: downstream
        # kernels (attention) may round differently on strided inputs, and no copy is needed.
        epilogue = int8_epilogue_compiled if compiled else int8_epilogue
        return [epilogue(acc[:, a:b], sx, scales[a:b], None if self.bias is None else self.bias[a:b])
                for a, b in self.bounds]

    def _bf16(self, x2: Tensor) -> list[Tensor]:
        yb = linear_bf16(x2, self.fused["weight"])  # [M, sum N] bf16
        parts = []
        for a, b in self.bounds:
            if self.bias is None:  # a contiguous fp32 copy of the column slice (the exact cast)
                parts.append(yb[:, a:b].to(torch.float32, memory_format=torch.contiguous_format))
            else:  # bf16 + fp32 promotes: fp32(fp32(y) + bias), the unfused cast-then-add, in one op
                parts.append(torch.add(yb[:, a:b], self.bias[a:b]))
        return parts


def fuse_siblings(model: nn.Module) -> int:
    """Group the int8 and bf16 siblings of every attention/MLP block of `model`; returns the number
    of groups formed. Blocks whose siblings are not all of one fusing class (Int8Linear, Bf16Linear)
    with equal in_features and uniform bias presence are left unfused."""
    n = 0
    for parent in model.modules():
        for names in SIBLINGS:
            mods = [getattr(parent, name, None) for name in names]
            kinds = {type(m) for m in mods}
            if len(kinds) != 1 or next(iter(kinds)) not in FUSED_BUFFERS:
                continue
            members = [m for m in mods if isinstance(m, QuantLinear)]
            if len({m.in_features for m in members}) != 1 or len({m.bias is None for m in members}) != 1:
                continue
            for m in members:
                if m._group is not None:
                    m._group.dissolve()
            SiblingGroup(members)
            n += 1
    return n

