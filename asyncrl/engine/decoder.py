"""Batched prefill/decode of a Hugging Face Llama/Qwen2 causal LM over a per-row (slot) KV cache.

Owns: the forward pass the native engine runs (``DecoderRunner``) and the K/V storage it writes
(``SlotKVCache``). Row ``r`` of the cache belongs to one live sequence; sequences join by being prefilled
into fresh rows and leave by ``move_row`` (the last row is moved into the hole), so the live batch is always
rows ``[0, B)`` and requests can join and leave between decode steps.

Must never: sample, know about requests or versions, or re-implement a layer's weights. It calls the HF
model's own submodules (embeddings, norms, q/k/v/o projections, MLP, rotary embedding, lm_head), so any
module swapped in by ``asyncrl.quant`` (quantized Linear layers) is used as-is, and it reads them at call
time so in-place weight loads are seen on the next step.

Invariants:
  * each row has its own position ids ``0..len-1`` (no left padding, no shared offset), so the logits
    of every token equal a plain, unpadded HF forward of that sequence up to float rounding;
  * prefill right-pads; padded keys are masked and their cache slots are overwritten before they are read;
  * logits are returned as fp32 (``[n, V] float32``) whatever the model dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.nn.functional as F

from asyncrl.models.prepare import SUPPORTED_MODEL_TYPES

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def check_supported(config) -> None:
    """Raise ``ValueError`` unless the native engine's forward is exact for this HF config."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"native engine supports model_type in {SUPPORTED_MODEL_TYPES}, got {model_type!r}; "
            "use a Llama- or Qwen2-family checkpoint or the SGLang engine"
        )
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise ValueError(
            "native engine does not implement sliding-window attention; set use_sliding_window=False"
        )
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") in _LENGTH_DEPENDENT_ROPE:
        raise ValueError(
            f"rope_type {rope.get('rope_type')!r} depends on the sequence length and is not supported by the "
            "native engine; use default/linear/llama3/yarn rope"
        )


class SlotKVCache:
    """K/V buffers per layer, ``k[l], v[l]: [cap_rows, n_kv_heads, cap_len, head_dim]``, grown by doubling.

    ``need_len`` (``max_len`` until the engine sets it when it admits rows: the longest prompt + response
    limit among the live rows) caps the doubling of ``cap_len``, so a batch of 60-token prompts with 64 new
    tokens holds 124 positions per row, not 240 (SmolLM2-135M, 32 rows, fp32: 0.18 GB instead of 0.35)."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_rows: int, max_len: int) -> None:
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.max_rows, self.max_len = max_rows, max_len
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.cap_rows = 0
        self.cap_len = 0
        self.need_len = max_len

    @torch.inference_mode()
    def reserve(self, rows: int, length: int, dtype: torch.dtype, device: torch.device) -> None:
        """Make room for ``rows`` rows of ``length`` positions, keeping existing contents."""
        assert rows <= self.max_rows and length <= self.max_len, (rows, length)
        if self.k and self.k[0].dtype != dtype:
            raise ValueError(
                f"K/V dtype changed from {self.k[0].dtype} to {dtype}; close and rebuild the engine"
            )
        if rows <= self.cap_rows and length <= self.cap_len:
            return
        new_rows = min(self.max_rows, max(rows, 2 * self.cap_rows, 1))
        new_len = min(self.max_len, max(length, min(2 * self.cap_len, self.need_len), 16))
        shape = (new_rows, self.n_kv_heads, new_len, self.head_dim)
        for bufs in (self.k, self.v):
            for layer in range(self.n_layers):
                new = torch.zeros(shape, dtype=dtype, device=device)
                if layer < len(bufs):
                    new[: self.cap_rows, :, : self.cap_len] = bufs[layer]
                    bufs[layer] = new
                else:
                    bufs.append(new)
        self.cap_rows, self.cap_len = new_rows, new_len

    @torch.inference_mode()
    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of row ``src`` into row ``dst`` in every layer."""
        if src == dst or length == 0:
            return
        for bufs in (self.k, self.v):
            for buf in bufs:
                buf[dst, :, :length] = buf[src, :, :length]

    def release(self) -> None:
        self.k.clear()
        self.v.clear()
        self.cap_rows = self.cap_len = 0


_Fn = Callable[[torch.Tensor], torch.Tensor]


class _Attention(Protocol):
    q_proj: _Fn
    k_proj: _Fn
    v_proj: _Fn
    o_proj: _Fn
    head_dim: int
    scaling: float


class _Layer(Protocol):
    self_attn: _Attention
    input_layernorm: _Fn
    post_attention_layernorm: _Fn
    mlp: _Fn


class _Backbone(Protocol):
    embed_tokens: torch.nn.Embedding
    rotary_emb: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    layers: Sequence[_Layer]
    norm: _Fn


