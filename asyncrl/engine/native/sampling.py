"""Token sampling for the native engine: processed log-probs and per-request, counter-based randomness.

Owns: turning a batch of fp32 logits into (sampled token, behaviour log-prob) pairs, and the random number
each request uses for its t-th token.

Must never: hold state between calls, touch a model, or draw from torch's global RNG. Randomness is a pure
function of ``(seed, sample_id, t)``, so a request's stream does not depend on which other requests share the
batch, on restarts, or on the order requests were admitted.

Invariants:
  * every log-prob is computed in fp32 (docs/algorithms.md §2.2) from ``logits.float()``;
  * ``behav_logp[b]`` is the log-prob of ``tokens[b]`` under the distribution it was drawn from:
    ``log_softmax(logits / T)`` (greedy: ``T = 1``, argmax), renormalised over the top-k / top-p set when
    truncation is on (docs/algorithms.md §2.1);
  * a token outside the truncation set is never drawn.

Sampling is inverse-CDF with one uniform per token (``u = uniform(seed, sample_id, t)``): the token is the
first index whose cumulative probability (vocabulary order, float64) exceeds ``u * total``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

_TWO_POW_MINUS_53 = 2.0**-53


def request_uniform(seed: int, sample_id: str, t: int) -> float:
    """Uniform in [0, 1) for token ``t`` of request ``sample_id`` under run seed ``seed``.

    A stable hash (blake2b, not Python's salted ``hash``), so it is the same in every process and run.
    """
    digest = hashlib.blake2b(f"{seed}\x1f{sample_id}\x1f{t}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * _TWO_POW_MINUS_53


def processed_logprobs(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
) -> torch.Tensor:
    """Log-probs of the distribution each row samples from.

    Args:
        logits: ``[B, V]`` any float dtype; converted to fp32.
        temperature: B floats; 0 means greedy (raw ``log_softmax(logits)``, no truncation).
        top_k: B ints; -1 disables.
        top_p: B floats in (0, 1]; 1 disables.
    Returns:
        ``logp: [B, V] float32``; ``-inf`` outside a row's truncation set; each row logsumexps to 0.
    """
    logits = logits.float()
    B, V = logits.shape
    device = logits.device
    temps = torch.tensor([t if t > 0 else 1.0 for t in temperature], dtype=torch.float32, device=device)
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    truncate = [
        t > 0 and (k != -1 and k < V or p < 1.0) for t, k, p in zip(temperature, top_k, top_p, strict=True)
    ]
    if not any(truncate):
        return logp
    rows = torch.tensor([i for i, f in enumerate(truncate) if f], dtype=torch.long, device=device)
    ks = torch.tensor([top_k[i] if top_k[i] != -1 else V for i in rows.tolist()], device=device)
    ps = torch.tensor([top_p[i] for i in rows.tolist()], dtype=torch.float32, device=device)
    sub = logp.index_select(0, rows)
    sorted_lp, order = sub.sort(dim=-1, descending=True)
    ranks = torch.arange(V, device=device)
    keep_sorted = ranks[None, :] < ks[:, None]
    # Top-p is taken on the top-k-renormalised distribution (HF / vLLM order: temperature, top-k, top-p).
    lp_k = torch.log_softmax(sorted_lp.masked_fill(~keep_sorted, float("-inf")), dim=-1)
    p_k = lp_k.exp()
    mass_before = torch.cumsum(p_k, dim=-1) - p_k
    keep_sorted &= (mass_before < ps[:, None]) | (ps[:, None] >= 1.0)
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    truncated = torch.log_softmax(sub.masked_fill(~keep, float("-inf")), dim=-1)
    return logp.index_copy(0, rows, truncated)


def sample_tokens(
    logp: torch.Tensor, uniforms: Sequence[float], greedy: Sequence[bool]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row.

    Args:
        logp: ``[B, V] float32`` from ``processed_logprobs``.
        uniforms: B floats in [0, 1) (``request_uniform``); ignored for greedy rows.
        greedy: B bools; greedy rows take the argmax.
    Returns:
        ``(tokens: [B] int64, behav_logp: [B] float32)``, both on ``logp.device``.
    """
    B, V = logp.shape
    device = logp.device
    tokens = torch.empty(B, dtype=torch.long, device=device)
    g = torch.tensor(list(greedy), dtype=torch.bool, device=device)
    if bool(g.any()):
        tokens[g] = logp[g].argmax(dim=-1)
    s = ~g
    if bool(s.any()):
        lp = logp[s].double()
        cdf = torch.cumsum(lp.exp(), dim=-1)
        u = torch.tensor(
            [u for u, gr in zip(uniforms, greedy, strict=True) if not gr], dtype=torch.float64, device=device
        )
        target = (u * cdf[:, -1]).unsqueeze(-1)
        idx = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=V - 1)
        # Rounding can put the target at (or past) the total mass; fall back to the last token with mass.
        # Rare, so the [B, V] search for that token is made only when a row needs it.
        dead = lp.gather(1, idx[:, None]).squeeze(-1) == float("-inf")
        if bool(dead.any()):
            last_live = torch.where(lp > float("-inf"), torch.arange(V, device=device), -1).amax(dim=-1)
            idx = torch.where(dead, last_live, idx)
        tokens[s] = idx
    behav = logp.gather(1, tokens[:, None]).squeeze(-1)
    return tokens, behav


