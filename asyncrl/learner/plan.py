"""How one step batch is cut into the forward/backward passes of each rank.

Owns: minibatches (``LearnerBatch.split``), the rows that need no backward (responses whose
advantage is 0 on every loss token, when the objective has no KL or entropy term), the data-
parallel shard of each rank, and micro-batches by sequence count or by a padded-token budget.

Never does: compute anything with the model, or decide denominators (the step does that, and
keeps the skipped rows in them).

Invariants:
* Every rank derives the same cuts from the same (broadcast) batch, and every rank of a
  minibatch gets the same number of micro-batches (short ranks are padded with
  ``LearnerBatch.filler``), as FSDP2 collectives require.
* A row is skipped only when its token loss and its gradient are exactly zero: policy-gradient
  terms are products with the advantage, and the KL/entropy terms are off (``can_skip``).
* The token budget counts padded positions: a micro-batch of n rows, the longest of length L,
  costs n * L. A row longer than the budget goes alone. Within a rank's shard rows are ordered
  longest first (stable), so rows of similar length share a micro-batch (less padding); the
  minibatch loss is a sum over rows, so the order changes only float summation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.learner.batch import LearnerBatch

__all__ = ["MinibatchPlan", "plan_step", "zero_advantage_rows", "budget_groups"]


@dataclass(frozen=True, slots=True)
class MinibatchPlan:
    """One optimiser-step minibatch as seen by one rank.

    micros: this rank's micro-batches (fillers appended up to the busiest rank's count; empty
      when no rank has a row to train).
    skipped: this rank's shard of the rows that need no backward (they still count in the
      denominators), or None.
    n_skipped: rows skipped in the whole minibatch (all ranks).
    """

    micros: list[LearnerBatch]
    skipped: LearnerBatch | None
    n_skipped: int


def zero_advantage_rows(batch: LearnerBatch) -> torch.Tensor:
    """[B] bool: rows whose advantage is exactly 0 at every loss position (incl. empty rows)."""
    return ~((batch.advantages != 0) & batch.loss_mask).any(dim=1)


def budget_groups(lengths: list[int], max_rows: int, max_tokens: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into micro-batches: longest first, at most ``max_rows`` rows
    and (when ``max_tokens`` > 0) at most ``max_tokens`` padded positions each."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i]) if max_tokens > 0 else list(range(len(lengths)))
    groups: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        longest = max(cur_max, lengths[i])
        fits = len(cur) < max_rows and (max_tokens <= 0 or longest * (len(cur) + 1) <= max_tokens)
        if cur and not fits:
            groups.append(cur)
            cur, longest = [], lengths[i]
        cur.append(i)
        cur_max = longest
    if cur:
        groups.append(cur)
    return groups


def _micro_batches(shard: LearnerBatch, max_rows: int, max_tokens: int) -> list[LearnerBatch]:
    if shard.batch_size == 0:
        return []
    lengths = shard.attention_mask.sum(dim=1).tolist()
    return [shard.select(g).trim() for g in budget_groups(lengths, max_rows, max_tokens)]


def plan_step(
    batch: LearnerBatch,
    *,
    n_minibatches: int,
    rank: int,
    world_size: int,
    micro_batch_size: int,
    max_tokens_per_micro_batch: int = 0,
    skip_zero_advantage: bool = False,
    device: torch.device | str = "cpu",
) -> list[MinibatchPlan]:
    """This rank's plan for every minibatch of ``batch`` (see the module docstring)."""
    filler = LearnerBatch.filler(temperature=batch.temperature)
    plans = []
    for mb in batch.split(n_minibatches):
        skipped = None
        n_skipped = 0
        if skip_zero_advantage:
            zero = zero_advantage_rows(mb)
            n_skipped = int(zero.sum())
            if n_skipped:
                skipped = mb.select(zero.nonzero().squeeze(-1)).shard(rank, world_size)
                mb = mb.select((~zero).nonzero().squeeze(-1))
        per_rank = [
            _micro_batches(mb.shard(r, world_size), micro_batch_size, max_tokens_per_micro_batch)
            for r in range(world_size)
        ]
        n_micro = max(len(m) for m in per_rank)
        micros = per_rank[rank] + [filler] * (n_micro - len(per_rank[rank]))
        plans.append(MinibatchPlan([m.to(device) for m in micros], skipped, n_skipped))
    return plans
