"""Sibling fusion: q/k/v (and gate/up) projections as one GEMM, for every quantised format.

Owns: `SiblingGroup`, which makes the linears that read the same input (the q/k/v projections of one
attention block, the gate/up projections of one MLP) share one input conversion and one matmul, and
`fuse_siblings(model)`, which forms the groups.
    Int8Linear  one activation quantisation, one `torch._int_mm` or `int_mm_avx2` (or `int_mm_fp32` over the stacked fp32
                copy of the codes) over the stacked codes, then each member's own fp32 epilogue:
                bit-identical to the unfused modules (same codes, same per-token scales, exact int32
                sums, same fp32 ops per column)
    Bf16Linear  one cast of x to bf16, one bf16 GEMM over the stacked weights, then each member's
                cast to fp32 and bias add: equal to the unfused modules up to the GEMM's summation
                order (every output element is the same K-term sum, rounded to bf16 once)
    Fp8Linear   one activation quantisation, one GEMM over the stacked codes (`_scaled_mm`, or the
                fp32 GEMM over the stacked decoded codes), then each member's scales and bias: equal to
                the unfused modules up to summation order
    weight-only one bf16 GEMM over the stacked decoded weights (`_w_decoded`, kernel wo_bf16, CUDA),
    (int8_wo,   then each member's bias: equal up to summation order. Only the decoded caches are stacked
    nvfp4,      (an nvfp4 member's global scale is its own); `refresh` decodes each member into its rows of
    mxfp4)      the stacked cache, in place. On CPU (wo_fp32) and on the Triton kernel (wo_triton, which holds
                no cache) they stay unfused (`UNFUSED_KERNELS`)
Members of a group run one kernel (kernels.py); `use_kernel` on a member dissolves its group.

Storage: the group owns one contiguous [sum N_i, K] weight (codes and scales for int8) and bias; each
member's buffers are row-slice views of it. So state_dict names, shapes and bytes are unchanged, and
in-place loads (`load_published`, `load_state_dict`) update the fused storage directly: nothing can go
stale, and no storage moves across loads.

Call protocol: when a member is called with input x, the whole group is computed, the member gets
its slice and the other members' slices are kept for x. A sibling called next with the same tensor
object x takes its kept slice; any other input recomputes. This matches how Llama/Qwen2 attention
and MLP (and asyncrl's engine) call the projections: consecutively, on one unmodified hidden state.
Every returned output is contiguous, as an unfused module's is. `SiblingGroup.forward_all` instead returns all
members' outputs side by side, each column the same bits, for a caller that splits them into views itself (the
native engine's decode layer: one epilogue per group).

Must never: return a kept slice for a different input object. Moving the model (`.to()`, `.cuda()`)
dissolves the groups (members fall back to their own, now separate, buffers); call `fuse_siblings`
again afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .cpu_int8 import int8_linear_avx2
from .fp8 import quantize_act_fp8
from .int8 import int8_epilogue, int_mm, int_mm_fp32, quantize_act_int8, quantize_act_int8_f32
from .kernels import KERNELS, linear_bf16, scaled_mm_fp8
from .linear import Bf16Linear, DecodedLinear, Fp8Linear, Int8Linear, QuantLinear, uses_int8_ops
from .ops import int8_epilogue_op, quant_act_fp8, quant_act_int8

SIBLINGS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
FUSED_BUFFERS: dict[type[QuantLinear], tuple[str, ...]] = {
    Int8Linear: ("qweight", "weight_scale"),
    Bf16Linear: ("weight",),
    Fp8Linear: ("qweight", "weight_scale"),
}
"""Persistent weight buffers a group of that class stacks (the bias and the compute caches too)."""


def stacked_names(m: QuantLinear) -> tuple[str, ...]:
    """The buffers of `m` a sibling group stacks: its class's weight buffers and its compute cache."""
    if isinstance(m, DecodedLinear):
        return ("_w_decoded",)
    names = FUSED_BUFFERS[type(m)]
    if m.kernel in ("fp8_emul", "int_mm_fp32"):
        names = (*names, "_w_codes")
    return names


UNFUSED_KERNELS = ("wo_fp32", "wo_triton")
"""Kernels whose siblings stay separate: on CPU each weight-only member's own `addmm` (bias fused into the
GEMM) beat one stacked GEMM plus a bias add per member, while int8, bf16 and fp8 gain from fusing
(docs/benchmarks.md §5, kernel choices). `wo_triton` reads each member's own stored codes and scales (an
nvfp4 member's global scale is its own) and holds no cache a group could stack."""