def truncate_static(logp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, trunc: torch.Tensor) -> torch.Tensor:
    """Branch-free top-k / top-p over the whole batch: ``processed_logprobs``'s truncation, row for row.

    Args:
        logp: ``[B, V] float32``, ``log_softmax(logits / T)``.
        top_k: ``[B] int64`` (``V`` when off); top_p: ``[B] float32`` (1 when off).
        trunc: ``[B] bool``, the rows ``processed_logprobs`` truncates (sampled rows with top-k or top-p on).
    Returns:
        ``[B, V] float32``: truncated and renormalised rows where ``trunc``, ``logp`` itself elsewhere.
    """
    V = logp.shape[1]
    sorted_lp, order = logp.sort(dim=-1, descending=True)
    ranks = torch.arange(V, device=logp.device)
    keep_sorted = ranks[None, :] < top_k[:, None]
    lp_k = torch.log_softmax(sorted_lp.masked_fill(~keep_sorted, float("-inf")), dim=-1)
    p_k = lp_k.exp()
    mass_before = torch.cumsum(p_k, dim=-1) - p_k
    keep_sorted = keep_sorted & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    keep_sorted = keep_sorted | (ranks[None, :] == 0)
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    truncated = torch.log_softmax(logp.masked_fill(~keep, float("-inf")), dim=-1)
    return torch.where(trunc[:, None], truncated, logp)


def sample_static(
    logits: torch.Tensor,
    temp: torch.Tensor,
    greedy: torch.Tensor,
    uniforms: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    trunc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``processed_logprobs`` + ``sample_tokens`` without a branch, a host sync or a data-dependent shape.

    Same rule, bit for bit: fp32 ``log_softmax(logits / T)``, optional truncation (``truncate_static``, on
    when ``top_k`` is given), float64 inverse CDF with the dead-row fallback computed for every row, greedy
    rows the argmax, and the behaviour log-prob gathered from the same fp32 log-probs.

    Args:
        logits: ``[B, V]`` any float dtype; temp: ``[B] float32`` (1 for greedy rows);
        greedy: ``[B] bool``; uniforms: ``[B] float64`` in [0, 1) (``request_uniform``; any value for greedy
        or padding rows); top_k / top_p / trunc: as ``truncate_static``, all or none.
    Returns:
        ``(tokens: [B] int64, behav_logp: [B] float32)``.
    """
    V = logits.shape[1]
    logp = torch.log_softmax(logits.float() / temp[:, None], dim=-1)
    if top_k is not None:
        assert top_p is not None and trunc is not None
        logp = truncate_static(logp, top_k, top_p, trunc)
    lp = logp.double()
    cdf = torch.cumsum(lp.exp(), dim=-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=V - 1)
    dead = logp.gather(1, idx[:, None]).squeeze(-1) == float("-inf")  # fp32 and float64 agree on -inf
    last_live = torch.where(logp > float("-inf"), torch.arange(V, device=logits.device), -1).amax(dim=-1)
    tokens = torch.where(greedy, logp.argmax(dim=-1), torch.where(dead, last_live, idx))
    behav = logp.gather(1, tokens[:, None]).squeeze(-1)
    return tokens, behav
