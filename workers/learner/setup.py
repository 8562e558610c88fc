"""One learner rank's setup: its place in the process group, its policy and its training state.

Owns: the allocator and kernel-cache bounds set before any tensor exists, the process group
(``init_distributed``), threads and seed (``start_rank``); the policy loaded from the model folder in
fp32, UAQ folded, sharded with FSDP2, with LoRA adapters, the frozen KL reference and the rollout-aligned
forward when asked (``load_policy``); the optimizer, learning-rate schedule and the resumed checkpoint (``training_state``).
Never: opens a socket, talks to the controller or runs a step (``workers/learner/process.py``).

Invariant: every rank builds the same things in the same order (each of these is collective where the
policy is sharded), and a resumed rank starts from the verified checkpoint the controller also chose.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

import torch

from asyncrl.config.schema import TrainConfig
from asyncrl.learner import (
    LRSchedule,
    TrainState,
    build_optimizer,
    build_scheduler,
    init_distributed,
    load_checkpoint,
)
from asyncrl.learner.aligned import RolloutAlignment
from asyncrl.learner.fsdp import DistInfo
from asyncrl.learner.memory import bound_kernel_caches, bound_malloc_retention
from asyncrl.learner.options import resolve_autocast
from asyncrl.learner.policy import (
    LoraSpec,
    default_num_threads,
    initial_copy,
    prepare_policy,
    reference_policy,
)
from asyncrl.machine import describe
from asyncrl.quant.model import DEFAULT_KEEP_FULL_PRECISION

log = logging.getLogger("asyncrl.learner")

COLLECTIVE_TIMEOUT_S = 3600.0
"""torch.distributed timeout: how long ranks wait for rank 0 in a collective (rank 0 may be waiting for a
batch, evaluating, or exporting)."""


class Rank(NamedTuple):
    """This process as one rank of the learner's group, with its thread and allocator settings."""

    info: DistInfo
    threads: int
    malloc_bounded: bool
    kernel_caches: dict[str, str]


class Policy(NamedTuple):
    """The policy as this rank trains it (FSDP2-sharded, LoRA adapters when ``learner.lora``)."""

    model: torch.nn.Module
    ref_model: torch.nn.Module | None
    """The frozen KL reference (``algo.kl_coef > 0``), else None."""
    lora: LoraSpec | None
    pad_id: int
    aligned: RolloutAlignment | None = None
    """The linears routed through the rollout format (``learner.rollout_aligned``), else None."""


def start_rank(cfg: TrainConfig) -> Rank:
    """Allocator and kernel-cache bounds, then the process group, threads and seed of this rank."""
    # Before any tensor exists: freed activations go back to the kernel instead of staying in
    # glibc's heap (asyncrl/learner/memory.py; most of the LoRA learner's peak RSS otherwise).
    bounded = bound_malloc_retention()
    caches = bound_kernel_caches()  # before the first bf16 matmul: one cache entry per batch shape otherwise
    info = init_distributed({"cpu": "gloo", "cuda": "cpu:gloo,cuda:nccl"}.get(cfg.learner.device), timeout_s=COLLECTIVE_TIMEOUT_S)
    L = cfg.learner
    threads = L.num_threads or default_num_threads(cfg.rollout.num_workers, info.world_size)
    torch.set_num_threads(threads)
    torch.manual_seed(L.seed)
    return Rank(info, threads, bounded, caches)


