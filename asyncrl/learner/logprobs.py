"""Per-token log-probabilities (and entropies) of a causal LM, in fp32, at a temperature.

Owns the learner side of the log-prob contract of docs/algorithms.md §2.1-2.2:
``logp[b, t] = log_softmax(logits[b, t-1].float() / temperature)[input_ids[b, t]]`` - the
log-prob of token t given the tokens before it, stored at position t so it lines up with
``LearnerBatch.behav_logp``.

Two paths compute it:
* ``token_logprobs`` (the learner's): only the selected positions go through the LM head. For
  the duration of the forward the model's output-embedding module (``lm_head``) is given a
  forward that takes the final hidden states [B, S, H], picks the rows that predict a selected
  token, and projects them in chunks of ``chunk_tokens`` rows; each chunk's [n, V] logits live
  only inside the chunk (recomputed in backward under activation checkpointing), so no
  [B, S, V] tensor ever exists. The head runs inside the root ``forward``, so FSDP2's root
  all-gather (embeddings, final norm, tied or untied head) has happened and autograd reaches
  the head's weight exactly as in the full-logits path.
* ``logprobs_from_logits``: the same values from a precomputed [B, S, V] logits tensor (the
  reference the chunked path is tested against, to 1e-6 in fp32).

Never does: sampling, masking for the loss, any torch.distributed call.

Invariants:
* The output is exactly 0 at every position not in ``positions`` (default: the batch's
  ``loss_mask``), in particular at position 0 and on padding.
* With grad enabled the output is always connected to the head and the hidden states (by a
  zero-valued term), even when no position is selected: every rank's backward must reach every
  FSDP2 module so the gradient reduce-scatters match across ranks.
* The LM head's own forward is restored when the call returns (also on error).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from asyncrl.learner.batch import LearnerBatch

HEAD_TRANSFORM = "asyncrl_head_transform"
"""Attribute a rollout-aligned output head carries (aligned.py): ``weight -> (weight, linear)``, the weight the
head computes with and the ``(rows, weight, bias) -> logits`` with the actor's roundings."""

__all__ = ["token_logprobs", "logprobs_from_logits", "output_head"]


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


