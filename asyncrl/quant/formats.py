"""Format registry: one `quantize_weight` / `dequantize_weight` pair over all formats.

Owns: the names and roles of the tensors that stand for one linear weight in each format,
and the dispatch to the per-format rules (int8.py, fp8.py, fp4.py). Quantised modules (linear.py) and
publication (publish.py) both go through `quantize_weight`, so a published copy is bit-identical to a
locally quantised one by construction.

Tensors per linear weight `P.weight` [N, K] (names relative to the module prefix `P.`):
    fp32     weight [N, K] fp32 (untouched)                                   role "weight"
    bf16     weight [N, K] bf16 (round-to-nearest-even cast)                  role "weight"
    int8     qweight [N, K] int8, weight_scale [N] fp32                       roles "codes", "scale"
    int8_wo  same tensors as int8 (activations stay full precision)
    fp8      qweight [N, K] float8_e4m3fn, weight_scale [N] fp32
    nvfp4    qweight [N, Kp/2] uint8, weight_scale [N, Kp/16] float8_e4m3fn, weight_global_scale [] fp32
    mxfp4    qweight [N, Kp/2] uint8, weight_scale [N, Kp/32] float8_e8m0fnu
Biases, norms, embeddings and kept linears are "full_precision" and never converted.

Dequantisation is elementwise: each element of the [N, K] weight is its code's value times its row's or
block's scale (nvfp4: times the global scale), so `weight_elements` can name the elements that writing some
elements of these tensors can change and `dequantize_elements` compute just those, with the same fp32 ops
as `dequantize_weight` (the same bits).

Must never: hold state; every function is pure.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from protocols.values import FORMATS

from . import fp4, fp8, int8
from .errors import UnknownFormatError

ROLE_WEIGHT = "weight"
ROLE_CODES = "codes"
ROLE_SCALE = "scale"
ROLE_GLOBAL_SCALE = "global_scale"
ROLE_FULL = "full_precision"
EMPTY_INDEX = torch.empty(0, dtype=torch.int64)
"""No element (the flat indices of `weight_elements` and of ``QuantLinear.refresh``'s ``changed``)."""

_SUFFIX_ROLES: dict[str, dict[str, str]] = {
    "fp32": {"weight": ROLE_WEIGHT},
    "bf16": {"weight": ROLE_WEIGHT},
    "int8": {"qweight": ROLE_CODES, "weight_scale": ROLE_SCALE},
    "int8_wo": {"qweight": ROLE_CODES, "weight_scale": ROLE_SCALE},
    "fp8": {"qweight": ROLE_CODES, "weight_scale": ROLE_SCALE},
    "nvfp4": {"qweight": ROLE_CODES, "weight_scale": ROLE_SCALE, "weight_global_scale": ROLE_GLOBAL_SCALE},
    "mxfp4": {"qweight": ROLE_CODES, "weight_scale": ROLE_SCALE},
}


def check_format(fmt: str) -> str:
    """Return `fmt` if known, else raise UnknownFormatError listing the choices."""
    if fmt not in FORMATS:
        raise UnknownFormatError(f"unknown quantisation format {fmt!r}; choose one of {FORMATS}")
    return fmt


def weight_suffixes(fmt: str) -> dict[str, str]:
    """Tensor names (relative to the module prefix) standing for one linear weight -> their roles."""
    return dict(_SUFFIX_ROLES[check_format(fmt)])


def quantize_weight(w: Tensor, fmt: str, *, name: str | None = None,
                    alloc: int8.Alloc | None = None) -> dict[str, Tensor]:
    """Quantise one linear weight. w: [N, K] float. Returns {suffix: tensor} as in the module
    docstring (contiguous, on w's device). Raises QuantError naming `name` on bad input.
    ``alloc(shape, dtype)`` makes the codes tensor of the int8 and fp4 formats (default
    ``torch.empty`` on w's device): publication writes them straight into its send buffers."""
    check_format(fmt)
    if fmt == "fp32":
        int8.check_matrix(w, name)
        return {"weight": w.detach().float().contiguous()}
    if fmt == "bf16":
        int8.check_matrix(w, name)
        return {"weight": w.detach().to(torch.bfloat16).contiguous()}
    w = w.detach()
    if fmt in ("int8", "int8_wo"):
        if fmt == "int8":  # the K limit only; finiteness is read off the row amax in quantize_int8_rows
            int8.check_matrix(w, name, max_k=int8.INT8_MAX_K, finite=False)
        codes, scale = int8.quantize_int8_rows(w, name=name, alloc=alloc)
        return {"qweight": codes, "weight_scale": scale}
    if fmt == "fp8":
        codes, scale = fp8.quantize_fp8_rows(w, name=name)
        return {"qweight": codes, "weight_scale": scale}
    if fmt == "nvfp4":
        packed, sb, gs = fp4.quantize_nvfp4(w, name=name, alloc=alloc)
        return {"qweight": packed, "weight_scale": sb, "weight_global_scale": gs}
    assert fmt == "mxfp4"
    packed, sc = fp4.quantize_mxfp4(w, name=name, alloc=alloc)
    return {"qweight": packed, "weight_scale": sc}


def dequantize_weight(tensors: Mapping[str, Tensor], fmt: str, in_features: int, *,
                      out: Tensor | None = None) -> Tensor:
    """Inverse of `quantize_weight`: {suffix: tensor} -> [N, in_features] fp32, written into `out`
    (a contiguous [N, in_features] fp32 tensor) when given: the fp4 formats decode straight into it."""
    check_format(fmt)
    if fmt == "nvfp4":
        return fp4.dequantize_nvfp4(
            tensors["qweight"], tensors["weight_scale"], tensors["weight_global_scale"], in_features, out=out
        )
    if fmt == "mxfp4":
        return fp4.dequantize_mxfp4(tensors["qweight"], tensors["weight_scale"], in_features, out=out)
    if fmt in ("fp32", "bf16"):
        w = tensors["weight"].float()
    elif fmt in ("int8", "int8_wo"):
        w = int8.dequantize_int8(tensors["qweight"], tensors["weight_scale"])
    else:
        w = fp8.dequantize_fp8(tensors["qweight"], tensors["weight_scale"])
    return w if out is None else out.copy_(w)


def weight_elements(fmt: str, out_features: int, in_features: int, changed: Mapping[str, Tensor | None],
                    limit: int) -> Tensor | None:
    """The flat indices (int64, into the [out_features, in_features] weight; possibly repeated) of every element
    whose dequantised value can change when the elements ``changed`` names are written: {suffix: flat indices
    into that tensor (None: all of it)}, a suffix left out was not written. None when that may be more than
    ``limit`` elements (or every element: an nvfp4 global scale, a tensor written whole): dequantise it whole."""
    check_format(fmt)
    k = in_features
    if any(idx is None for idx in changed.values()):
        return None
    gs = changed.get("weight_global_scale")
    if gs is not None and gs.numel():  # nvfp4: it scales every element
        return None
    if fmt in ("fp32", "bf16"):  # the weight itself
        w = changed.get("weight", EMPTY_INDEX)
        return None if w is None or w.numel() > limit else w
    codes, scales = changed.get("qweight"), changed.get("weight_scale")
    block = {"nvfp4": fp4.NVFP4_BLOCK, "mxfp4": fp4.MXFP4_BLOCK}.get(fmt, k)  # int8 and fp8: a row is a block
    padded = -(-k // block) * block  # the columns stored per row (fp4: padding columns included)
    out: list[Tensor] = []  # indices into the stored [out_features, padded] layout
    if scales is not None:
        if scales.numel() * block > limit:
            return None
        out.append(((scales * block)[:, None] + torch.arange(block, device=scales.device)).reshape(-1))
    if codes is not None:
        out += [codes * 2, codes * 2 + 1] if fmt in ("nvfp4", "mxfp4") else [codes]  # fp4: two codes a byte
    if sum(t.numel() for t in out) > limit:
        return None
    elements = torch.cat(out) if out else EMPTY_INDEX
    if padded != k:  # to the logical layout, padding columns left out
        rows = elements // padded
        cols = elements - rows * padded
        elements = (rows * k + cols)[cols < k]
    return elements


def dequantize_elements(tensors: Mapping[str, Tensor], fmt: str, in_features: int, elements: Tensor) -> Tensor:
    """`dequantize_weight(tensors, fmt, in_features).view(-1)[elements]`, computed at those elements only (flat
    int64 indices into the [N, in_features] weight), by the same fp32 ops: the same bits. Returns [n] fp32."""
    check_format(fmt)
    if fmt == "nvfp4":
        return fp4.nvfp4_elements(tensors["qweight"], tensors["weight_scale"], tensors["weight_global_scale"],
                                  elements, in_features)
    if fmt == "mxfp4":
        return fp4.mxfp4_elements(tensors["qweight"], tensors["weight_scale"], elements, in_features)
    if fmt in ("fp32", "bf16"):
        return tensors["weight"].reshape(-1)[elements].float()
    codes = torch.index_select(tensors["qweight"].reshape(-1), 0, elements).float()
    return codes.mul_(torch.index_select(tensors["weight_scale"], 0, elements // in_features))
