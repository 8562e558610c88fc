"""The learner's batch: right-padded token tensors for one training step.

Owns the tensor layout every learner function agrees on, the constructor that builds it from
per-sample lists (what the controller sends), and the deterministic ways of cutting it up:
minibatches (one optimiser update each), rank shards (data parallel), and the row selection and
padding trim ``plan.py`` builds micro-batches (one forward/backward each) from.

Never does: any model call, any torch.distributed call, any randomness. Cutting a batch is a pure
function of its shape, so every rank computes the same cuts from the same batch.

Layout invariants (B sequences, S positions, prompt then response, right-padded):

* ``input_ids[b, t]`` is token t of sequence b; ``attention_mask[b, t] = 1`` on the prompt and
  response tokens and 0 on padding, which only ever sits at the right.
* All per-token training tensors are aligned to the *token*, not to the logits that predict it:
  ``behav_logp[b, t]`` is log pi_behav(input_ids[b, t] | input_ids[b, <t]). Position 0 never
  carries a log-prob (nothing predicts the first token), so ``loss_mask[b, 0] = 0`` always.
* Where ``loss_mask`` is 0: ``behav_logp = 0``, ``advantages = 0``, ``versions = -1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

__all__ = ["LearnerBatch"]

_TENSOR_FIELDS = ("input_ids", "attention_mask", "loss_mask", "behav_logp", "advantages", "versions")


@dataclass(frozen=True, slots=True)
class LearnerBatch:
    """Tensors for one training step (or one slice of it).

    Shapes and dtypes (B sequences, S positions):
      input_ids:      [B, S] int64  prompt + response, right-padded with ``pad_id``
      attention_mask: [B, S] int64  1 on real tokens, 0 on padding
      loss_mask:      [B, S] bool   1 on response tokens that take part in the loss
      behav_logp:     [B, S] float32 behaviour log-prob of token t at position t; 0 where masked
      advantages:     [B, S] float32 per-token advantage; 0 where masked
      versions:       [B, S] int32  policy version that sampled token t; -1 where masked
      temperature:    float         sampling temperature the behaviour log-probs were taken at
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    behav_logp: torch.Tensor
    advantages: torch.Tensor
    versions: torch.Tensor
    temperature: float = 1.0

    def __post_init__(self) -> None:
        shape = self.input_ids.shape
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, S], got shape {tuple(shape)}")
        for name in _TENSOR_FIELDS:
            t = getattr(self, name)
            if t.shape != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like input_ids")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        assert self.loss_mask.dtype == torch.bool, "loss_mask must be bool"
        assert self.behav_logp.dtype == torch.float32 and self.advantages.dtype == torch.float32
        assert self.versions.dtype == torch.int32 and self.input_ids.dtype == torch.int64

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_samples(
        cls,
        prompt_ids: Sequence[Sequence[int]],
        response_ids: Sequence[Sequence[int]],
        behav_logp: Sequence[np.ndarray],
        versions: Sequence[np.ndarray],
        advantages: Sequence[float | np.ndarray],
        *,
        temperature: float = 1.0,
        pad_id: int = 0,
        response_masks: Sequence[np.ndarray] | None = None,
    ) -> LearnerBatch:
        """Build a right-padded batch from per-sample lists (one entry per response).

        For sample i with prompt length P and response length R: ``behav_logp[i]`` and
        ``versions[i]`` have length R (one entry per generated token, np.float32 / np.int32);
        ``advantages[i]`` is a float (outcome reward, broadcast to every response token) or an
        array of length R; ``response_masks[i]`` (optional, length R, default all ones) removes
        tokens from the loss, e.g. truncated responses. Response token j lands at position P + j.
        """
        n = len(prompt_ids)
        for name, seq in (
            ("response_ids", response_ids),
            ("behav_logp", behav_logp),
            ("versions", versions),
            ("advantages", advantages),
        ):
            if len(seq) != n:
                raise ValueError(
                    f"{name} has {len(seq)} samples but prompt_ids has {n}; pass one entry per sample"
                )
        if response_masks is not None and len(response_masks) != n:
            raise ValueError(f"response_masks has {len(response_masks)} samples but prompt_ids has {n}")
        if n == 0:
            raise ValueError("cannot build a LearnerBatch from zero samples")
        lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
        S = max(lengths)
        input_ids = np.full((n, S), pad_id, dtype=np.int64)
        attn = np.zeros((n, S), dtype=np.int64)
        mask = np.zeros((n, S), dtype=np.bool_)
        blp = np.zeros((n, S), dtype=np.float32)
        adv = np.zeros((n, S), dtype=np.float32)
        ver = np.full((n, S), -1, dtype=np.int32)
        for i in range(n):
            p = np.asarray(prompt_ids[i], dtype=np.int64)
            r = np.asarray(response_ids[i], dtype=np.int64)
            P, R = len(p), len(r)
            if P == 0:
                raise ValueError(
                    f"sample {i} has an empty prompt; every sequence needs at least one prompt token"
                )
            lp = np.asarray(behav_logp[i], dtype=np.float32)
            v = np.asarray(versions[i], dtype=np.int32)
            if lp.shape != (R,) or v.shape != (R,):
                raise ValueError(
                    f"sample {i}: behav_logp {lp.shape} and versions {v.shape} must both have shape ({R},), "
                    "one entry per response token"
                )
            a = advantages[i]
            a_tok = (
                np.full(R, float(a), dtype=np.float32) if np.ndim(a) == 0 else np.asarray(a, dtype=np.float32)
            )
            if a_tok.shape != (R,):
                raise ValueError(
                    f"sample {i}: advantages has shape {a_tok.shape}, expected a float or ({R},)"
                )
            m = np.ones(R, dtype=np.bool_)
            if response_masks is not None:
                m = np.asarray(response_masks[i]).astype(np.bool_)
                if m.shape != (R,):
                    raise ValueError(f"sample {i}: response_masks has shape {m.shape}, expected ({R},)")
            input_ids[i, :P] = p
            input_ids[i, P : P + R] = r
            attn[i, : P + R] = 1
            mask[i, P : P + R] = m
            blp[i, P : P + R] = np.where(m, lp, np.float32(0.0))
            adv[i, P : P + R] = np.where(m, a_tok, np.float32(0.0))
            ver[i, P : P + R] = np.where(m, v, np.int32(-1))
        return cls(
            input_ids=torch.from_numpy(input_ids),
            attention_mask=torch.from_numpy(attn),
            loss_mask=torch.from_numpy(mask),
            behav_logp=torch.from_numpy(blp),
            advantages=torch.from_numpy(adv),
            versions=torch.from_numpy(ver),
            temperature=float(temperature),
        )

    @classmethod
    def filler(cls, *, temperature: float = 1.0, pad_id: int = 0) -> LearnerBatch:
        """A one-sequence, two-token batch with an empty loss mask.

        Used when a rank has fewer micro-batches than another: FSDP2 needs every rank to run the
        same number of forward/backward passes, and this one contributes exactly zero.
        """
        z = torch.zeros(1, 2)
        return cls(
            input_ids=torch.full((1, 2), pad_id, dtype=torch.int64),
            attention_mask=torch.ones(1, 2, dtype=torch.int64),
            loss_mask=torch.zeros(1, 2, dtype=torch.bool),
            behav_logp=z.float(),
            advantages=z.float(),
            versions=torch.full((1, 2), -1, dtype=torch.int32),
            temperature=temperature,
        )

    # ---------------------------------------------------------------- properties

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_tokens(self) -> int:
        """Number of loss tokens (sum of ``loss_mask``)."""
        return int(self.loss_mask.sum().item())

    @property
    def num_seqs(self) -> int:
        """Number of sequences with at least one loss token."""
        return int(self.loss_mask.any(dim=1).sum().item())

    # ---------------------------------------------------------------- cutting

    def select(self, rows: slice | torch.Tensor | Sequence[int]) -> LearnerBatch:
        """Rows of the batch (a slice or index list), same S."""
        if not isinstance(rows, slice):
            rows = torch.as_tensor(rows, dtype=torch.long)
        return replace(self, **{name: getattr(self, name)[rows] for name in _TENSOR_FIELDS})

    def trim(self) -> LearnerBatch:
        """Drop trailing all-padding columns (S becomes the longest real sequence, at least 2)."""
        real = int(self.attention_mask.sum(dim=1).max().item()) if self.batch_size else 0
        keep = max(real, 2)
        if keep >= self.seq_len:
            return self
        return replace(self, **{name: getattr(self, name)[:, :keep] for name in _TENSOR_FIELDS})

    def split(self, n_minibatches: int) -> list[LearnerBatch]:
        """Cut into ``n_minibatches`` contiguous groups of rows, sizes differing by at most one
        (larger ones first, as ``torch.tensor_split``)."""
        if not 1 <= n_minibatches <= self.batch_size:
            raise ValueError(
                f"n_minibatches={n_minibatches} must be between 1 and the batch size {self.batch_size}; "
                "lower n_minibatches or send more sequences per step"
            )
        return [self.select(rows) for rows in _contiguous_slices(self.batch_size, n_minibatches)]

    def shard(self, rank: int, world_size: int) -> LearnerBatch:
        """Rows owned by ``rank`` for data parallelism: contiguous chunk ``rank`` of
        ``world_size`` (``torch.tensor_split`` sizes). May be empty (0 rows) when B < world_size."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        return self.select(_contiguous_slices(self.batch_size, world_size)[rank])

    def to(self, device: torch.device | str) -> LearnerBatch:
        return replace(self, **{name: getattr(self, name).to(device) for name in _TENSOR_FIELDS})

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields by name (for broadcasting or saving)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in _TENSOR_FIELDS}


def _contiguous_slices(n: int, parts: int) -> list[slice]:
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append(slice(start, stop))
        start = stop
    return out
