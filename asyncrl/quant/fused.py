"""Sibling fusion for the W8A8 int8 path: q/k/v (and gate/up) as one integer matmul.

Owns: `SiblingGroup`, which makes the int8 linears that read the same input (the q/k/v projections
of one attention block, the gate/up projections of one MLP) share one quantised activation and one
`torch._int_mm` call, and `fuse_int8_siblings(model)`, which forms the groups.

Storage: the group owns one contiguous [sum N_i, K] code matrix (and scales, biases); each member's
`qweight` / `weight_scale` / `bias` buffers are row-slice views of it. So state_dict names, shapes and
bytes are unchanged, and in-place loads (`load_published`, `load_state_dict`) update the fused
storage directly: nothing can go stale.

Call protocol: when a member is called with input x, the whole group is computed, the member gets
its slice and the other members' slices are kept for x. A sibling called next with the same tensor
object x takes its kept slice; any other input recomputes. This matches how Llama/Qwen2 attention
and MLP (and asyncrl's engine) call the projections: consecutively, on one unmodified hidden state.
Results are bit-identical to the unfused modules (same codes, same per-token scales, exact int32
sums, same fp32 epilogue per column), and returned contiguous, so everything downstream is too.

Must never: return a kept slice for a different input object. Moving the model (`.to()`, `.cuda()`)
dissolves the groups (members fall back to their own, now separate, buffers); call
`fuse_int8_siblings` again afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from .int8 import int_mm, quantize_act_int8
from .linear import Int8Linear

if TYPE_CHECKING:  # linear.py imports this module at run time
    from .linear import Int8Linear

SIBLINGS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SiblingGroup:
    """Int8Linear members sharing input and fused storage (see the module docstring)."""

    def __init__(self, members: Sequence[Int8Linear]) -> None:
        k = members[0].in_features
        assert all(m.in_features == k for m in members)
        has_bias = [m.bias is not None for m in members]
        assert all(has_bias) or not any(has_bias)
        self.members = list(members)
        self.codes = torch.cat([m.qweight for m in members]).contiguous()
        self.scales = torch.cat([m.weight_scale for m in members]).contiguous()
        biases = [m.bias for m in members if m.bias is not None]
        self.bias = torch.cat(biases).contiguous() if has_bias[0] else None
        self.bounds: list[tuple[int, int]] = []
        start = 0
        for m in members:
            stop = start + m.out_features
            self.bounds.append((start, stop))
            m._buffers["qweight"] = self.codes[start:stop]
            m._buffers["weight_scale"] = self.scales[start:stop]
            if self.bias is not None:
                m._buffers["bias"] = self.bias[start:stop]
            m._group = self
            start = stop
        self._x: Tensor | None = None
        self._kept: dict[int, Tensor] = {}

    def is_intact(self) -> bool:
        """True while every member's buffers are still views of the fused storage."""
        for m, (a, _) in zip(self.members, self.bounds, strict=True):
            if m.qweight.data_ptr() != self.codes[a].data_ptr():
                return False
            if m.weight_scale.data_ptr() != self.scales[a:].data_ptr():
                return False
            if self.bias is not None and (m.bias is None or m.bias.data_ptr() != self.bias[a:].data_ptr()):
                return False
        return True

    def dissolve(self) -> None:
        for m in self.members:
            m._group = None
        self._x, self._kept = None, {}

    def __call__(self, member: Int8Linear, x2: Tensor, x: Tensor) -> Tensor:
        """x2: [M, K] fp32 view of x -> member's output [M, N_member] fp32."""
        idx = self.members.index(member)
        if self._x is x and idx in self._kept:
            out = self._kept.pop(idx)
            if not self._kept:
                self._x = None
            return out
        qx, sx = quantize_act_int8(x2)
        acc = int_mm(qx, self.codes.t())  # [M, sum N] int32, exact
        # Per-member epilogue (same fp32 ops as int8_linear) writing contiguous outputs: downstream
        # kernels (attention) may round differently on strided inputs, and no copy is needed.
        parts = []
        for a, b in self.bounds:
            y = acc[:, a:b] * sx
            y.mul_(self.scales[a:b])
            if self.bias is not None:
                y.add_(self.bias[a:b])
            parts.append(y)
        self._kept = {i: p for i, p in enumerate(parts) if i != idx}
        self._x = x
        return parts[idx]


def fuse_int8_siblings(model: nn.Module) -> int:
    """Group the W8A8 siblings of every attention/MLP block of `model`; returns the number of
    groups formed. Blocks whose siblings are not all Int8Linear with equal in_features and uniform
    bias presence are left unfused."""
    n = 0
    for parent in model.modules():
        for names in SIBLINGS:
            mods = [m for name in names if type(m := getattr(parent, name, None)) is Int8Linear]
            if len(mods) != len(names):
                continue
            if len({m.in_features for m in mods}) != 1 or len({m.bias is None for m in mods}) != 1:
                continue
            for m in mods:
                if m._group is not None:
                    m._group.dissolve()
            SiblingGroup(mods)
            n += 1
    return n
