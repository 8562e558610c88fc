"""The rollout's token embedding as int8 codes (``quant.embedding``).

Owns: `QuantEmbedding`, the actor's embedding lookup from int8 row codes, and `EMBED_SUFFIXES`, the names
and roles of its tensors, which are the int8 linear's (``qweight`` [V, H] int8, ``weight_scale`` [V] fp32).

An embedding is a table of rows, and the int8 rule of int8.py (one fp32 scale per row, round half to even)
is a per-token rule on it: row t of the actor's table is ``fp32(q[t] * s[t])``, the dequantisation of
int8.py. An RL step moves an embedding row by far less than its quantisation step, so from one version to
the next few codes change, where a full-precision table that the optimiser moved everywhere would travel
whole with every version (delta.py). The table is a quarter of the fp32 bytes in a worker's memory.

With tied embeddings and an int8 output head (``quant.lm_head``) the head's codes are this table: the
int8 rule quantises the head's weight [V, H] per output row, which is per token. The embedding then holds
the head's own buffers (one copy in memory, published once, under the head's names; the loaders accept a
name the model holds twice being absent). In every other case the embedding has codes of its own.

Must never: quantise with another rule than int8.py's (the learner's rollout-aligned forward computes the
same rows with `quantize_int8_rows`), or be converted or moved after conversion without its head (moving
the module would split buffers the head shares).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .formats import ROLE_CODES, ROLE_SCALE
from .int8 import quantize_int8_rows

EMBED_SUFFIXES: dict[str, str] = {"qweight": ROLE_CODES, "weight_scale": ROLE_SCALE}
"""Tensor names (relative to the embedding's prefix) -> roles; the int8 format's."""
EMBED_FORMAT = "int8"
"""The rule an embedding's codes follow, whatever the run's format (its manifest entries say so)."""


def dequantize_rows(codes: Tensor, scale: Tensor, ids: Tensor) -> Tensor:
    """Rows ``ids`` of the table ``codes`` [V, H] int8 with scales ``scale`` [V]: fp32 ``q * s`` (int8.py)."""
    return F.embedding(ids, codes).float().mul_(scale[ids].unsqueeze(-1))


class QuantEmbedding(nn.Module):
    """``embedding(ids)`` from int8 row codes: the same result dtype as the embedding it replaced."""

    qweight: Tensor
    weight_scale: Tensor

    def __init__(self, codes: Tensor, scale: Tensor, *, padding_idx: int | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = codes.shape
        self.padding_idx = padding_idx
        self.out_dtype = dtype
        self.register_buffer("qweight", codes)
        self.register_buffer("weight_scale", scale)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, *, name: str | None = None) -> QuantEmbedding:
        """Quantise ``emb.weight`` row by row (a QuantError naming ``name`` for a non-finite row)."""
        codes, scale = quantize_int8_rows(emb.weight.detach(), name=name)
        return cls(codes, scale, padding_idx=emb.padding_idx, dtype=emb.weight.dtype)

    @classmethod
    def sharing(cls, head: Any, emb: nn.Embedding) -> QuantEmbedding:
        """The embedding of a tied model whose int8 head (an ``Int8Linear`` quantised from the same matrix)
        holds its codes: the head's buffers, not copies."""
        return cls(head.qweight, head.weight_scale, padding_idx=emb.padding_idx, dtype=emb.weight.dtype)

    def forward(self, ids: Tensor) -> Tensor:
        out = dequantize_rows(self.qweight, self.weight_scale, ids)
        return out if out.dtype == self.out_dtype else out.to(self.out_dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, fmt={EMBED_FORMAT}, padding_idx={self.padding_idx}"
