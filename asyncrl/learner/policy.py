"""Building the trained policy: threads, LoRA adapters (PEFT), activation checkpointing, sharding,
the KL reference, and the policy's weights in the base model's names.

Owns how a loaded Hugging Face causal LM becomes the module ``train_step`` trains:
  1. ``apply_lora`` (optional): PEFT ``LoraConfig`` adapters; only adapters are trainable.
  2. ``checkpoint_decoder_layers`` (optional): each decoder layer's forward runs under
     non-reentrant activation checkpointing when grad is on (its activations are recomputed in
     backward instead of kept).
  3. World size 1: no wrapper (plain parameters, no FSDP hooks or DTensors). World size > 1:
     FSDP2 (``fsdp.shard_model``).
And ``policy_state_dict``: the full state dict in the base model's own names with every LoRA
adapter merged into its base weight (what is published, evaluated, hashed and exported), merged
one weight at a time as it is read.

Never does: load files, build optimisers, or train.

Invariants:
* Activation checkpointing changes memory and time, never values: the recompute runs the same
  ops on the same inputs (autocast state included).
* ``policy_state_dict`` of a LoRA policy equals the weights of ``peft``'s ``merge_and_unload``
  (W + scaling * B @ A, computed out of place: the trained base is never modified, so no
  merge/unmerge rounding accumulates). Without LoRA at world size 1 its tensors are the live
  parameters (no copy; consumers only read them before the next step).
* The LoRA reference policy for KL is the policy with adapters disabled (the frozen base); a
  full fine-tuning reference is a frozen copy of the initial weights, sharded like the policy.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch.utils.checkpoint import checkpoint

from asyncrl.learner.fsdp import DistInfo, decoder_layers, full_state_dict, shard_model

__all__ = [
    "LoraSpec",
    "default_num_threads",
    "apply_lora",
    "decoder_linear_names",
    "lora_targets",
    "checkpoint_decoder_layers",
    "prepare_policy",
    "reference_policy",
    "base_model",
    "is_lora",
    "policy_state_dict",
    "MergedLoraState",
    "merge_lora",
    "runtime_buffers",
]

_PEFT_PREFIX = "base_model.model."
log = logging.getLogger("asyncrl.learner")


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraSpec:
    """PEFT LoRA settings (``learner.lora``): rank r, alpha (scaling alpha / r), the module names
    adapted (``target_modules``, PEFT's matching), and the adapters' dropout."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"learner.lora.rank must be >= 1 (0 disables LoRA), got {self.rank}")
        if not self.target_modules:
            raise ValueError("learner.lora.target_modules is empty; name the projections to adapt, e.g. [q_proj, v_proj]")
        if "lm_head" in self.target_modules or "embed_tokens" in self.target_modules:
            raise ValueError(
                "learner.lora.target_modules may not include lm_head or embed_tokens (the learner projects "
                "through the LM head itself and SmolLM2/Qwen2 tie it to the embedding); adapt the decoder "
                "projections, e.g. [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"learner.lora.dropout must be in [0, 1), got {self.dropout}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def default_num_threads(num_workers: int, world_size: int, cpus: int | None = None) -> int:
    """Intra-op threads per learner rank when ``learner.num_threads`` is 0: the CPUs this process
    may use, less one per generation worker on this machine, shared by the ranks (at least 1)."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, (cpus - max(0, num_workers)) // max(1, world_size))


def decoder_linear_names(model: torch.nn.Module) -> list[str]:
    """The distinct names of the ``nn.Linear`` modules inside the model's decoder blocks (the projections
    LoRA can adapt), e.g. ``[down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj]``."""
    return sorted({n.split(".")[-1] for layer in decoder_layers(model) for n, m in layer.named_modules()
                   if isinstance(m, torch.nn.Linear)})


def lora_targets(model: torch.nn.Module, wanted: tuple[str, ...]) -> tuple[list[str], str]:
    """The ``target_modules`` LoRA gets on ``model`` and a note on what changed ("" when nothing did):
    the configured names the model has; when it has none of them, every linear name of its decoder blocks
    (a Qwen3-MoE has q/k/v/o_proj but its experts are fused tensors, a GPT-NeoX has query_key_value, ...).
    ``ValueError`` naming the model's projections when its decoder blocks hold no linear layer at all."""
    present = {n.split(".")[-1] for n, _ in model.named_modules()}
    kept = [t for t in wanted if t in present]
    dropped = [t for t in wanted if t not in present]
    if kept:
        return kept, (f"learner.lora.target_modules {dropped} are not modules of this model; adapting {kept}"
                      if dropped else "")
    own = decoder_linear_names(model)
    if not own:
        names = sorted({n.split(".")[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ValueError(f"learner.lora.target_modules {list(wanted)} match no module and the decoder blocks hold "
                         f"no linear layer; name some of this model's linear layers {names} in "
                         "learner.lora.target_modules")
    return own, f"learner.lora.target_modules {list(wanted)} match no module; adapting the model's own {own}"


def apply_lora(model: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    """Wrap ``model`` in a PEFT ``PeftModel`` with LoRA adapters on ``lora_targets``; base weights frozen."""
    from peft import LoraConfig, get_peft_model

    targets, note = lora_targets(model, spec.target_modules)
    if note:
        log.warning("%s", note)
    # PEFT annotates lora_alpha as int but only computes lora_alpha / r, so a fractional alpha is valid.
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=targets,  # type: ignore[arg-type]
                        lora_dropout=spec.dropout, bias="none", task_type="CAUSAL_LM")  # fmt: skip
    return get_peft_model(model, config)


class _PeftWrapper(Protocol):
    """What asyncrl uses of a PEFT ``PeftModel`` (recognised by ``is_lora`` without importing peft)."""

    def get_base_model(self) -> torch.nn.Module: ...


def is_lora(model: torch.nn.Module) -> bool:
    return callable(getattr(model, "get_base_model", None)) and callable(getattr(model, "disable_adapter", None))


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model under a PEFT wrapper (the model itself otherwise)."""
    return cast(_PeftWrapper, model).get_base_model() if is_lora(model) else model


def checkpoint_decoder_layers(model: torch.nn.Module) -> int:
    """Run every decoder layer's forward under activation checkpointing when grad is enabled.

    The layer's own forward is shadowed by an instance attribute, so module names, state dicts
    and FSDP2 hooks (which wrap ``__call__``) are unchanged. Returns the number of layers."""
    layers = decoder_layers(base_model(model))
    for layer in layers:
        inner = layer.forward

        def forward(*args, _inner=inner, **kwargs):
            if torch.is_grad_enabled():
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
            return _inner(*args, **kwargs)

        layer.forward = forward
    return len(layers)


def prepare_policy(
    model: torch.nn.Module,
    info: DistInfo,
    *,
    lora: LoraSpec | None = None,
    activation_checkpointing: bool = False,
    base_format: str = "",
) -> torch.nn.Module:
    """fp32 on ``info.device``, then LoRA (its frozen base packed in ``base_format``: packed.py), activation
    checkpointing and (world size > 1) FSDP2."""
    model.to(device=info.device, dtype=torch.float32)
    if lora is not None:
        model = apply_lora(model, lora)
        if base_format:
            from asyncrl.learner.packed import pack_lora_base

            pack_lora_base(model, base_format)
    if activation_checkpointing:
        checkpoint_decoder_layers(model)
    if info.world_size > 1:
        model = shard_model(model, info)
    return model


def reference_policy(policy: torch.nn.Module, initial: torch.nn.Module | None, info: DistInfo) -> torch.nn.Module:
    """The frozen KL reference: the policy itself for LoRA (adapters disabled at use), else
    ``initial`` (a copy of the initial weights, taken before ``prepare_policy``) frozen and sharded
    like the policy."""
    if is_lora(policy):
        return policy
    if initial is None:
        raise ValueError("a full fine-tuning KL reference needs a copy of the initial model")
    ref = initial.to(device=info.device, dtype=torch.float32).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return shard_model(ref, info) if info.world_size > 1 else ref


def merge_lora(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W + scaling * (B @ A)``, out of place: the merged weight of a LoRA-adapted linear (what is published,
    exported, and what a rollout-aligned forward quantises; one expression, so the same bits everywhere)."""
    return w + (b.float() @ a.float()).to(w.dtype) * scaling


class MergedLoraState(Mapping[str, torch.Tensor]):
    """A PEFT state dict (``base_model.model.*``, ``*.base_layer.*``, ``*.lora_A/B.default.*``) read in
    the base model's names, each adapted weight being W + scaling * (B @ A), computed when it is read
    (a new tensor each time; the PEFT tensors are never modified). Publication reads and quantizes one
    weight at a time, so no merged copy of every projection exists at once (SmolLM2-135M: 106M
    projection weights, 0.42 GB in fp32);
    ``dict(...)`` of it is the merged state dict."""

    def __init__(self, sd: Mapping[str, torch.Tensor], scaling: float, packed: Mapping[str, Any] | None = None) -> None:
        self._sd, self._scaling, self._packed = sd, float(scaling), dict(packed or {})
        # base name -> (PEFT key of W, of A, of B) for an adapted weight; an unadapted one is a single view,
        # the same at every read, so tied weights stay recognisably tied (publication publishes them once).
        # A packed base (packed.py; ``packed``: module name -> PackedLinear) has no W key: its W is decoded.
        self._adapted: dict[str, tuple[str, str, str]] = {}
        self._plain: dict[str, torch.Tensor] = {}
        self._names: list[str] = []  # the PEFT state dict's order
        for key in sd:
            if ".lora_A." in key or ".lora_B." in key or ".lora_embedding_" in key:
                continue
            name = key[len(_PEFT_PREFIX):] if key.startswith(_PEFT_PREFIX) else key
            module, wrapped, leaf = name.partition(".base_layer.")
            if module in self._packed and leaf != "bias":
                if leaf != "qweight":  # the scales: part of the same weight
                    continue
                key, leaf = "", "weight"
            name = f"{module}.{leaf}" if wrapped else name
            self._names.append(name)
            a_key = f"{_PEFT_PREFIX}{module}.lora_A.default.weight"
            if wrapped and name.endswith(".weight") and a_key in sd:
                self._adapted[name] = (key, a_key, a_key.replace(".lora_A.", ".lora_B."))
            else:
                self._plain[name] = sd[key].detach()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._plain:
            return self._plain[name]
        w_key, a_key, b_key = self._adapted[name]
        a, b = self._sd[a_key].detach(), self._sd[b_key].detach()
        w = self._sd[w_key].detach() if w_key else self._packed[name[: -len(".weight")]].dequantized()
        return merge_lora(w, a, b, self._scaling)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def policy_state_dict(model: torch.nn.Module, lora: LoraSpec | None = None) -> Mapping[str, torch.Tensor]:
    """The policy's full weights in the base model's names, adapters merged (rank 0; other ranks
    get an empty dict at world size > 1). Collective when the model is sharded. A LoRA policy's is a
    ``MergedLoraState`` (merged when read); ``dict(...)`` it where a mutable dict is needed."""
    from torch.distributed.fsdp import FSDPModule

    sd: Mapping[str, torch.Tensor]
    if isinstance(model, FSDPModule):
        sd = full_state_dict(model)
    else:
        sd = {k: v.detach() for k, v in model.state_dict().items()}
    if is_lora(model):
        if lora is None:
            raise ValueError("a LoRA policy's weights need its LoraSpec (the scaling) to be merged")
        packed = {n.removesuffix(".base_layer"): m for n, m in base_model(model).named_modules()
                  if n.endswith(".base_layer") and callable(getattr(m, "dequantized", None))}
        sd = MergedLoraState(sd, lora.scaling, packed) if sd else sd
    return sd


def runtime_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's non-persistent buffers (rotary tables) in the base model's names: what a model built from
    ``policy_state_dict`` lacks (a packed base's codes are persistent: the state dict has them, decoded)."""
    return {f"{mn}.{bn}" if mn else bn: b for mn, m in base_model(model).named_modules()
            for bn, b in m.named_buffers(recurse=False) if bn in m._non_persistent_buffers_set}


def initial_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of the (unprepared) model: the full fine-tuning KL reference's weights."""
    return copy.deepcopy(model)