def _select(positions: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(flat positions [N], their targets [N], the flat row t-1 that predicts each)."""
    if bool(positions[:, 0].any()):
        raise ValueError("positions selects position 0, which no logits predict; start at position 1")
    flat_pos = positions.reshape(-1).nonzero().squeeze(-1)
    return flat_pos, input_ids.reshape(-1)[flat_pos], flat_pos - 1


def _scatter(parts: list[torch.Tensor], flat_pos: torch.Tensor, shape: tuple[int, int], link: torch.Tensor | None):
    out = torch.zeros(shape[0] * shape[1], dtype=torch.float32, device=flat_pos.device)
    if parts:
        out = out.index_put((flat_pos,), torch.cat(parts))
    if link is not None:
        out = out + link  # zero-valued: the graph reaches every module even if nothing is selected
    return out.view(shape)


def logprobs_from_logits(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    temperature: float,
    *,
    with_entropy: bool = False,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token log-probs from precomputed logits (the full-logits reference path).

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
    flat_pos, targets, src_rows = _select(positions, input_ids)
    logits2d = logits.reshape(B * S, V)
    use_ckpt = torch.is_grad_enabled() and logits.requires_grad
    logp_parts, ent_parts = [], []
    for start in range(0, flat_pos.numel(), chunk_tokens):
        rows, tgt = src_rows[start : start + chunk_tokens], targets[start : start + chunk_tokens]

        def fn(l2d: torch.Tensor, r: torch.Tensor = rows, t: torch.Tensor = tgt) -> tuple[torch.Tensor, torch.Tensor]:
            return _chunk_stats(l2d.index_select(0, r), t, temperature, with_entropy)

        lp, ent = checkpoint(fn, logits2d, use_reentrant=False) if use_ckpt else fn(logits2d)
        logp_parts.append(lp)
        ent_parts.append(ent)
    link = 0.0 * logits[:1, :1, :1].float().sum() if use_ckpt else None
    logp = _scatter(logp_parts, flat_pos, (B, S), link)
    entropy = _scatter(ent_parts, flat_pos, (B, S), link) if with_entropy else None
    return logp, entropy


def _head_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    chunk_tokens: int,
    transform: Callable[[torch.Tensor], tuple[torch.Tensor, Callable]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S, H] final hidden states -> (logp [B, S], entropy [B, S]) through the head in chunks.
    ``transform``: weight -> (the weight used, the ``(rows, weight, bias) -> logits`` that replaces F.linear)."""
    B, S, H = hidden.shape
    flat_pos, targets, src_rows = _select(positions, input_ids)
    h2d = hidden.reshape(B * S, H)
    use_ckpt = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    linear: Callable[..., torch.Tensor] = F.linear
    if transform is not None:  # a rollout-aligned head (aligned.py): the actor's weight and roundings
        weight, linear = transform(weight)
    logp_parts, ent_parts = [], []
    for start in range(0, flat_pos.numel(), chunk_tokens):
        rows, tgt = src_rows[start : start + chunk_tokens], targets[start : start + chunk_tokens]

        def fn(
            h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, r: torch.Tensor = rows, t: torch.Tensor = tgt
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return _chunk_stats(linear(h.index_select(0, r), w, b), t, temperature, with_entropy)

        lp, ent = checkpoint(fn, h2d, weight, bias, use_reentrant=False) if use_ckpt else fn(h2d, weight, bias)
        logp_parts.append(lp)
        ent_parts.append(ent)
    link = 0.0 * F.linear(h2d[:1], weight[:1]).float().sum() if use_ckpt else None
    logp = _scatter(logp_parts, flat_pos, (B, S), link)
    entropy = _scatter(ent_parts, flat_pos, (B, S), link)
    return logp, entropy


def output_head(model: torch.nn.Module) -> torch.nn.Linear:
    """The LM head (``get_output_embeddings()``) of a Hugging Face causal LM, plain, FSDP2 or PEFT."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(
            f"{type(model).__name__} has no nn.Linear output embedding (lm_head); the learner supports "
            "Hugging Face causal LMs laid out like LlamaForCausalLM / Qwen2ForCausalLM (and PEFT "
            "adapters that leave lm_head out of target_modules)"
        )
    return head


@contextlib.contextmanager
def _response_head(head: torch.nn.Linear, **kw) -> Iterator[None]:
    """Give ``head`` a forward that returns [B, S, 2] = (logp, entropy) instead of logits."""

    transform = getattr(head, HEAD_TRANSFORM, None)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        logp, ent = _head_stats(hidden, head.weight, head.bias, transform=transform, **kw)
        return torch.stack([logp, ent], dim=-1)

    # An instance attribute (what `head.forward = forward` stores, said without assigning to a method):
    # it shadows the class forward and leaves FSDP's hooks untouched.
    vars(head)["forward"] = forward
    try:
        yield
    finally:
        del vars(head)["forward"]


def token_logprobs(
    model: torch.nn.Module,
    batch: LearnerBatch,
    temperature: float | None = None,
    *,
    positions: torch.Tensor | None = None,
    with_entropy: bool = False,
    chunk_tokens: int = 256,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward ``model`` (a Hugging Face causal LM: plain, FSDP2 or PEFT) on ``batch``.

    Returns (logp [B, S] float32, entropy [B, S] float32 or None): log_softmax(logits.float() /
    temperature) gathered at the next token and stored at that token's position (aligned with
    ``batch.behav_logp``); entropy of the same tempered distribution. Computed at ``positions``
    ([B, S] bool, default ``batch.loss_mask``), 0 elsewhere, projecting only those positions
    through the LM head (see the module docstring). ``temperature`` defaults to
    ``batch.temperature``. Gradients flow iff grad mode is on.
    """
    tau = batch.temperature if temperature is None else float(temperature)
    if tau <= 0:
        raise ValueError(f"temperature must be > 0, got {tau}")
    pos = batch.loss_mask if positions is None else positions.to(torch.bool)
    device = next(model.parameters()).device
    input_ids = batch.input_ids.to(device)
    head = output_head(model)
    with _response_head(head, input_ids=input_ids, positions=pos.to(device), temperature=tau,
                        with_entropy=with_entropy, chunk_tokens=chunk_tokens):  # fmt: skip
        out = model(input_ids=input_ids, attention_mask=batch.attention_mask.to(device), use_cache=False)
    stats = out.logits
    logp = stats[..., 0].float()
    return logp, (stats[..., 1].float() if with_entropy else None)
