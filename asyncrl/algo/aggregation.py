"""Loss aggregation over the optimiser-step minibatch (docs/algorithms.md §5).

Owns the three modes (``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum``) and the
rule that denominators are *global*: a micro-batch adds its partial numerator divided by the
denominator of the whole minibatch (all micro-batches, all ranks), so splitting a batch changes
nothing but float summation order. Never: decides which tokens count (``inputs.py`` does) or
talks to torch.distributed (the learner sums ``Denominators`` itself).

Invariants: ``token_values`` is already zero wherever a token does not contribute (where-masked
upstream); a response is never split across micro-batches, so per-response quantities
(L_i = tokens of response i in ``den_mask``) are always local.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from asyncrl.algo.numerics import seq_any
from asyncrl.config.algo import AGGREGATIONS, require_choice

__all__ = ["Denominators", "count_denominators", "aggregate", "resolve_denominators"]


class Denominators(NamedTuple):
    """Global denominators of §5. Sum them over micro-batches and ranks (plain addition)."""

    num_tokens: float
    """sum_{i,t} m~_{i,t}: tokens that count in ``token-mean``."""
    num_seqs: float
    """N_seq: responses with at least one such token (``seq-mean-*``)."""

    def __add__(self, other: object) -> Denominators:
        if not isinstance(other, Denominators):
            return NotImplemented
        return Denominators(self.num_tokens + other.num_tokens, self.num_seqs + other.num_seqs)


def count_denominators(den_mask: torch.Tensor) -> Denominators:
    """Local counts of a [B, T] bool denominator mask."""
    return Denominators(float(den_mask.sum()), float(seq_any(den_mask).sum()))


def resolve_denominators(
    den_mask: torch.Tensor, num_tokens: float | torch.Tensor | None, num_seqs: float | torch.Tensor | None
) -> Denominators:
    """The denominators to divide by: the global ones when given (validated), else local counts.

    A global count smaller than this call's own count means the caller summed the wrong thing
    (e.g. the raw mask of one micro-batch); that would silently inflate the loss, so it raises.
    """
    local = count_denominators(den_mask)
    tokens = local.num_tokens if num_tokens is None else float(num_tokens)
    seqs = local.num_seqs if num_seqs is None else float(num_seqs)
    if tokens + 0.5 < local.num_tokens or seqs + 0.5 < local.num_seqs:
        raise ValueError(
            f"global denominators (num_tokens={tokens}, num_seqs={seqs}) are smaller than this call's own "
            f"counts ({local.num_tokens}, {local.num_seqs}); compute them with asyncrl.algo.loss_denominators "
            "over every micro-batch and rank of the optimiser step and sum them"
        )
    return Denominators(tokens, seqs)


def aggregate(
    token_values: torch.Tensor,
    den_mask: torch.Tensor,
    agg: str,
    *,
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Aggregate per-token values into the (partial) loss of §5.

    token_values: [B, T], zero where a token does not contribute; den_mask: [B, T] bool, the
    tokens that count in denominators (m~, §5). Denominators default to this call's own counts.
    token-mean: sum / num_tokens; seq-mean-token-mean: sum_i (sum_t / max(1, L_i)) / num_seqs;
    seq-mean-token-sum: sum / num_seqs. A zero denominator gives 0 (there is nothing to average).
    """
    require_choice("agg", agg, AGGREGATIONS)
    den = resolve_denominators(den_mask.bool(), num_tokens, num_seqs)
    if agg == "token-mean":
        return token_values.sum() / max(den.num_tokens, 1.0)
    if agg == "seq-mean-token-sum":
        return token_values.sum() / max(den.num_seqs, 1.0)
    lengths = den_mask.bool().sum(-1).clamp(min=1).to(token_values.dtype)
    return (token_values.sum(-1) / lengths).sum() / max(den.num_seqs, 1.0)
