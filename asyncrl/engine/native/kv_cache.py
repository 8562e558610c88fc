"""The native engine's K/V storage: one tensor per engine, ``kv[n_layers, 2, rows, n_kv_heads, cap_len, head_dim]``.

Owns: the single K/V allocation both decode paths (the eager ``DecoderRunner`` and the static step of
``asyncrl.engine.native.static_step``) read and write, its sizing, and moving a row.

Must never: grow or reallocate inside a forward (``reserve`` is called between steps, at a step boundary),
know about requests, or sample.

Invariants:
  * all ``max_rows`` rows exist from the first ``reserve`` on; only the position capacity ``cap_len`` grows,
    by doubling, capped by ``need_len`` (the longest prompt + response limit among the live rows, set by the
    engine at admission) and by ``max_len``;
  * ``k[l]`` / ``v[l]`` are views ``kv[l, 0]`` / ``kv[l, 1]`` (``[rows, KV, cap_len, hd]``), rebuilt whenever the
    storage is; ``generation`` counts reallocations, so a holder of pointers (a captured CUDA graph) knows
    when they went stale;
  * ``move_row`` is one copy over every layer and both of K and V.
"""

from __future__ import annotations

import torch


class StaticKVCache:
    """``kv: [n_layers, 2, max_rows, n_kv_heads, cap_len, head_dim]`` plus per-layer views ``k``, ``v``.

    A batch of 60-token prompts with 64 new tokens holds 124 positions per row, not ``max_len``: the
    capacity follows ``need_len`` (SmolLM2-135M, 32 rows, fp32: 0.18 GB instead of 12 GB at 8192).
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_rows: int, max_len: int) -> None:
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.max_rows, self.max_len = max_rows, max_len
        self.kv: torch.Tensor | None = None
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.cap_rows = 0
        self.cap_len = 0
        self.need_len = max_len
        self.generation = 0

    @property
    def dtype(self) -> torch.dtype | None:
        return None if self.kv is None else self.kv.dtype

    @torch.inference_mode()
    def reserve(self, rows: int, length: int, dtype: torch.dtype, device: torch.device) -> None:
        """Make room for ``length`` positions (``rows`` is checked against ``max_rows``), keeping contents."""
        if rows > self.max_rows or length > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_rows} rows of {self.max_len} positions, asked for "
                             f"{rows} x {length}; raise max_batch_size / max_seq_len")
        if self.kv is not None and self.kv.dtype != dtype:
            raise ValueError(f"K/V dtype changed from {self.kv.dtype} to {dtype}; close and rebuild the engine")
        if self.kv is not None and length <= self.cap_len:
            return
        new_len = min(self.max_len, max(length, min(2 * self.cap_len, self.need_len), 16))
        shape = (self.n_layers, 2, self.max_rows, self.n_kv_heads, new_len, self.head_dim)
        new = torch.zeros(shape, dtype=dtype, device=device)
        if self.kv is not None:
            new[..., : self.cap_len, :] = self.kv
        self.kv = new
        self.k = [new[layer, 0] for layer in range(self.n_layers)]
        self.v = [new[layer, 1] for layer in range(self.n_layers)]
        self.cap_rows, self.cap_len = self.max_rows, new_len
        self.generation += 1

    @torch.inference_mode()
    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of row ``src`` into row ``dst`` (all layers, K and V: one copy)."""
        if src == dst or length == 0 or self.kv is None:
            return
        self.kv[:, :, dst, :, :length] = self.kv[:, :, src, :, :length]

    def release(self) -> None:
        self.kv = None
        self.k.clear()
        self.v.clear()
        self.cap_rows = self.cap_len = 0
        self.generation += 1
