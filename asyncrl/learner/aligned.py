"""Rollout-aligned forward (``learner.rollout_aligned``; QaRL §3.1, docs/algorithms.md §8b): the learner's
linears compute with the rollout format's quantised weights and activations, and straight-through
gradients reach the full-precision master weights.

Owns ``RolloutAlignment``: which modules of a policy it routes (the linears the actor quantises:
``asyncrl.quant.model.is_target_linear`` on the base model's names, so the same ones publication
quantises), their instance forwards, and the per-weight cache of the low-bit tensors.

How a routed linear computes (``asyncrl.quant.fake.AlignedLinear``): its value is the actor's module of the
rollout format run on the low-bit tensors of the weight (the same kernel, the same roundings), its gradient
the straight-through estimator's, to the master weight W of a plain linear:
    plain linear      y = Actor(codes(W))(x),                 dW = dy^T x_hat, dx = dy W_hat
    LoRA layer        y = Actor(codes(W + s*B@A))(x) + l - l.detach(),   l = s * B(A(x_hat))
with W_hat = Deq(codes) and x_hat the actor's rounding of x (no gradient through l's input). The LoRA form
has the value of the merged, quantised linear (the merge publication makes, policy.merge_lora) and the
gradients of the estimator through the merged weight (dA, dB as through W + s*B@A; dx through W_hat only)
without an [out, in] gradient per layer. The output head (``quant.lm_head``) is routed through a transform
the learner's chunked head (logprobs.py) applies. The token embedding held as int8 codes (``quant.embedding``)
is routed too (``asyncrl.quant.fake.AlignedEmbedding``): the actor's rows of the codes, a plain lookup's
gradient to the master table.

Cache: the low-bit tensors of each weight are made once per version and kept (in the format's own
dtype: int8 codes are a quarter of fp32) until the optimiser's next step; each forward builds the actor's
module on them (a weight-only one decodes them), backward decodes them again.
``adopt`` takes them from the publication of the same version instead (rank 0 at world size 1): one
quantisation per version, and the bits the learner computes with are the bits the workers received.
A cached entry is used only while its source tensors are unchanged (their storage and version counter).

The KL reference of a LoRA policy (its adapters disabled) is the frozen base through the same quantiser, so
reference and policy are computed alike; a full fine-tuning reference is a separate, unrouted copy.

Never: changes parameter names, state dicts or FSDP2's hooks (forwards are instance attributes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from asyncrl.learner.logprobs import HEAD_TRANSFORM
from asyncrl.learner.policy import base_model, merge_lora
from asyncrl.quant.embedding import EMBED_FORMAT, EMBED_SUFFIXES
from asyncrl.quant.fake import (
    AlignedEmbedding,
    AlignedLinear,
    act_rule,
    codes_to_weight,
    round_act,
    weight_codes,
)
from asyncrl.quant.formats import weight_suffixes
from asyncrl.quant.model import EMBED, HEAD, SHARED_TABLE_FORMATS, is_target_linear

__all__ = ["RolloutAlignment"]


_Key = tuple[tuple[int, int], ...]


def _key(tensors: Sequence[Tensor]) -> _Key:
    return tuple((t.data_ptr(), t._version) for t in tensors)


@dataclass
class _Entry:
    key: _Key
    codes: dict[str, Tensor]


class RolloutAlignment:
    """Routes a policy's quantised linears through the rollout format (module docstring).

    ``enabled`` decides whether the routed forwards quantise (the training forwards when
    ``learner.rollout_aligned``); ``full_precision()`` / ``quantized()`` switch it for one block (the
    mismatch decomposition runs both at the same weights). Call ``invalidate`` after every optimiser step
    (``watch`` registers it as the optimiser's post-step hook)."""

    def __init__(self, model: torch.nn.Module, fmt: str, *, keep_full_precision: Sequence[str],
                 head: bool = False, embedding: bool = False, fp8_activations: bool = True,
                 enabled: bool = True) -> None:
        if fmt == "fp32":
            raise ValueError("rollout alignment quantises the learner's forward like the actor's format, and "
                             "quant.fmt=fp32 has nothing to align to; choose a quantized quant.fmt or set "
                             "learner.rollout_aligned=false")
        self.fmt, self.enabled, self.fp8_activations = fmt, enabled, fp8_activations
        self.rule = act_rule(fmt, fp8_activations=fp8_activations)
        self._suffixes = tuple(weight_suffixes(fmt))
        self._cache: dict[str, _Entry] = {}
        self.quantizations = 0
        """Weights quantised by the learner itself (not adopted from a publication): a test's witness."""
        self.modules: dict[str, Any] = {}
        """Routed modules by the base model's names (nn.Linear or PEFT LoRA layers)."""
        for name, mod in base_model(model).named_modules():
            if ".base_layer" in f".{name}" or ".lora_" in f".{name}":
                continue
            if not is_target_linear(name, keep_full_precision, head=head):
                continue
            if hasattr(mod, "base_layer") and hasattr(mod, "lora_A"):
                self._route_lora(name, mod)
            elif isinstance(mod, torch.nn.Linear):
                if name == HEAD:
                    setattr(mod, HEAD_TRANSFORM, self._head_transform(name, mod))
                else:
                    self._route_plain(name, mod)
            else:
                continue
            self.modules[name] = mod
        self.embedding: torch.nn.Embedding | None = None
        """The routed token embedding (``embedding=True``), not in ``modules``: it is no linear."""
        if embedding:
            emb = base_model(model).get_submodule(EMBED)
            if not isinstance(emb, torch.nn.Embedding):
                raise ValueError(f"quant.embedding routes the token embedding {EMBED!r}, which this model does not "
                                 "have as an nn.Embedding; set quant.embedding=false")
            self._route_embedding(emb)
            self.embedding = emb
        # where a publication holds the embedding's codes: its own names, or a tied int8 head's (one table)
        head_mod = self.modules.get(HEAD)
        self._embedding_published = [EMBED] + ([HEAD] if head_mod is not None and fmt in SHARED_TABLE_FORMATS
                                               and self.embedding is not None
                                               and getattr(head_mod, "weight", None) is self.embedding.weight else [])
        if not self.modules:
            raise ValueError("no linear of this model is quantised by the rollout format (quant.keep_full_precision "
                             "keeps them all?); nothing to align")

    # -- switching ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def set_enabled(self, flag: bool) -> Iterator[None]:
        before, self.enabled = self.enabled, flag
        try:
            yield
        finally:
            self.enabled = before

    def full_precision(self) -> contextlib.AbstractContextManager:
        return self.set_enabled(False)

    def quantized(self) -> contextlib.AbstractContextManager:
        return self.set_enabled(True)

    def remove(self) -> None:
        """Give every routed module its own forward back (a measurement's temporary routes: no step of an
        unaligned run pays for them)."""
        for mod in [*self.modules.values(), *([self.embedding] if self.embedding is not None else [])]:
            vars(mod).pop("forward", None)
            vars(mod).pop(HEAD_TRANSFORM, None)
        self._cache.clear()

    @classmethod
    @contextlib.contextmanager
    def routed(cls, model: torch.nn.Module, fmt: str, **kw: Any) -> Iterator[RolloutAlignment]:
        """Routes installed for one block, removed after it."""
        al = cls(model, fmt, **kw)
        try:
            yield al
        finally:
            al.remove()

    def invalidate(self, *_args: object) -> None:
        """Forget every cached weight (the weights changed)."""
        self._cache.clear()

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Invalidate after each of ``optimizer``'s steps."""
        optimizer.register_step_post_hook(self.invalidate)

    # -- the low-bit weights -----------------------------------------------------------------------

    def _codes(self, name: str, sources: Sequence[Tensor], make: Callable[[], Tensor],
               fmt: str | None = None) -> dict[str, Tensor]:
        key = _key(sources)
        entry = self._cache.get(name)
        if entry is None or entry.key != key:
            with torch.no_grad():
                entry = _Entry(key, weight_codes(make(), fmt or self.fmt, name=f"{name}.weight"))
            self.quantizations += 1
            self._cache[name] = entry
        return entry.codes

    def weight(self, name: str) -> Tensor:
        """The fp32 weight module ``name``'s routed forward computes with now (no gradient)."""
        mod = self.modules[name]
        sources, make = self._sources(mod)
        return codes_to_weight(self._codes(name, sources, make), self.fmt, mod.in_features)

    def _sources(self, mod: Any) -> tuple[list[Tensor], Callable[[], Tensor]]:
        """The tensors a routed weight is made of (its cache key) and how to make it (no gradient)."""
        if hasattr(mod, "base_layer"):
            a, b, s = self._adapter(mod)
            w_key, w = _base(mod.base_layer)
            return [w_key, a.weight, b.weight], lambda: merge_lora(w(), a.weight.detach(), b.weight.detach(), s)
        return [mod.weight], lambda: mod.weight.detach()

    def adopt(self, published_tensors: Mapping[str, Tensor]) -> int:
        """Take each routed weight's low-bit tensors from a publication of the current weights (tensor name
        -> tensor, e.g. ``PublishedWeights.tensors``; copied, since publication buffers are reused).
        Returns how many were adopted (a weight the publication lacks is quantised when first used)."""
        n = 0
        for name, mod in self.modules.items():
            found = {s: published_tensors.get(f"{name}.{s}") for s in self._suffixes}
            if any(t is None for t in found.values()):
                continue
            sources, _ = self._sources(mod)
            self._cache[name] = _Entry(_key(sources), {s: t.clone() for s, t in found.items() if t is not None})
            n += 1
        if self.embedding is not None:
            for prefix in self._embedding_published:
                found = {s: published_tensors.get(f"{prefix}.{s}") for s in EMBED_SUFFIXES}
                if all(t is not None for t in found.values()):
                    self._cache[EMBED] = _Entry(_key([self.embedding.weight]),
                                                {s: t.clone() for s, t in found.items() if t is not None})
                    n += 1
                    break
        return n

    # -- forwards ----------------------------------------------------------------------------------

    @staticmethod
    def _adapter(mod: Any) -> tuple[Any, Any, float]:
        active = list(mod.active_adapters)
        if len(active) != 1:
            raise ValueError(f"rollout alignment needs exactly one active LoRA adapter, found {active}")
        name = active[0]
        if not isinstance(mod.lora_dropout[name], torch.nn.Identity):
            raise ValueError("rollout alignment publishes and trains the merged LoRA weight, which dropout on the "
                             "adapters' input would not be; set learner.lora.dropout=0")
        return mod.lora_A[name], mod.lora_B[name], float(mod.scaling[name])

    def _linear(self, x: Tensor, weight: Tensor | None, bias: Tensor | None, codes: dict[str, Tensor]) -> Tensor:
        return AlignedLinear.apply(x, weight, bias, codes, self.fmt, self.fp8_activations)

    def _route_plain(self, name: str, mod: torch.nn.Linear) -> None:
        def forward(x: Tensor) -> Tensor:
            if not self.enabled:
                return F.linear(x, mod.weight, mod.bias)
            sources, make = self._sources(mod)
            return self._linear(x, mod.weight, mod.bias, self._codes(name, sources, make))

        vars(mod)["forward"] = forward

    def _route_lora(self, name: str, mod: Any) -> None:
        own = type(mod).forward.__get__(mod)

        def forward(x: Tensor, *args, **kwargs) -> Tensor:
            if not self.enabled or getattr(mod, "merged", False):
                return own(x, *args, **kwargs)
            bias = mod.base_layer.bias
            if mod.disable_adapters:  # the KL reference: the frozen base, as the rollout format computes it
                w_key, w = _base(mod.base_layer)
                return self._linear(x, None, bias, self._codes(f"{name}:base", [w_key], w))
            a, b, s = self._adapter(mod)
            sources, make = self._sources(mod)
            y = self._linear(x, None, bias, self._codes(name, sources, make))
            x_hat = round_act(x, self.rule).view(x.shape).to(a.weight.dtype)
            low = b(a(x_hat)) * s  # the adapters' gradient through the merged weight (module docstring)
            return y + (low - low.detach()).to(y.dtype)

        vars(mod)["forward"] = forward

    def _route_embedding(self, mod: torch.nn.Embedding) -> None:
        def forward(ids: Tensor) -> Tensor:
            if not self.enabled:
                return F.embedding(ids, mod.weight, mod.padding_idx)
            codes = self._codes(EMBED, [mod.weight], mod.weight.detach, EMBED_FORMAT)
            return AlignedEmbedding.apply(mod.weight, ids, codes["qweight"], codes["weight_scale"], mod.padding_idx)

        vars(mod)["forward"] = forward

    def _head_transform(self, name: str, mod: torch.nn.Linear) -> Callable[[Tensor], tuple[Tensor, Callable]]:
        def transform(weight: Tensor) -> tuple[Tensor, Callable[..., Tensor]]:
            if not self.enabled:
                return weight, F.linear
            sources, make = self._sources(mod)
            codes = self._codes(name, sources, make)
            return weight, lambda h, w, b: self._linear(h, w, b, codes)

        return transform


def _base(layer: Any) -> tuple[Tensor, Callable[[], Tensor]]:
    """A LoRA layer's frozen base: the tensor that identifies its weight, and the fp32 weight (a packed base,
    packed.py, is decoded)."""
    if callable(getattr(layer, "dequantized", None)):
        return layer.qweight, layer.dequantized
    return layer.weight, layer.weight.detach
