"""One learner training step (docs/algorithms.md §10, items 3-6 on the learner side).

Owns the order of work inside a step: proximal (and reference) log-probs with the step-start
weights, the minibatch/micro-batch loop with global denominators, backward, FSDP2-correct
gradient clipping, the optimiser step (or a logged skip), the learning-rate schedule, the version
bump, and the reduction of metrics over micro-batches, minibatches and ranks.

Never does: advantages, rewards, staleness admission or the objective's math (those belong to the
controller and ``asyncrl.algo``), publication, or I/O. Which tokens count in the denominators is
``asyncrl.algo.loss_denominators``' decision (non-finite inputs, ``eta_max``), not this module's.

Invariants:
* Every rank holds the whole step batch (see ``fsdp.broadcast_batch``) and derives the same cuts
  from it (``plan.plan_step``): minibatch j = ``batch.split(n)[j]``, less the rows with zero
  advantage when they cost nothing (``skip_zero_advantage``); rank r trains on its shard of it,
  in micro-batches by sequence count and token budget. Every rank runs the same number of
  forward and backward passes (short ranks run ``LearnerBatch.filler``), as FSDP2 requires.
* ``prox_logp`` is the log-prob of the weights at the start of the step, for every sequence of
  the step, fixed for all minibatches (§6.2 ``recompute``): minibatch 0 takes it from its own
  training forward (``reuse_prox``, proven equal: same weights, same function, no update yet),
  the others from a no-grad pass before the first optimiser update.
* Denominators are global over the optimiser-step minibatch: ``loss_denominators`` of every
  micro-batch (and of the rows skipped for zero advantage), summed locally and then over ranks (all_reduce) before the first micro-batch
  loss, so each micro-batch loss is its partial numerator over the global denominator (§5) and
  the SUM-reduced gradient is that of the whole minibatch, at any world size / micro-batch size.
* A minibatch makes no optimiser update when it has no loss token, when the objective flags
  ``actor/skip_step`` (non-finite loss or current log-prob), or when the gradient norm is not
  finite; the decision is global (all ranks agree), logged, and counted in the metrics.
* The version is bumped once per call, also when every minibatch was skipped: the step consumed
  its batch (the controller's staleness accounting counts steps, not updates).
* Dropout is off (``model.eval()``) except, with ``train_dropout``, in the training forward: prox
  and current log-probs must come from the same function.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from asyncrl.algo import MetricDict, ObjectiveConfig, Stat, loss_denominators, merge_metrics, policy_loss
from asyncrl.config.schema import StepConfig
from asyncrl.learner.batch import LearnerBatch
from asyncrl.learner.fsdp import DistInfo, all_reduce_sum
from asyncrl.learner.logprobs import token_logprobs
from asyncrl.learner.options import resolve_autocast
from asyncrl.learner.plan import plan_step

__all__ = ["StepConfig", "TrainState", "LossFn", "train_step", "clip_grad_norm", "reference_context",
           "autocast_context"]

log = logging.getLogger(__name__)

LossFn = Callable[..., tuple[torch.Tensor, MetricDict]]
"""``(logp, prox_logp, behav_logp, advantages, mask, cfg, *, num_tokens, num_seqs, versions,
learner_version, ref_logp, entropy) -> (loss, MetricDict)``: ``asyncrl.algo.policy_loss``."""


@dataclass(slots=True)
class TrainState:
    """What a training step mutates. ``version`` = number of completed training steps; the
    weights in ``model`` are policy version ``version``."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    version: int = 0


class _LossContext(TypedDict):
    """The keyword arguments of one micro-batch shared by ``loss_denominators`` and the loss."""

    versions: torch.Tensor
    learner_version: int
    ref_logp: torch.Tensor | None


