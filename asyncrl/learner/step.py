"""One learner training step (ALGORITHMS.md §10, items 3-6 on the learner side).

Owns the order of work inside a step: proximal log-probs with the step-start weights, the
minibatch/micro-batch loop with global denominators, backward, FSDP2-correct gradient clipping,
the optimiser step (or a logged skip), the learning-rate schedule and the version bump.

Never does: advantages, rewards, staleness admission or the objective's math (those belong to the
controller and ``asyncrl.algo``), publication, or I/O. It calls ``loss_fn`` (default
``asyncrl.algo.policy_loss``) with the frozen objective config it is given.

Invariants:
* Every rank holds the whole step batch (see ``fsdp.broadcast_batch``) and derives the same cuts
  from it: minibatch j = ``batch.split(n)[j]``; rank r trains on ``shard(r, W)`` of it, in
  micro-batches of ``micro_batch_size`` sequences. Every rank runs the same number of forward
  and backward passes (short ranks run ``LearnerBatch.filler``), as FSDP2 collectives require.
* ``prox_logp`` is computed once, under no_grad, with the weights at the start of the step, for
  every sequence of the step, before the first optimiser update; it stays fixed for all
  minibatches (§6.2 ``recompute``).
* Denominators are global over the optimiser-step minibatch: ``num_tokens`` / ``num_seqs``
  summed over micro-batches *and* ranks (all_reduce) before the first micro-batch loss, so each
  micro-batch loss is its partial numerator over the global denominator (§5) and the (SUM-reduced)
  gradient is that of the whole minibatch, independent of world size and micro-batch size.
* A minibatch with no loss token, a non-finite loss or a non-finite gradient norm makes no
  optimiser update; the decision is global (all ranks agree), and the skip is counted in metrics.
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
from torch.distributed.tensor import DTensor

from asyncrl.learner.batch import LearnerBatch, micro_batch_count
from asyncrl.learner.fsdp import DistInfo, all_reduce_max, all_reduce_sum
from asyncrl.learner.logprobs import token_logprobs

__all__ = ["StepConfig", "TrainState", "LossFn", "train_step", "compute_prox_logp", "clip_grad_norm"]

log = logging.getLogger(__name__)

LossFn = Callable[..., tuple[torch.Tensor, dict[str, Any]]]
"""``(logp, prox_logp, behav_logp, advantages, mask, cfg, *, num_tokens, num_seqs, versions,
learner_version) -> (loss, metrics)``, the signature of ``asyncrl.algo.policy_loss``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepConfig:
    """How one training step is cut up and clipped.

    n_minibatches: optimiser updates per step (the step batch is split into this many).
    micro_batch_size: sequences per forward/backward on one rank (memory knob only; the result
      does not depend on it beyond float summation order).
    max_grad_norm: clip the global L2 gradient norm to this; <= 0 disables clipping (the norm is
      still measured and logged).
    chunk_tokens: positions per fp32 log-softmax chunk (memory knob, see logprobs.py).
    log_entropy: also compute the token entropy of the current policy (metric ``actor/entropy``).
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


def _default_loss_fn() -> LossFn:
    from asyncrl.algo import policy_loss  # imported late: algo is a sibling leaf package

    return policy_loss


def _plan(batch: LearnerBatch, cfg: StepConfig, info: DistInfo) -> list[list[LearnerBatch]]:
    """Per minibatch, this rank's micro-batches, padded with fillers to the busiest rank's count."""
    plan = []
    for mb in batch.split(cfg.n_minibatches):
        n_micro = micro_batch_count(mb.batch_size, info.world_size, cfg.micro_batch_size)
        micro = mb.shard(info.rank, info.world_size).micro_batches(cfg.micro_batch_size)
        filler = LearnerBatch.filler(temperature=batch.temperature)
        micro += [filler] * (n_micro - len(micro))
        plan.append([m.to(info.device) for m in micro])
    return plan


def compute_prox_logp(
    model: torch.nn.Module, plan: list[list[LearnerBatch]], chunk_tokens: int = 1024
) -> list[list[torch.Tensor]]:
    """prox_logp for every micro-batch of the plan, [b, s] float32 each, no grad, current weights."""
    with torch.no_grad():
        return [
            [token_logprobs(model, micro, chunk_tokens=chunk_tokens)[0] for micro in micros]
            for micros in plan
        ]


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
    if all(sharded) and grads:
        sq = all_reduce_sum(sq.reshape(1), info)[0]
    total = math.sqrt(float(sq))
    if max_norm > 0 and math.isfinite(total):
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            with torch.no_grad():
                for g in grads:
                    (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
    return total


class _MetricSums:
    """Token-weighted sums of per-micro-batch metrics, reduced over ranks at the end.

    Keys ending in ``_max`` / ``_min`` reduce by max / min; every other scalar is treated as a
    mean over the micro-batch's own loss tokens and averaged with the token count as weight.
    """

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.maxes: dict[str, float] = {}

    def add(self, metrics: dict[str, Any], weight: float) -> None:
        if weight <= 0:  # a filler or fully masked micro-batch: its means are undefined
            return
        for key, value in metrics.items():
            v = float(value.detach().float().item() if isinstance(value, torch.Tensor) else value)
            if key.endswith("_max"):
                self.maxes[key] = max(self.maxes.get(key, -math.inf), v)
            elif key.endswith("_min"):
                self.maxes[key] = max(self.maxes.get(key, -math.inf), -v)
            else:
                self.sums[key] = self.sums.get(key, 0.0) + v * weight
                self.weights[key] = self.weights.get(key, 0.0) + weight

    def reduce(self, info: DistInfo, keys: list[str]) -> dict[str, float]:
        """``keys`` must be the same list on every rank (the union is agreed beforehand)."""
        mean_keys = [k for k in keys if not (k.endswith("_max") or k.endswith("_min"))]
        ext_keys = [k for k in keys if k.endswith("_max") or k.endswith("_min")]
        out: dict[str, float] = {}
        if mean_keys:
            vec = torch.tensor(
                [self.sums.get(k, 0.0) for k in mean_keys] + [self.weights.get(k, 0.0) for k in mean_keys],
                dtype=torch.float64,
            )
            vec = all_reduce_sum(vec, info)
            n = len(mean_keys)
            for i, k in enumerate(mean_keys):
                if vec[n + i] > 0:
                    out[k] = float(vec[i] / vec[n + i])
        if ext_keys:
            vec = all_reduce_max(torch.tensor([self.maxes.get(k, -math.inf) for k in ext_keys]), info)
            for k, v in zip(ext_keys, vec.tolist(), strict=True):
                if math.isfinite(v):
                    out[k] = v if k.endswith("_max") else -v
        return out


def _agreed_keys(local: set[str], info: DistInfo) -> list[str]:
    """The sorted union of metric names over ranks (a rank whose micro-batches were all fillers
    may have seen fewer)."""
    if info.world_size == 1:
        return sorted(local)
    import torch.distributed as dist

    gathered: list[Any] = [None] * info.world_size
    dist.all_gather_object(gathered, sorted(local))
    return sorted(set().union(*gathered))


def train_step(
    state: TrainState,
    batch: LearnerBatch,
    objective: Any,
    cfg: StepConfig,
    info: DistInfo,
    *,
    loss_fn: LossFn | None = None,
) -> dict[str, float]:
    """Run one training step on ``batch`` (the whole step batch, identical on every rank).

    ``objective`` is the frozen ``asyncrl.algo.ObjectiveConfig`` handed to ``loss_fn``
    unchanged. Collective: every rank calls it with the same batch and config. Mutates
    ``state`` (weights, optimiser, scheduler) and bumps ``state.version`` by one.
    Returns plain-float metrics, identical on every rank.
    """
    loss_fn = _default_loss_fn() if loss_fn is None else loss_fn
    t0 = time.perf_counter()
    model, k = state.model, state.version
    model.eval()
    lr = float(state.optimizer.param_groups[0]["lr"])
    plan = _plan(batch, cfg, info)

    # (a) proximal log-probs with theta_k, before any update.
    prox = compute_prox_logp(model, plan, cfg.chunk_tokens)
    t_prox = time.perf_counter() - t0

    sums = _MetricSums()
    seen: set[str] = set()
    losses, norms = [], []
    skipped_empty = skipped_nonfinite = 0
    total_tokens = total_seqs = 0.0
    for micros, prox_mb in zip(plan, prox, strict=True):
        # (b) global denominators for this optimiser-step minibatch.
        local = torch.tensor(
            [
                sum(float(m.loss_mask.sum()) for m in micros),
                sum(float(m.loss_mask.any(1).sum()) for m in micros),
            ]
        )
        num_tokens, num_seqs = all_reduce_sum(local, info).tolist()
        total_tokens += num_tokens
        total_seqs += num_seqs
        if num_tokens == 0:
            skipped_empty += 1
            log.warning("learner step %d: minibatch has no loss token; optimiser update skipped", k)
            continue
        state.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for micro, prox_lp in zip(micros, prox_mb, strict=True):
            logp, entropy = token_logprobs(
                model, micro, with_entropy=cfg.log_entropy, chunk_tokens=cfg.chunk_tokens
            )
            loss, metrics = loss_fn(
                logp,
                prox_lp,
                micro.behav_logp,
                micro.advantages,
                micro.loss_mask,
                objective,
                num_tokens=num_tokens,
                num_seqs=num_seqs,
                versions=micro.versions,
                learner_version=k,
            )
            loss.backward()
            loss_sum += loss.detach().double().cpu()
            weight = float(micro.loss_mask.sum())
            if entropy is not None:
                metrics = dict(metrics)
                metrics["actor/entropy"] = (entropy.detach() * micro.loss_mask).sum() / max(weight, 1.0)
            sums.add(metrics, weight)
            seen.update(metrics)
        loss_global = float(all_reduce_sum(loss_sum.reshape(1), info)[0])
        grad_norm = clip_grad_norm(model, cfg.max_grad_norm, info)
        if math.isfinite(loss_global) and math.isfinite(grad_norm):
            state.optimizer.step()
            losses.append(loss_global)
            norms.append(grad_norm)
        else:
            skipped_nonfinite += 1
            log.warning(
                "learner step %d: skipped an optimiser update (loss %r, grad norm %r are not both finite)",
                k,
                loss_global,
                grad_norm,
            )
        state.optimizer.zero_grad(set_to_none=True)

    with warnings.catch_warnings():
        # When every update was skipped torch warns that scheduler.step() ran before optimizer.step();
        # harmless here: the multiplier is a pure function of the step count, nothing is skipped.
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        state.scheduler.step()
    state.version = k + 1
    out = sums.reduce(info, _agreed_keys(seen, info))
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
            "learner/skipped_nonfinite_minibatches": float(skipped_nonfinite),
            "learner/prox_seconds": t_prox,
            "learner/step_seconds": time.perf_counter() - t0,
        }
    )
    return out
