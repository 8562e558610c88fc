"""UAQ (docs/algorithms.md §8): fold the invariant scale s into RMSNorm gains and the next projections.

Owns: `fold_uaq` / `unfold_uaq` on fp32 master weights of a Llama/Qwen2 decoder, as a model (in
place) or a state dict (a new dict; the input is not modified).

Rule per decoder block and site (biases unchanged):
    attn_qkv     input_layernorm.weight          g <- fp32(g * s);  q/k/v_proj.weight   W <- fp32(W / s)
    mlp_gate_up  post_attention_layernorm.weight g <- fp32(g * s);  gate/up_proj.weight W <- fp32(W / s)
Unfold is the inverse (g / s, W * s); fold-then-unfold is bit-exact only for powers of two.
The full-precision function is unchanged up to fp32 rounding; per-row abs-max quantisers are
scale-equivariant, so the initial quantised model is unchanged too (exactly for powers of two; for
other s a code may move by one step where fp32(W / s) lands across a rounding boundary).

Must never: run on non-fp32 tensors unless s is a power of two (multiplying bf16 by 1.5 is inexact,
§8), or fold a site twice in one call. Folding is not recorded in the model: call it once, before RL
step 0 and before optimiser states exist, and keep s and the sites in the run config.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import TypeVar

import torch
from torch import Tensor, nn

from .errors import QuantError

UAQ_SITES: dict[str, tuple[str, tuple[str, ...]]] = {
    "attn_qkv": ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    "mlp_gate_up": ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
}

M = TypeVar("M", nn.Module, Mapping[str, Tensor])


def _plan(names: Sequence[str], sites: Sequence[str]) -> list[tuple[str, list[str]]]:
    """[(gain name, [linear weight names])] for every block and site; raises on a missing linear."""
    unknown = [s for s in sites if s not in UAQ_SITES]
    if unknown or len(set(sites)) != len(sites):
        raise QuantError(f"UAQ sites must be distinct entries of {sorted(UAQ_SITES)}, got {tuple(sites)}")
    present = set(names)
    plan: list[tuple[str, list[str]]] = []
    for site in sites:
        norm, linears = UAQ_SITES[site]
        pattern = re.compile(rf"^(.*\.)?{norm}\.weight$")
        gains = sorted(n for n in names if pattern.match(n))
        if not gains:
            raise QuantError(f"UAQ site {site!r}: no '*.{norm}.weight' found; expected a Llama/Qwen2 model")
        for gain in gains:
            prefix = gain[: -len(f"{norm}.weight")]
            ws = [f"{prefix}{lin}.weight" for lin in linears]
            missing = [w for w in ws if w not in present]
            if missing:
                raise QuantError(f"UAQ site {site!r}: {missing[0]!r} not found next to {gain!r}")
            plan.append((gain, ws))
    return plan


def _check_s(s: float) -> None:
    if not (math.isfinite(s) and s > 0):
        raise QuantError(f"UAQ scale s must be finite and > 0, got {s}")


def _check_dtype(name: str, t: Tensor, s: float) -> None:
    power_of_two = math.frexp(s)[0] == 0.5
    if t.dtype != torch.float32 and not power_of_two:
        raise QuantError(
            f"UAQ needs fp32 master weights for s={s} (bf16 * {s} is inexact), got {t.dtype}; fold "
            "before casting, or use a power-of-two s",
            tensor_name=name,
        )


def _apply(obj: M, s: float, sites: Sequence[str], *, fold: bool) -> M:
    _check_s(s)
    if isinstance(obj, nn.Module):
        _apply_to_model(obj, s, sites, fold=fold)
        return obj
    return _apply_to_state_dict(obj, s, sites, fold=fold)


def _apply_to_model(model: nn.Module, s: float, sites: Sequence[str], *, fold: bool) -> None:
    """In place on the model's parameters."""
    params = dict(model.named_parameters(remove_duplicate=False))
    plan = _plan(list(params), sites)
    for gain, ws in plan:
        for n in (gain, *ws):
            _check_dtype(n, params[n], s)
    with torch.no_grad():
        for gain, ws in plan:
            if fold:
                params[gain].mul_(s)
                for w in ws:
                    params[w].div_(s)
            else:
                params[gain].div_(s)
                for w in ws:
                    params[w].mul_(s)


def _apply_to_state_dict(
    state: Mapping[str, Tensor], s: float, sites: Sequence[str], *, fold: bool
) -> dict[str, Tensor]:
    """A new dict; ``state`` is left as is."""
    out = dict(state)
    plan = _plan(list(out), sites)
    for gain, ws in plan:
        for n in (gain, *ws):
            _check_dtype(n, out[n], s)
    for gain, ws in plan:
        out[gain] = out[gain].detach() * s if fold else out[gain].detach() / s
        for w in ws:
            out[w] = out[w].detach() / s if fold else out[w].detach() * s
    return out


def fold_uaq(model_or_state_dict: M, s: float = 1.5, sites: Sequence[str] = ("attn_qkv",)) -> M:
    """Fold s: gains *= s, following projection weights /= s. A model is changed in place and
    returned; a state dict is left as is and a new dict returned."""
    return _apply(model_or_state_dict, s, sites, fold=True)


def unfold_uaq(model_or_state_dict: M, s: float = 1.5, sites: Sequence[str] = ("attn_qkv",)) -> M:
    """Inverse of `fold_uaq` (for export): gains /= s, projection weights *= s."""
    return _apply(model_or_state_dict, s, sites, fold=False)
