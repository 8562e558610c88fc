"""The behaviour-vs-learner log-prob gap taken apart (``learner.mismatch_every``, docs/algorithms.md §7.1).

Owns ``mismatch_decomposition``: on the first ``rows`` sequences of a step batch, before the step's first
update, with the step-start weights (version k), no gradient, the mean absolute log-prob difference per
response token (nats) between:
    noise    the learner's proximal function (full precision, or through the quantiser when
             ``learner.rollout_aligned``) and the same function again, each sequence alone (another batch
             shape: padding and GEMM blocking change the sums, not the function; roundings inside the
             function can amplify that). The floor a sampler computing the same function would show.
    quant    the learner's forward through the rollout format's quantiser (aligned.py) and the
             full-precision one, same weights. What quantised rollouts add; 0 for an fp32 rollout.
    lag0     behaviour (the sampler's own log-prob) and the learner's proximal function (quantised when
             ``learner.rollout_aligned``, else full precision), over tokens sampled by version k itself.
             Kernel noise + what the learner does not model of the rollout (all of ``quant`` when
             unaligned; only kernel differences when aligned).
    stale    the same gap over tokens sampled by older versions, less the gap those tokens would show at
             lag 0: ``lag0`` when the rows hold lag-0 tokens too, else ``noise`` plus, for an unaligned
             learner, ``quant``. What version lag adds. Per lag over the whole batch:
             ``mismatch/by_staleness/eta=J/kl_k3`` (the objective's diagnostics).
``lag0`` (``stale``) is absent in a step whose rows hold no token sampled by version k (by an older one).

Never: changes weights, gradients or the batch; it is collective like any forward (every rank runs it on
the same rows, so the counts of forwards agree).
"""

from __future__ import annotations

import contextlib

import torch

from asyncrl.learner.aligned import RolloutAlignment
from asyncrl.learner.batch import LearnerBatch
from asyncrl.learner.logprobs import token_logprobs

__all__ = ["mismatch_decomposition"]


def _mean_abs(a: torch.Tensor, b: torch.Tensor, where: torch.Tensor) -> float | None:
    n = int(where.sum())
    return float((a - b).abs()[where].double().sum() / n) if n else None


def mismatch_decomposition(model: torch.nn.Module, batch: LearnerBatch, *, version: int, rows: int,
                           aligned: RolloutAlignment | None, autocast: contextlib.AbstractContextManager,
                           chunk_tokens: int = 256) -> dict[str, float]:
    """``mismatch/{noise,quant,lag0,stale}`` of the module docstring on ``batch``'s first ``rows`` rows."""
    sub = batch.select(slice(0, min(rows, batch.batch_size))).trim()
    if not sub.batch_size:
        return {}
    fp = aligned.full_precision() if aligned is not None else contextlib.nullcontext()
    is_aligned = aligned is not None and aligned.enabled
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast:
            with fp:
                full = token_logprobs(model, sub, chunk_tokens=chunk_tokens)[0].cpu()
            quant = None
            if aligned is not None:
                with aligned.quantized():
                    quant = token_logprobs(model, sub, chunk_tokens=chunk_tokens)[0].cpu()
            # the proximal function (as the learner runs it) once more, each sequence alone
            alone = torch.cat([_alone(model, sub, i, chunk_tokens) for i in range(sub.batch_size)]).cpu()
    finally:
        model.train(was_training)
    behav, mask = sub.behav_logp, sub.loss_mask & torch.isfinite(sub.behav_logp)
    prox = quant if is_aligned and quant is not None else full
    lag = int(version) - sub.versions.to(torch.int64)
    noise = _mean_abs(prox, alone, mask) or 0.0
    q = (_mean_abs(quant, full, mask) or 0.0) if quant is not None else 0.0
    out = {"mismatch/noise": noise, "mismatch/quant": q}
    lag0 = _mean_abs(behav, prox, mask & (lag == 0))
    older = _mean_abs(behav, prox, mask & (lag > 0))
    if lag0 is not None:
        out["mismatch/lag0"] = lag0
    if older is not None:  # less what the same tokens would show at lag 0: measured, else its two parts
        out["mismatch/stale"] = older - (lag0 if lag0 is not None else noise + (0.0 if is_aligned else q))
    return out


def _alone(model: torch.nn.Module, sub: LearnerBatch, i: int, chunk_tokens: int) -> torch.Tensor:
    """Row ``i`` of ``sub`` forwarded alone, padded back to ``sub``'s width: [1, S]."""
    one = sub.select([i]).trim()
    logp = token_logprobs(model, one, chunk_tokens=chunk_tokens)[0]
    return torch.nn.functional.pad(logp, (0, sub.seq_len - one.seq_len))
