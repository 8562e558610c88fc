"""One learner training step (ALGORITHMS.md §10, items 3-6 on the learner side).

Owns the order of work inside a step: proximal (and reference) log-probs with the step-start
weights, the minibatch/micro-batch loop with global denominators, backward, FSDP2-correct
gradient clipping, the optimiser step (or a logged skip), the learning-rate schedule, the version
bump, and the reduction of metrics over micro-batches, minibatches and ranks.

Never does: advantages, rewards, staleness admission or the objective's math (those belong to the
controller and ``asyncrl.algo``), publication, or I/O. Which tokens count in the denominators is
``asyncrl.algo.loss_denominators``' decision (non-finite inputs, ``eta_max``), not this module's.

Invariants:
* Every rank holds the whole step batch (see ``fsdp.broadcast_batch``) and derives the same cuts
  from it: minibatch j = ``batch.split(n)[j]``; rank r trains on ``shard(r, W)`` of it, in
  micro-batches of ``micro_batch_size`` sequences. Every rank runs the same number of forward
  and backward passes (short ranks run ``LearnerBatch.filler``), as FSDP2 collectives require.
* ``prox_logp`` is computed once, under no_grad, with the weights at the start of the step, for
  every sequence of the step, before the first optimiser update; it stays fixed for all
  minibatches (§6.2 ``recompute``).
* Denominators are global over the optimiser-step minibatch: ``loss_denominators`` of every
  micro-batch, summed locally and then over ranks (all_reduce) before the first micro-batch
  loss, so each micro-batch loss is its partial numerator over the global denominator (§5) and
  the SUM-reduced gradient is that of the whole minibatch, at any world size / micro-batch size.
* A minibatch makes no optimiser update when it has no loss token, when the objective flags
  ``actor/skip_step`` (non-finite loss or current log-prob), or when the gradient norm is not
  finite; the decision is global (all ranks agree), logged, and counted in the metrics.
* The version is bumped once per call, also when every minibatch was skipped: the step consumed
  its batch (the controller's staleness accounting counts steps, not updates).
* Dropout is off (``model.eval()``): prox and current log-probs must come from the same function.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from asyncrl.algo import MetricDict, ObjectiveConfig, Stat, loss_denominators, merge_metrics, policy_loss
from asyncrl.learner.batch import LearnerBatch, micro_batch_count
from asyncrl.learner.fsdp import DistInfo, all_reduce_sum
from asyncrl.learner.logprobs import token_logprobs

__all__ = ["StepConfig", "TrainState", "LossFn", "train_step", "clip_grad_norm"]

log = logging.getLogger(__name__)

LossFn = Callable[..., tuple[torch.Tensor, MetricDict]]
"""``(logp, prox_logp, behav_logp, advantages, mask, cfg, *, num_tokens, num_seqs, versions,
learner_version, ref_logp, entropy) -> (loss, MetricDict)``: ``asyncrl.algo.policy_loss``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepConfig:
    """How one training step is cut up and clipped.

    n_minibatches: optimiser updates per step (the step batch is split into this many).
    micro_batch_size: sequences per forward/backward on one rank (memory knob only; the result
      does not depend on it beyond float summation order).
    max_grad_norm: clip the global L2 gradient norm to this; <= 0 disables clipping (the norm is
      still measured and logged).
    chunk_tokens: positions per fp32 log-softmax chunk (memory knob, see logprobs.py).
    log_entropy: compute the current policy's token entropy even when the objective has no
      entropy bonus (metric ``actor/entropy``; costs a full-vocabulary pass per chunk).
    """

    n_minibatches: int = 1
    micro_batch_size: int = 8
    max_grad_norm: float = 1.0
    chunk_tokens: int = 1024
    log_entropy: bool = False

    def __post_init__(self) -> None:
        if self.n_minibatches < 1:
            raise ValueError(f"n_minibatches must be >= 1, got {self.n_minibatches}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")