def autocast_context(cfg: StepConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """The forwards' autocast for ``cfg.autocast`` on ``device`` (a no-op context for fp32)."""
    if resolve_autocast(cfg.autocast, device.type)[0] == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def reference_context(ref_model: torch.nn.Module, policy: torch.nn.Module) -> contextlib.AbstractContextManager:
    """The reference policy's forward context: for a PEFT policy passed as its own reference, the
    adapters are disabled (the reference is the frozen base, docs/algorithms.md §6.8 with LoRA)."""
    if ref_model is policy:
        disable = getattr(policy, "disable_adapter", None)
        if disable is None:
            raise ValueError("ref_model is the policy itself, which only works for a PEFT (LoRA) policy")
        return disable()
    return contextlib.nullcontext()


def _frozen_logp(
    model: torch.nn.Module | None, micros: list[LearnerBatch], cfg: StepConfig, device: torch.device,
    ctx: contextlib.AbstractContextManager | None = None,
) -> list[torch.Tensor | None]:
    """[b, s] float32 log-probs of ``model`` for every micro-batch, no grad."""
    if model is None:
        return [None] * len(micros)
    with torch.no_grad(), autocast_context(cfg, device), (ctx or contextlib.nullcontext()):
        return [token_logprobs(model, m, chunk_tokens=cfg.chunk_tokens)[0] for m in micros]


def clip_grad_norm(model: torch.nn.Module, max_norm: float, info: DistInfo) -> float:
    """Global L2 norm of all gradients, clipping them to ``max_norm`` when it is > 0.

    Collective. FSDP2 gradients are ``Shard(0)`` DTensors: each rank sums the squares of its
    local shards and the sums are all-reduced, so every element counts once at any world size.
    Squares and sums are in float64 (squares of fp32 values are exact there), which makes the
    norm - and so the clip coefficient - the same at every world size up to ~1e-16 relative,
    instead of differing in the last fp32 bits as ``torch.nn.utils.clip_grad_norm_`` does.
    Returns the norm before clipping (may be inf/nan; then nothing is scaled).
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    sharded = [isinstance(g, DTensor) for g in grads]
    if any(sharded) and not all(sharded):
        raise ValueError(
            "some gradients are DTensors and some are not; shard the whole model with shard_model"
        )
    sq = torch.zeros((), dtype=torch.float64)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        sq += local.detach().double().pow(2).sum().cpu()
    if grads and all(sharded):
        sq = all_reduce_sum(sq.reshape(1), info)[0]
    total = math.sqrt(float(sq))
    if max_norm > 0 and math.isfinite(total):
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            with torch.no_grad():
                for g in grads:
                    (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
    return total


def _stats_of(metrics: Any) -> dict[str, Stat]:
    """The reducible stats behind a loss function's metrics (``MetricDict.stats``)."""
    stats = getattr(metrics, "stats", None)
    if stats is None:
        if metrics:
            raise ValueError(
                "loss_fn returned plain metrics; return an asyncrl.algo.MetricDict (built with "
                "asyncrl.algo.stats.StatsBuilder) so micro-batch and rank metrics merge exactly"
            )
        return {}
    return dict(stats)


def _step_metrics(parts: list[dict[str, Stat]], n_loss_minibatches: int, info: DistInfo) -> dict[str, float]:
    """Merge the objective's stats of every micro-batch of the step, then over ranks.

    Means, fractions, maxima and counts then cover the whole step. Loss terms (``sum`` stats
    named ``*loss``) add up over a minibatch's micro-batches and ranks; over minibatches they
    are averaged instead (the mean minibatch loss over the ``n_loss_minibatches`` minibatches
    that had a loss token, those of only zero-advantage rows included with their exact 0).
    """
    local = merge_metrics(parts).stats
    if info.world_size > 1:
        gathered: list[Any] = [None] * info.world_size
        dist.all_gather_object(gathered, local)
        merged = merge_metrics(gathered).stats
    else:
        merged = local
    out = dict(MetricDict(merged))
    for name, stat in merged.items():
        if stat.op == "sum" and name.endswith("loss") and name in out and n_loss_minibatches > 0:
            out[name] = stat.a / n_loss_minibatches
    return out


def _run_minibatch(
    state: TrainState,
    micros: list[LearnerBatch],
    prox: list[torch.Tensor | None],
    ref: list[torch.Tensor | None],
    skipped: LearnerBatch | None,
    objective: ObjectiveConfig,
    cfg: StepConfig,
    info: DistInfo,
    loss_fn: LossFn,
) -> tuple[float, float, float, float, float, list[dict[str, Stat]]] | None:
    """Forward/backward of one minibatch into ``.grad`` (zeroed first).

    A ``None`` proximal entry is taken from that micro-batch's own forward (``reuse_prox``).
    Returns (global loss, skip votes, non-finite reused prox flag, num_tokens, num_seqs, stats);
    None (nothing run) when the minibatch has no loss token. Collective.
    """
    model, k = state.model, state.version
    want_entropy = cfg.log_entropy or objective.entropy_coef > 0
    common = [_LossContext(versions=m.versions, learner_version=k, ref_logp=r) for m, r in zip(micros, ref, strict=True)]
    # Global denominators of this optimiser-step minibatch: micro-batches, skipped rows, then ranks.
    # A reused prox is not known yet: only its finiteness matters here, and a non-finite one
    # sends the minibatch back to the separate prox pass (the caller), so 0 stands in for it.
    local = torch.zeros(2, dtype=torch.float64)
    for m, p, kw in zip(micros, prox, common, strict=True):
        p_den = torch.zeros_like(m.behav_logp) if p is None else p
        den = loss_denominators(p_den, m.behav_logp, m.advantages, m.loss_mask, objective, **kw)
        local += torch.tensor([den.num_tokens, den.num_seqs], dtype=torch.float64)
    if skipped is not None and skipped.batch_size:
        # Rows with zero advantage: no forward, so their prox is taken as finite (a non-finite
        # log-prob of fp32 weights means NaN weights, which every other row would also show).
        den = loss_denominators(torch.zeros_like(skipped.behav_logp), skipped.behav_logp, skipped.advantages,
                                skipped.loss_mask, objective, versions=skipped.versions, learner_version=k)
        local += torch.tensor([den.num_tokens, den.num_seqs], dtype=torch.float64)
    num_tokens, num_seqs = all_reduce_sum(local, info).tolist()
    if num_tokens == 0:
        return None
    state.optimizer.zero_grad(set_to_none=True)
    acc = torch.zeros(3, dtype=torch.float64)  # [loss sum, skip flag, non-finite reused prox]
    parts: list[dict[str, Stat]] = []
    model.train(cfg.train_dropout)
    for m, p, kw in zip(micros, prox, common, strict=True):
        with autocast_context(cfg, info.device):
            logp, entropy = token_logprobs(model, m, with_entropy=want_entropy, chunk_tokens=cfg.chunk_tokens)
        if p is None:
            p = logp.detach()
            acc[2] = max(float(acc[2]), float((m.loss_mask & ~torch.isfinite(p)).any()))
        loss, metrics = loss_fn(
            logp, p, m.behav_logp, m.advantages, m.loss_mask, objective,
            num_tokens=num_tokens, num_seqs=num_seqs, entropy=entropy, **kw,
        )  # fmt: skip
        loss.backward()
        acc[0] += float(loss.detach())
        acc[1] = max(float(acc[1]), float(metrics.get("actor/skip_step", 0.0)))
        parts.append(_stats_of(metrics))
    model.eval()
    loss_global, skip_votes, bad_prox = all_reduce_sum(acc, info).tolist()
    return loss_global, skip_votes, bad_prox, num_tokens, num_seqs, parts


def train_step(
    state: TrainState,
    batch: LearnerBatch,
    objective: ObjectiveConfig,
    cfg: StepConfig,
    info: DistInfo,
    *,
    ref_model: torch.nn.Module | None = None,
    loss_fn: LossFn = policy_loss,
) -> dict[str, float]:
    """Run one training step on ``batch`` (the whole step batch, identical on every rank).

    ``objective`` is handed unchanged to ``loss_fn`` (default ``asyncrl.algo.policy_loss``) and
    to ``asyncrl.algo.loss_denominators``. ``ref_model`` (frozen, sharded like the policy; or the
    policy itself when it is a PEFT model: the base without adapters) is required when
    ``objective.kl_coef > 0``. Collective: every rank calls it with the same batch and configs.
    Mutates ``state`` (weights, optimiser, scheduler) and bumps ``state.version``.
    Returns plain-float metrics, identical on every rank except the ``*_seconds`` timings.

    Proximal log-probs (§6.2 ``recompute``) are those of the step-start weights. With
    ``cfg.reuse_prox`` the first minibatch takes them from its own training forward, which runs
    before any update on the same weights with the same function (dropout is off); the
    denominators only need their finiteness, and if any reused value at a loss token is not
    finite the minibatch's gradients are dropped and it is redone with a separate prox pass,
    so the result is the same as without reuse. Not used for ``post_mask`` denominators.
    """
    if objective.kl_coef > 0 and ref_model is None:
        raise ValueError(f"objective.kl_coef={objective.kl_coef} needs ref_model (a frozen reference policy)")
    t0 = time.perf_counter()
    model, k = state.model, state.version
    model.eval()
    lr = float(state.optimizer.param_groups[0]["lr"])
    can_skip = cfg.skip_zero_advantage and objective.kl_coef == 0 and objective.entropy_coef == 0
    plan = plan_step(batch, n_minibatches=cfg.n_minibatches, rank=info.rank, world_size=info.world_size,
                     micro_batch_size=cfg.micro_batch_size, max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch,
                     skip_zero_advantage=can_skip, device=info.device)  # fmt: skip

    # Proximal (and reference) log-probs with theta_k, before any update. Coupled PPO (§6.1) has no
    # proximal policy: the sampler's own log-probs are the old policy (verl bypass mode); on stale,
    # quantized rollouts that is the naive baseline QuRL reports collapsing.
    reuse = cfg.reuse_prox and objective.objective != "ppo" and objective.rejection_denominator == "pre_mask"
    prox: list[list[torch.Tensor | None]] = []
    for j, mb in enumerate(plan):
        if objective.objective == "ppo":
            prox.append([m.behav_logp for m in mb.micros])
        elif reuse and j == 0:
            prox.append([None] * len(mb.micros))
        else:
            prox.append(_frozen_logp(model, mb.micros, cfg, info.device))
    ref_on = ref_model if objective.kl_coef > 0 else None
    ref = [
        _frozen_logp(ref_on, mb.micros, cfg, info.device, reference_context(ref_on, model) if ref_on is not None else None)
        for mb in plan
    ]
    t_prox = time.perf_counter() - t0

    parts: list[dict[str, Stat]] = []
    losses, norms = [], []
    skipped_empty = skipped_flagged = skipped_zero = ran = prox_redone = 0
    rows_skipped = 0
    total_tokens = total_seqs = 0.0
    for j, (mb, prox_mb, ref_mb) in enumerate(zip(plan, prox, ref, strict=True)):
        rows_skipped += mb.n_skipped
        res = _run_minibatch(state, mb.micros, prox_mb, ref_mb, mb.skipped, objective, cfg, info, loss_fn)
        if res is not None and res[2] > 0:  # a reused prox was not finite: redo with a separate pass
            prox_redone += 1
            log.warning("learner step %d: non-finite proximal log-prob; minibatch %d redone with a prox pass", k, j)
            state.optimizer.zero_grad(set_to_none=True)
            res = _run_minibatch(state, mb.micros, _frozen_logp(model, mb.micros, cfg, info.device), ref_mb,
                                 mb.skipped, objective, cfg, info, loss_fn)  # fmt: skip
        if res is None:
            skipped_empty += 1
            log.warning("learner step %d: minibatch has no loss token; optimiser update skipped", k)
            continue
        loss_global, skip_votes, _, num_tokens, num_seqs, mb_parts = res
        total_tokens += num_tokens
        total_seqs += num_seqs
        if not mb.micros:  # every row had zero advantage: the gradient is exactly 0
            skipped_zero += 1
            log.info("learner step %d: minibatch %d has only zero-advantage responses; no update", k, j)
            continue
        ran += 1
        parts += mb_parts
        grad_norm = clip_grad_norm(model, cfg.grad_clip, info)
        if skip_votes == 0 and math.isfinite(loss_global) and math.isfinite(grad_norm):
            state.optimizer.step()
            losses.append(loss_global)
            norms.append(grad_norm)
        else:
            skipped_flagged += 1
            log.warning(
                "learner step %d: optimiser update skipped (loss %r, grad norm %r, skip_step votes %d)",
                k, loss_global, grad_norm, int(skip_votes),
            )  # fmt: skip
        state.optimizer.zero_grad(set_to_none=True)

    with warnings.catch_warnings():
        # When every update was skipped torch warns that scheduler.step() ran before optimizer.step();
        # harmless here: the multiplier is a pure function of the step count, nothing is skipped.
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        state.scheduler.step()
    state.version = k + 1
    out = _step_metrics(parts, ran + skipped_zero, info)
    if skipped_zero and not ran:
        # Every response of the step had zero advantage: its loss is exactly 0 (plan.py's
        # invariant), so the loss curve has a point at every step, as without the skip.
        out.update({"actor/loss": 0.0, "actor/pg_loss": 0.0})
    out.update(
        {
            "learner/version": float(state.version),
            "learner/lr": lr,
            "learner/loss": sum(losses) / len(losses) if losses else 0.0,
            "learner/grad_norm": sum(norms) / len(norms) if norms else 0.0,
            "learner/grad_norm_max": max(norms) if norms else 0.0,
            "learner/num_tokens": total_tokens,
            "learner/num_seqs": total_seqs,
            "learner/updates": float(len(losses)),
            "learner/skipped_empty_minibatches": float(skipped_empty),
            "learner/skipped_nonfinite_minibatches": float(skipped_flagged),
            "learner/skipped_zero_adv_minibatches": float(skipped_zero),
            "learner/zero_adv_seqs_no_backward": float(rows_skipped),
            "learner/prox_reused": float(reuse and bool(plan)),
            "learner/prox_redone": float(prox_redone),
            "learner/prox_seconds": t_prox,
            "learner/step_seconds": time.perf_counter() - t0,
        }
    )
    return out