class HFDecoder(Protocol):
    """The module tree of a Hugging Face Llama/Qwen2 causal LM that ``DecoderRunner`` calls."""

    config: PretrainedConfig
    model: _Backbone
    lm_head: _Fn


def decoder_view(model: torch.nn.Module) -> HFDecoder:
    """``model`` typed as the HF decoder tree (``check_supported`` vouches for it on the config's model_type)."""
    return cast(HFDecoder, model)


class DecoderRunner:
    """Runs prefill for new rows and one decode step for live rows of a Llama/Qwen2 HF model."""

    def __init__(self, model: torch.nn.Module, max_rows: int, max_len: int) -> None:
        hf = decoder_view(model)
        config = hf.config
        check_supported(config)
        self.model = hf
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        attn = hf.model.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = float(attn.scaling)
        self.cache = SlotKVCache(len(hf.model.layers), self.n_kv_heads, self.head_dim, max_rows, max_len)

    @property
    def device(self) -> torch.device:
        return self.model.model.embed_tokens.weight.device

    def _qkv(self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``h: [B, L, D]`` -> q ``[B, H, L, hd]``, k/v ``[B, KV, L, hd]`` with rotary applied to q, k."""
        B, L, _ = h.shape
        attn = layer.self_attn
        q = attn.q_proj(h).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def _attend(self, q, k, v, mask) -> torch.Tensor:
        """q ``[B, H, Lq, hd]``, k/v ``[B, KV, Lk, hd]``, mask ``[B, 1, Lq, Lk]`` bool -> ``[B, Lq, H*hd]``."""
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=self.n_heads != self.n_kv_heads
        )
        B, _, Lq, _ = q.shape
        return out.transpose(1, 2).reshape(B, Lq, self.n_heads * self.head_dim)

    def _block_tail(self, layer: _Layer, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        x = x + layer.self_attn.o_proj(attn_out)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _logits(self, h_last: torch.Tensor) -> torch.Tensor:
        """``h_last: [B, D]`` -> ``[B, V] float32``."""
        return self.model.lm_head(self.model.model.norm(h_last)).float()

    @torch.inference_mode()
    def prefill(self, row0: int, prompts: list[list[int]], live_rows: int) -> torch.Tensor:
        """Write K/V of ``prompts`` into rows ``row0..row0+n-1``; return next-token logits ``[n, V] float32``.

        ``live_rows`` is the total number of live rows after these join (for cache sizing).
        """
        base = self.model.model
        device = self.device
        n = len(prompts)
        lens = torch.tensor([len(p) for p in prompts], device=device)
        Lp = max(len(p) for p in prompts)
        ids = torch.zeros(n, Lp, dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        pos = torch.arange(Lp, device=device)
        x = base.embed_tokens(ids)
        cos, sin = base.rotary_emb(x, pos.expand(n, Lp))
        causal = pos[None, :] <= pos[:, None]
        mask = (causal[None] & (pos[None, None, :] < lens[:, None, None])).unsqueeze(1)
        for li, layer in enumerate(base.layers):
            q, k, v = self._qkv(layer, layer.input_layernorm(x), cos, sin)
            if li == 0:
                self.cache.reserve(live_rows, Lp, k.dtype, device)
            self.cache.k[li][row0 : row0 + n, :, :Lp] = k
            self.cache.v[li][row0 : row0 + n, :, :Lp] = v
            x = self._block_tail(layer, x, self._attend(q, k, v, mask))
        last = x[torch.arange(n, device=device), lens - 1]
        return self._logits(last)

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """Feed ``tokens[b]`` at position ``positions[b]`` of row b (rows ``0..B-1``); return ``[B, V] float32``."""
        base = self.model.model
        device = self.device
        B = len(tokens)
        ids = torch.tensor(tokens, dtype=torch.long, device=device)[:, None]
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        Lk = max(positions) + 1
        rows = torch.arange(B, device=device)
        x = base.embed_tokens(ids)
        cos, sin = base.rotary_emb(x, pos[:, None])
        mask = (torch.arange(Lk, device=device)[None, :] <= pos[:, None])[:, None, None, :]
        for li, layer in enumerate(base.layers):
            q, k, v = self._qkv(layer, layer.input_layernorm(x), cos, sin)
            if li == 0:
                self.cache.reserve(B, Lk, k.dtype, device)
            kb, vb = self.cache.k[li], self.cache.v[li]
            kb[rows, :, pos] = k[:, :, 0]
            vb[rows, :, pos] = v[:, :, 0]
            x = self._block_tail(layer, x, self._attend(q, kb[:B, :, :Lk], vb[:B, :, :Lk], mask))
        return self._logits(x[:, 0])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