@dataclass(slots=True)
class TrainState:
    """What a training step mutates. ``version`` = number of completed training steps; the
    weights in ``model`` are policy version ``version``."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    version: int = 0


def _plan(batch: LearnerBatch, cfg: StepConfig, info: DistInfo) -> list[list[LearnerBatch]]:
    """Per minibatch, this rank's micro-batches, padded with fillers to the busiest rank's count."""
    plan = []
    filler = LearnerBatch.filler(temperature=batch.temperature)
    for mb in batch.split(cfg.n_minibatches):
        n_micro = micro_batch_count(mb.batch_size, info.world_size, cfg.micro_batch_size)
        micro = mb.shard(info.rank, info.world_size).micro_batches(cfg.micro_batch_size)
        micro += [filler] * (n_micro - len(micro))
        plan.append([m.to(info.device) for m in micro])
    return plan


def _frozen_logp(
    model: torch.nn.Module | None, plan: list[list[LearnerBatch]], chunk_tokens: int
) -> list[list[torch.Tensor | None]]:
    """[b, s] float32 log-probs of ``model`` for every micro-batch of the plan, no grad."""
    if model is None:
        return [[None] * len(micros) for micros in plan]
    with torch.no_grad():
        return [[token_logprobs(model, m, chunk_tokens=chunk_tokens)[0] for m in micros] for micros in plan]


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


def _step_metrics(parts: list[dict[str, Stat]], n_minibatches_run: int, info: DistInfo) -> dict[str, float]:
    """Merge the objective's stats of every micro-batch of the step, then over ranks.

    Means, fractions, maxima and counts then cover the whole step. Loss terms (``sum`` stats
    named ``*loss``) add up over a minibatch's micro-batches and ranks; over minibatches they
    are averaged instead (the mean minibatch loss).
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
        if stat.op == "sum" and name.endswith("loss") and name in out and n_minibatches_run > 0:
            out[name] = stat.a / n_minibatches_run
    return out


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
    to ``asyncrl.algo.loss_denominators``. ``ref_model`` (sharded like the policy, frozen) is
    required when ``objective.kl_coef > 0``. Collective: every rank calls it with the same batch
    and configs. Mutates ``state`` (weights, optimiser, scheduler) and bumps ``state.version``.
    Returns plain-float metrics, identical on every rank except the ``*_seconds`` timings.
    """
    if objective.kl_coef > 0 and ref_model is None:
        raise ValueError(f"objective.kl_coef={objective.kl_coef} needs ref_model (a frozen reference policy)")
    t0 = time.perf_counter()
    model, k = state.model, state.version
    model.eval()
    lr = float(state.optimizer.param_groups[0]["lr"])
    plan = _plan(batch, cfg, info)
    want_entropy = cfg.log_entropy or objective.entropy_coef > 0

    # Proximal (and reference) log-probs with theta_k, before any update. Coupled PPO (§6.1) has no
    # proximal policy: the sampler's own log-probs are the old policy (verl bypass mode); on stale,
    # quantized rollouts that is the naive baseline QuRL reports collapsing.
    if objective.kind == "ppo":
        prox = [[m.behav_logp for m in micros] for micros in plan]
    else:
        prox = _frozen_logp(model, plan, cfg.chunk_tokens)
    ref = _frozen_logp(ref_model if objective.kl_coef > 0 else None, plan, cfg.chunk_tokens)
    t_prox = time.perf_counter() - t0

    parts: list[dict[str, Stat]] = []
    losses, norms = [], []
    skipped_empty = skipped_flagged = ran = 0
    total_tokens = total_seqs = 0.0
    for micros, prox_mb, ref_mb in zip(plan, prox, ref, strict=True):
        common = [
            dict(versions=m.versions, learner_version=k, ref_logp=r)
            for m, r in zip(micros, ref_mb, strict=True)
        ]
        # Global denominators of this optimiser-step minibatch: micro-batches, then ranks.
        local = torch.zeros(2, dtype=torch.float64)
        for m, p, kw in zip(micros, prox_mb, common, strict=True):
            den = loss_denominators(p, m.behav_logp, m.advantages, m.loss_mask, objective, **kw)
            local += torch.tensor([den.num_tokens, den.num_seqs], dtype=torch.float64)
        num_tokens, num_seqs = all_reduce_sum(local, info).tolist()
        total_tokens += num_tokens
        total_seqs += num_seqs
        if num_tokens == 0:
            skipped_empty += 1
            log.warning("learner step %d: minibatch has no loss token; optimiser update skipped", k)
            continue
        ran += 1
        state.optimizer.zero_grad(set_to_none=True)
        acc = torch.zeros(2, dtype=torch.float64)  # [loss sum, skip flag]
        for m, p, kw in zip(micros, prox_mb, common, strict=True):
            logp, entropy = token_logprobs(model, m, with_entropy=want_entropy, chunk_tokens=cfg.chunk_tokens)
            loss, metrics = loss_fn(
                logp, p, m.behav_logp, m.advantages, m.loss_mask, objective,
                num_tokens=num_tokens, num_seqs=num_seqs, entropy=entropy, **kw,
            )  # fmt: skip
            loss.backward()
            acc[0] += float(loss.detach())
            acc[1] = max(float(acc[1]), float(metrics.get("actor/skip_step", 0.0)))
            parts.append(_stats_of(metrics))
        loss_global, skip_votes = all_reduce_sum(acc, info).tolist()
        grad_norm = clip_grad_norm(model, cfg.max_grad_norm, info)
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
    out = _step_metrics(parts, ran, info)
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
            "learner/prox_seconds": t_prox,
            "learner/step_seconds": time.perf_counter() - t0,
        }
    )
    return out