def load_policy(cfg: TrainConfig, model_dir: Path, rank: Rank) -> Policy:
    """The model folder's weights in fp32 (UAQ folded when ``quant.uaq``), sharded over the group with
    LoRA adapters when asked, and the frozen KL reference when ``algo.kl_coef > 0``."""
    from transformers import AutoModelForCausalLM

    from asyncrl.tasks.prompts import load_tokenizer

    L, info = cfg.learner, rank.info
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pad_id = load_tokenizer(model_dir).pad_token_id or 0
    if cfg.quant.uaq:  # §8: fold once on the fp32 master weights, before optimiser states exist
        from asyncrl.quant import fold_uaq

        fold_uaq(model, cfg.quant.uaq_scale, tuple(cfg.quant.uaq_sites))
    lora = lora_spec(L)
    initial = initial_copy(model) if cfg.algo.kl_coef > 0 and lora is None else None
    model = prepare_policy(model, info, lora=lora, activation_checkpointing=L.activation_checkpointing,
                           base_format=L.base_format)
    ref_model = reference_policy(model, initial, info) if cfg.algo.kl_coef > 0 else None
    del initial
    aligned = None
    if L.rollout_aligned:  # (an unaligned run routes its linears only while it measures mismatch/quant)
        aligned = RolloutAlignment(model, cfg.quant.fmt, keep_full_precision=DEFAULT_KEEP_FULL_PRECISION,
                                   head=cfg.quant.lm_head, embedding=cfg.quant.embedding)
        log.info("learner: forwards through the %s quantizer (%d linears%s, straight-through gradients)",
                 cfg.quant.fmt, len(aligned.modules), " and the int8 token embedding" if aligned.embedding else "")
        if ref_model is not None and ref_model is not model:  # a full fine-tuning reference
            RolloutAlignment(ref_model, cfg.quant.fmt, keep_full_precision=DEFAULT_KEEP_FULL_PRECISION,  # computed as
                             head=cfg.quant.lm_head, embedding=cfg.quant.embedding)  # the rollout would (routes hold it)
    autocast, why = resolve_autocast(L.autocast, info.device.type)
    log.info("learner: forwards in %s (learner.autocast=%s: %s) on %s", "bf16 autocast" if autocast else "fp32",
             L.autocast or "''", why, describe() if info.device.type == "cpu" else info.device)
    log.info("learner: %d threads, %s, %s, world size %d%s%s, oneDNN/ideep caches %s", rank.threads,
             f"LoRA r={lora.rank}{f', {L.base_format} base' if L.base_format else ''}" if lora else "full fine-tuning",
             "activation checkpointing" if L.activation_checkpointing else "no activation checkpointing",
             info.world_size, ", KL reference" if ref_model is not None else "",
             "" if rank.malloc_bounded else ", malloc retention unbounded (not glibc)",
             "/".join(rank.kernel_caches.values()))
    return Policy(model, ref_model, lora, pad_id, aligned)


def training_state(cfg: TrainConfig, policy: Policy, info: DistInfo, ckpt_root: Path, *, replay: bool) -> TrainState:
    """Optimizer and learning-rate schedule around the policy, at version 0 or at the run's resume point."""
    L = cfg.learner
    opt = build_optimizer(policy.model, lr=L.lr, weight_decay=L.weight_decay)
    sched = build_scheduler(opt, LRSchedule(kind=L.lr_schedule, warmup_steps=L.warmup_steps,
                                            total_steps=max(L.total_steps, L.warmup_steps + 1),
                                            min_lr_ratio=L.min_lr_ratio))
    state = TrainState(policy.model, opt, sched, version=0)
    if policy.aligned is not None:  # the cached low-bit weights live until the weights change
        policy.aligned.watch(opt)
    # The same verified checkpoint the controller chose on resume (damaged ones are skipped, said why); also
    # without resume=: a learner started again under a running controller goes on from the run's newest one.
    if cfg.resume or not replay:
        from asyncrl.rundir.checkpoints import choose_resume_point

        point = choose_resume_point(ckpt_root)
        for note in point.notes if cfg.resume or point.learner_dir is not None else ():
            log.warning("resume: %s", note)
        if point.learner_dir is not None:
            load_checkpoint(point.learner_dir, state, info)
            log.info("resumed learner at version %d", state.version)
    return state


def lora_spec(L) -> LoraSpec | None:
    """``learner.lora`` as a ``LoraSpec`` (None for full fine-tuning)."""
    if L.lora.rank <= 0:
        return None
    return LoraSpec(rank=L.lora.rank, alpha=L.lora.alpha, target_modules=tuple(L.lora.target_modules),
                    dropout=L.lora.dropout)