def fusable(m: object) -> bool:
    if not isinstance(m, QuantLinear) or m.kernel in UNFUSED_KERNELS:
        return False
    return type(m) in FUSED_BUFFERS or isinstance(m, DecodedLinear)


class SiblingGroup:
    """Members of one class sharing input and fused storage (see the module docstring)."""

    def __init__(self, members: Sequence[QuantLinear]) -> None:
        kind = type(members[0])
        assert fusable(members[0]) and all(type(m) is kind for m in members)
        assert len({(m.kernel, getattr(m, "act_quant", True)) for m in members}) == 1
        k = members[0].in_features
        assert all(m.in_features == k for m in members)
        has_bias = [m.bias is not None for m in members]
        assert all(has_bias) or not any(has_bias)
        self.kind = kind
        self.members = list(members)
        self.kernel = members[0].kernel
        self.act_quant = getattr(members[0], "act_quant", True)
        self.names = stacked_names(members[0])
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
        # where each member's stacked buffers (and bias) start in the fused storage, in bytes: what `is_intact`
        # compares (offsets, so that a deep copy of the model, whose storage is new, compares its own)
        stacked = {**self.fused, **({"bias": self.bias} if self.bias is not None else {})}
        self._starts = [(m._buffers, n, t, getattr(m, n).data_ptr() - t.data_ptr()) for m in members
                        for n, t in stacked.items()]
        self._x: Tensor | None = None
        self._kept: dict[int, Tensor] = {}

    @property
    def codes(self) -> Tensor:
        """The stacked int8 codes [sum N, K] (int8 groups)."""
        return self.fused["qweight"]

    def is_intact(self) -> bool:
        """True while every member's buffers are still views of the fused storage (each starts where it did)."""
        for buffers, n, fused, offset in self._starts:
            t = buffers.get(n)
            if t is None or t.data_ptr() != fused.data_ptr() + offset:
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
        parts = self._compute(x2)
        self._kept = {i: p for i, p in enumerate(parts) if i != idx}
        self._x = x
        return parts[idx]

    def _compute(self, x2: Tensor) -> list[Tensor]:
        """x2 [M, K] fp32 -> every member's output, contiguous [M, N_i] fp32, by the group's kernel."""
        k = self.kernel
        if k in KERNELS["int8"]:
            return self._int8(x2)
        if k in ("bf16", "wo_bf16"):
            return self._bf16(x2, self.fused["weight" if k == "bf16" else "_w_decoded"])
        scales = self.fused["weight_scale"]
        if k == "scaled_mm":
            q8, s8 = quant_act_fp8(x2)
            return self._split(scaled_mm_fp8(q8, s8, self.fused["qweight"], scales))
        assert k == "fp8_emul", k
        # fp8.fp8_linear's ops per element: the GEMM over the codes, times sx, times sw, plus bias
        sx: Tensor | None = None
        if self.act_quant:
            qx, sx = quantize_act_fp8(x2)
            y = torch.mm(qx, self.fused["_w_codes"].t())
        else:
            y = torch.mm(x2, self.fused["_w_codes"].t())
        parts = []
        for a, b in self.bounds:
            p = torch.mul(y[:, a:b], sx) if sx is not None else torch.mul(y[:, a:b], scales[a:b])
            if sx is not None:
                p.mul_(scales[a:b])
            if self.bias is not None:
                p.add_(self.bias[a:b])
            parts.append(p)
        return parts

    def forward_all(self, x2: Tensor) -> Tensor:
        """x2 [M, K] fp32 -> every member's output side by side, [M, sum N] fp32 (columns ``bounds``), each column
        the bits of that member's own output: the same GEMM, then the epilogue over the whole width in one pass
        (int8 epilogue, fp8 scales, bf16 cast or bias add: elementwise ops, correctly rounded per element) where
        ``__call__`` runs it once per member into contiguous outputs. For callers that take the columns as views
        (the native engine's decode step: one epilogue for q/k/v instead of three)."""
        k = self.kernel
        if k == "int_mm_avx2":
            return int8_linear_avx2(x2, self.codes, self.fused["weight_scale"], self.bias)
        if k in KERNELS["int8"]:
            ops = uses_int8_ops(k, x2)
            if k == "int_mm_fp32":
                qf, sx = quantize_act_int8_f32(x2)
                acc = int_mm_fp32(qf, self.fused["_w_codes"].t())
            else:
                qx, sx = (quant_act_int8 if ops else quantize_act_int8)(x2)
                acc = int_mm(qx, self.codes.t())
            return (int8_epilogue_op if ops else int8_epilogue)(acc, sx, self.fused["weight_scale"], self.bias)
        if k in ("bf16", "wo_bf16"):
            yb = linear_bf16(x2, self.fused["weight" if k == "bf16" else "_w_decoded"])
            return yb.float() if self.bias is None else torch.add(yb, self.bias)
        scales = self.fused["weight_scale"]
        if k == "scaled_mm":
            q8, s8 = quant_act_fp8(x2)
            y = scaled_mm_fp8(q8, s8, self.fused["qweight"], scales)
        else:
            assert k == "fp8_emul", k
            if self.act_quant:
                qx, sx = quantize_act_fp8(x2)
                y = torch.mm(qx, self.fused["_w_codes"].t()).mul_(sx).mul_(scales)
            else:
                y = torch.mm(x2, self.fused["_w_codes"].t()).mul_(scales)
        return y if self.bias is None else y.add_(self.bias)

    def _split(self, y: Tensor) -> list[Tensor]:
        """[M, sum N] fp32 -> each member's contiguous columns, plus its bias."""
        if self.bias is None:
            return [y[:, a:b].contiguous() for a, b in self.bounds]
        return [torch.add(y[:, a:b], self.bias[a:b]) for a, b in self.bounds]

    def _int8(self, x2: Tensor) -> list[Tensor]:
        if self.kernel == "int_mm_avx2":  # one call for the group: each member's columns copied out contiguous
            y = int8_linear_avx2(x2, self.codes, self.fused["weight_scale"], self.bias)
            return [y[:, a:b].contiguous() for a, b in self.bounds]
        ops = uses_int8_ops(self.kernel, x2)
        if self.kernel == "int_mm_fp32":
            qf, sx = quantize_act_int8_f32(x2)
            acc = int_mm_fp32(qf, self.fused["_w_codes"].t())  # [M, sum N] the same exact sums
        else:
            qx, sx = (quant_act_int8 if ops else quantize_act_int8)(x2)
            acc = int_mm(qx, self.codes.t())  # [M, sum N] int32, exact
        scales = self.fused["weight_scale"]
        # Per-member epilogue (the fp32 ops of int8_linear) writing contiguous outputs: downstream
        # kernels (attention) may round differently on strided inputs, and no copy is needed.
        epilogue = int8_epilogue_op if ops else int8_epilogue
        return [epilogue(acc[:, a:b], sx, scales[a:b], None if self.bias is None else self.bias[a:b])
                for a, b in self.bounds]

    def _bf16(self, x2: Tensor, w: Tensor) -> list[Tensor]:
        yb = linear_bf16(x2, w)  # [M, sum N] bf16
        parts = []
        for a, b in self.bounds:
            if self.bias is None:  # a contiguous fp32 copy of the column slice (the exact cast)
                parts.append(yb[:, a:b].to(torch.float32, memory_format=torch.contiguous_format))
            else:  # bf16 + fp32 promotes: fp32(fp32(y) + bias), the unfused cast-then-add, in one op
                parts.append(torch.add(yb[:, a:b], self.bias[a:b]))
        return parts


def fuse_siblings(model: nn.Module) -> int:
    """Group the quantised siblings of every attention/MLP block of `model`; returns the number of
    groups formed. Blocks whose siblings are not all of one class and one kernel, with equal
    in_features and uniform bias presence, are left unfused."""
    n = 0
    for parent in model.modules():
        for names in SIBLINGS:
            mods = [getattr(parent, name, None) for name in names]
            kinds = {type(m) for m in mods}
            if len(kinds) != 1 or not fusable(mods[0]):
                continue
            members = [m for m in mods if isinstance(m, QuantLinear)]
            if len({m.in_features for m in members}) != 1 or len({m.bias is None for m in members}) != 1:
                continue
            if len({(m.kernel, getattr(m, "act_quant", True)) for m in members}) != 1:
                continue
            for m in members:
                if m._group is not None:
                    m._group.dissolve()
            SiblingGroup(members)
            n += 1
    return n

