"""Per-token log-probabilities (and entropies) of a causal LM, in fp32, at a temperature.

Owns the learner side of the log-prob contract of ALGORITHMS.md §2.1-2.2:
``logp[b, t] = log_softmax(logits[b, t-1].float() / temperature)[input_ids[b, t]]`` - the
log-prob of token t given the tokens before it, stored at position t so it lines up with
``LearnerBatch.behav_logp``.

Never does: sampling, masking for the loss, any torch.distributed call (the model may be
FSDP2-sharded; it is only ever called through its root ``forward`` so FSDP's hooks run).

Invariants:
* The output is exactly 0 at every position not in ``positions`` (default: the batch's
  ``loss_mask``), in particular at position 0 and on padding.
* Memory: the full-vocabulary fp32 tensors exist one chunk of ``chunk_tokens`` positions at a
  time; with grad enabled each chunk is recomputed in backward (activation checkpointing), so
  only the model's own logits and the gathered [N] values are kept for backward.
* With grad enabled the output is always connected to the model's logits (by a zero-valued term),
  even when no position is selected: every rank's backward must reach every FSDP2 module so the
  gradient reduce-scatters match across ranks.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from asyncrl.learner.batch import LearnerBatch

__all__ = ["token_logprobs", "logprobs_from_logits"]


def _chunk_stats(
    logits_rows: torch.Tensor, targets: torch.Tensor, temperature: float, want_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits_rows: [N, V] (any float dtype); targets: [N] int64 -> (logp [N] f32, entropy [N] f32)."""
    scaled = logits_rows.float() / temperature
    logz = torch.logsumexp(scaled, dim=-1)
    logp = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz
    if want_entropy:
        log_probs = scaled - logz.unsqueeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    else:
        entropy = torch.zeros_like(logp)
    return logp, entropy


def logprobs_from_logits(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    temperature: float,
    *,
    with_entropy: bool = False,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token log-probs from precomputed logits.

    logits: [B, S, V] (logits[b, t] predicts token t+1); input_ids: [B, S] int64;
    positions: [B, S] bool, the positions t >= 1 whose log-prob is wanted.
    Returns (logp [B, S] float32, entropy [B, S] float32 or None), 0 outside ``positions``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    B, S, V = logits.shape
    if input_ids.shape != (B, S) or positions.shape != (B, S):
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must be [B, S] = {(B, S)}"
        )
    if bool(positions[:, 0].any()):
        raise ValueError("positions selects position 0, which no logits predict; start at position 1")
    flat_pos = positions.reshape(-1).nonzero().squeeze(-1)  # [N] indices into B*S
    targets = input_ids.reshape(-1)[flat_pos]  # [N]
    src_rows = flat_pos - 1  # logits row that predicts each target (same sequence, t-1)
    logits2d = logits.reshape(B * S, V)

    use_ckpt = torch.is_grad_enabled() and logits.requires_grad
    logp_parts, ent_parts = [], []
    for start in range(0, flat_pos.numel(), chunk_tokens):
        rows = src_rows[start : start + chunk_tokens]
        tgt = targets[start : start + chunk_tokens]

        def fn(
            l2d: torch.Tensor, r: torch.Tensor = rows, t: torch.Tensor = tgt
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return _chunk_stats(l2d.index_select(0, r), t, temperature, with_entropy)

        if use_ckpt:
            lp, ent = checkpoint(fn, logits2d, use_reentrant=False)
        else:
            lp, ent = fn(logits2d)
        logp_parts.append(lp)
        ent_parts.append(ent)

    def scatter(parts: list[torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(B * S, dtype=torch.float32, device=logits.device)
        if parts:
            out = out.index_put((flat_pos,), torch.cat(parts))
        if use_ckpt:
            # Zero-valued link to the logits: the graph reaches every module even if nothing is selected.
            out = out + 0.0 * logits[:1, :1, :1].float().sum()
        return out.view(B, S)

    logp = scatter(logp_parts)
    entropy = scatter(ent_parts) if with_entropy else None
    return logp, entropy


def token_logprobs(
    model: torch.nn.Module,
    batch: LearnerBatch,
    temperature: float | None = None,
    *,
    positions: torch.Tensor | None = None,
    with_entropy: bool = False,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward ``model`` (a Hugging Face causal LM, plain or FSDP2) on ``batch``.

    Returns (logp [B, S] float32, entropy [B, S] float32 or None): log_softmax(logits.float() /
    temperature) gathered at the next token and stored at that token's position (aligned with
    ``batch.behav_logp``); entropy of the same tempered distribution. Computed at ``positions``
    ([B, S] bool, default ``batch.loss_mask``), 0 elsewhere. ``temperature`` defaults to
    ``batch.temperature``. Gradients flow iff grad mode is on.
    """
    tau = batch.temperature if temperature is None else float(temperature)
    pos = batch.loss_mask if positions is None else positions.to(torch.bool)
    device = next(model.parameters()).device
    out = model(
        input_ids=batch.input_ids.to(device),
        attention_mask=batch.attention_mask.to(device),
        use_cache=False,
    )
    return logprobs_from_logits(
        out.logits,
        batch.input_ids.to(device),
        pos.to(device),
        tau,
        with_entropy=with_entropy,
        chunk_tokens=chunk_tokens,
    )
