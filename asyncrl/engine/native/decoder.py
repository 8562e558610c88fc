"""Batched prefill/decode of a Hugging Face Llama/Qwen2/Qwen3/Mistral causal LM over a per-row KV cache.

Owns: the eager forward pass the native engine runs (``DecoderRunner``: prefill of joining rows, and the
reference decode step the static step of ``asyncrl.engine.native.static_step`` is tested against and that forward
AQN runs on), the per-layer maths both paths share (``qkv``: projections, Qwen3's per-head q/k norm, RoPE;
``qkv_decode`` / ``mlp_decode``: the decode step's, with fused sibling projections taken as views of one output),
and which HF configs it runs exactly (``native_unsupported_reason`` says why not). Row ``r`` of the cache
(``asyncrl.engine.native.kv_cache.StaticKVCache``) belongs to one live sequence; sequences join by being prefilled
into fresh rows and leave by ``move_row`` (the last row is moved into the hole), so the live batch is always
rows ``[0, B)`` and requests can join and leave between decode steps.

Must never: sample, know about requests or versions, or re-implement a layer's weights. It calls the HF
model's own submodules (embeddings, norms, q/k/v/o projections, q/k norms, MLP, rotary embedding, lm_head),
so any module swapped in by ``asyncrl.quant`` (quantized Linear layers) is used as-is, and it reads them at
call time so in-place weight loads are seen on the next step. Import nothing from ``asyncrl.models``.

Invariants:
  * each row has its own position ids ``0..len-1`` (no left padding, no shared offset), so the logits
    of every token equal a plain, unpadded HF forward of that sequence up to float rounding;
  * prefill runs every joining row in one forward, right-padded; padded keys are masked and their cache slots
    are overwritten before they are read; it reads nothing back from the device (no host sync);
  * logits are returned as fp32 (``[n, V] float32``) whatever the model dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import torch
import torch.nn.functional as F

from asyncrl.engine.native.kv_cache import StaticKVCache
from asyncrl.models.prepare import NATIVE_MODEL_TYPES

if TYPE_CHECKING:
    from transformers import PretrainedConfig

"""HF ``model_type``s whose forward the native decoder reproduces exactly (Qwen3: per-head q/k RMSNorm
before RoPE; Mistral: Llama's layer, with a sliding window that must cover the sequence limit)."""
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def native_unsupported_reason(config, max_seq_len: int | None = None) -> str | None:
    """``None`` when the native decoder runs ``config`` exactly, else the reason it does not (with the fix).

    ``max_seq_len``: the engine's sequence limit (default: the model's ``max_position_embeddings``); a
    Mistral sliding window at least that long never slides, so it is accepted.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in NATIVE_MODEL_TYPES:
        return (f"the native decoder runs model_type in {NATIVE_MODEL_TYPES}, got {model_type!r}; use one of "
                "those checkpoints or the SGLang engine")
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return "the native decoder does not implement sliding-window attention; set use_sliding_window=False"
    window = getattr(config, "sliding_window", None) if model_type == "mistral" else None
    limit = int(max_seq_len or getattr(config, "max_position_embeddings", 0) or 0)
    if window is not None and int(window) < limit:
        return (f"this Mistral model attends over a sliding window of {window} positions, shorter than the "
                f"sequence limit {limit}, and the native decoder does not implement sliding windows; set "
                f"max_seq_len <= {window} (rollout max_seq_len / NativeEngine(max_seq_len=...))")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") in _LENGTH_DEPENDENT_ROPE:
        return (f"rope_type {rope.get('rope_type')!r} depends on the sequence length and is not supported by "
                "the native engine; use default/linear/llama3/yarn rope")
    return None


def check_supported(config, max_seq_len: int | None = None) -> None:
    """Raise ``ValueError`` (naming the fix) unless the native engine's forward is exact for this HF config."""
    reason = native_unsupported_reason(config, max_seq_len)
    if reason is not None:
        raise ValueError(reason)


def upload_ints(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """``host`` (int64, any shape) as a tensor on ``device``, in one host-to-device copy that never blocks the host.

    On CUDA the values are staged in page-locked memory and copied with ``non_blocking=True``: a copy from pageable
    memory (``torch.tensor(...).to(device)``) waits for the stream to drain, i.e. for the step already queued
    on the GPU. The staging block comes from torch's caching host allocator, which does not hand it out again
    before the copy has run. On a CPU it is one plain copy."""
    stage = torch.empty(host.shape, dtype=torch.long, pin_memory=device.type == "cuda")
    stage.numpy()[...] = host
    return torch.empty(host.shape, dtype=torch.long, device=device).copy_(stage, non_blocking=True)


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
    embed_tokens: _Fn  # an nn.Embedding, or int8 codes (asyncrl.quant.QuantEmbedding, quant.embedding)
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


def qkv(layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv_heads: int,
        head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``h: [B, L, D]``, ``cos/sin: [B, L, hd]`` -> q ``[B, H, L, hd]``, k/v ``[B, KV, L, hd]``, RoPE on q and k.

    Qwen3's ``q_norm`` / ``k_norm`` (RMSNorm over each head's ``hd``) run before RoPE, as in HF."""
    return _qkv(layer, h, cos.unsqueeze(1), sin.unsqueeze(1), n_heads, n_kv_heads, head_dim, _rope)


def _qkv(layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv_heads: int,
         head_dim: int, rope: _Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`qkv` with ``cos/sin: [B, 1, L, hd]`` (broadcast over the heads) in the form ``rope`` takes."""
    B, L, _ = h.shape
    attn = layer.self_attn
    q = attn.q_proj(h).view(B, L, n_heads, head_dim)
    k = attn.k_proj(h).view(B, L, n_kv_heads, head_dim)
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if q_norm is not None and k_norm is not None:
        q, k = q_norm(q), k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = attn.v_proj(h).view(B, L, n_kv_heads, head_dim).transpose(1, 2)
    return rope(q, cos, sin), rope(k, cos, sin), v


_Rope = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's RoPE: ``t * cos + rotate_half(t) * sin``."""
    return t * cos + _rotate_half(t) * sin


def _rope_signed(t: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`_rope` with the sign of ``rotate_half`` folded into ``sin_signed`` (`decode_rope_tables`): the halves of
    ``t`` swapped, times ``[-sin_1, sin_2]``. The same bits, as ``(-a) * b == a * (-b)`` exactly, with one op
    (the negation) fewer per call."""
    half = t.shape[-1] // 2
    swapped = t.view(*t.shape[:-1], 2, half).flip(-2).view(t.shape)
    return t * cos + swapped * sin_signed


def decode_rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos/sin: [B, 1, hd]`` of one decode position per row -> the ``cos, sin_signed: [B, 1, 1, hd]``
    `qkv_decode` takes, made once per step for every layer."""
    half = sin.shape[-1] // 2
    return cos[:, None], torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, None]


def sibling_outputs(mods: Sequence[Any], h: torch.Tensor) -> torch.Tensor | None:
    """``h: [..., K]`` -> the outputs of the sibling projections ``mods`` (q/k/v, gate/up) side by side,
    ``[..., sum N]`` in ``mods``' order, from one call to the fused group they form (``asyncrl.quant.fused``:
    ``SiblingGroup.forward_all``, each column the bits of that module's own output); None where they are not
    exactly one group, in this order (unquantized or unfused linears: call the modules)."""
    group = getattr(mods[0], "_group", None)
    if group is None or len(group.members) != len(mods):
        return None
    if any(a is not b for a, b in zip(group.members, mods, strict=True)):
        return None
    x2 = h.reshape(-1, h.shape[-1])
    y = group.forward_all(x2 if x2.dtype == torch.float32 else x2.float())
    y = y.view(*h.shape[:-1], y.shape[-1])
    return y if y.dtype == h.dtype else y.to(h.dtype)


def qkv_decode(layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, n_heads: int,
               n_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`qkv` for one position per row: ``h: [B, 1, D]``, ``cos, sin_signed: [B, 1, 1, hd]`` (`decode_rope_tables`,
    once per step) -> q ``[B, H, 1, hd]``, k/v ``[B, KV, 1, hd]``, the values of `qkv`.

    Where q/k/v are one fused group and the model has no per-head q/k norm, their one output is split into views
    and RoPE runs once over the q and k heads together: one epilogue and one RoPE pass instead of three and two,
    the same elementwise ops on every element. q, k and v are then strided views (attention reads them as such;
    prefill keeps `qkv`'s layout, which its attention reads directly)."""
    attn = layer.self_attn
    y = None
    if getattr(attn, "q_norm", None) is None:
        y = sibling_outputs((attn.q_proj, attn.k_proj, attn.v_proj), h)
    if y is None:
        return _qkv(layer, h, cos, sin_signed, n_heads, n_kv_heads, head_dim, _rope_signed)
    y = y.view(h.shape[0], 1, n_heads + 2 * n_kv_heads, head_dim)
    qk = _rope_signed(y[:, :, : n_heads + n_kv_heads], cos, sin_signed)
    return qk[:, :, :n_heads].transpose(1, 2), qk[:, :, n_heads:].transpose(1, 2), y[:, :, -n_kv_heads:].transpose(1, 2)


def mlp_decode(layer: _Layer, h: torch.Tensor) -> torch.Tensor:
    """``layer.mlp(h)`` (HF's ``down_proj(act_fn(gate_proj(h)) * up_proj(h))``), with gate/up taken as views of
    their fused group's one output where they form one (`sibling_outputs`): one epilogue instead of two."""
    mlp: Any = layer.mlp
    gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
    y = None if gate is None or up is None else sibling_outputs((gate, up), h)
    if y is None or gate is None:
        return mlp(h)
    n = gate.out_features
    return mlp.down_proj(mlp.act_fn(y[..., :n]) * y[..., n:])


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention without copying K/V for grouped-query heads.

    q ``[B, H, 1, hd]``, k/v ``[B, KV, L, hd]``, mask ``[B, 1, 1, L]`` bool -> ``[B, 1, H*hd]``. The ``G = H / KV``
    query heads of KV head ``j`` (HF's ``repeat_interleave`` order: heads ``j*G .. j*G+G-1``) are folded into the
    query-length axis, ``q: [B, KV, G, hd]``, so SDPA runs with equal head counts (no ``enable_gqa``, which
    would copy K/V to every query head) in the compute dtype.
    """
    B, H, _, hd = q.shape
    KV = k.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(B, KV, H // KV, hd), k, v, attn_mask=mask, scale=scale)
    return out.reshape(B, 1, H * hd)


class DecoderRunner:
    """Runs prefill for new rows and one eager decode step for live rows of a supported HF model."""

    def __init__(self, model: torch.nn.Module, max_rows: int, max_len: int) -> None:
        hf = decoder_view(model)
        config = hf.config
        check_supported(config, max_len)
        self.model = hf
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        attn = hf.model.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = float(attn.scaling)
        self.cache = StaticKVCache(len(hf.model.layers), self.n_kv_heads, self.head_dim, max_rows, max_len)

    @property
    def device(self) -> torch.device:
        norm: Any = self.model.model.norm  # (not the embedding: it may be int8 codes, quant.embedding)
        return norm.weight.device

    def _qkv(self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``h: [B, L, D]`` -> q ``[B, H, L, hd]``, k/v ``[B, KV, L, hd]`` with rotary applied to q, k."""
        return qkv(layer, h, cos, sin, self.n_heads, self.n_kv_heads, self.head_dim)

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

        ``live_rows`` is the total number of live rows after these join (for cache sizing). One forward for
        all ``n`` prompts, right-padded to the longest (causal + padding mask), whatever ``n``: the same ops
        for one prompt as for many. Nothing is read back from the device: the prompts and their lengths reach
        it in one copy that does not block the host (`upload_ints`), and every shape comes from their Python
        lengths, so a step that admits rows runs its prefill without a host sync.
        """
        base = self.model.model
        device = self.device
        n = len(prompts)
        Lp = max(len(p) for p in prompts)  # host ints: no shape here is read back from the device
        host = np.zeros((n, Lp + 1), dtype=np.int64)  # ids right-padded, then each row's length
        for i, p in enumerate(prompts):
            host[i, : len(p)] = p
            host[i, Lp] = len(p)
        staged = upload_ints(host, device)
        ids, lens = staged[:, :Lp], staged[:, Lp]
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
        cos, sin = decode_rope_tables(*base.rotary_emb(x, pos[:, None]))
        mask = (torch.arange(Lk, device=device)[None, :] <= pos[:, None])[:, None, None, :]
        H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
        for li, layer in enumerate(base.layers):
            q, k, v = qkv_decode(layer, layer.input_layernorm(x), cos, sin, H, KV, hd)
            if li == 0:
                self.cache.reserve(B, Lk, k.dtype, device)
            kb, vb = self.cache.k[li], self.cache.v[li]
            kb[rows, :, pos] = k[:, :, 0]
            vb[rows, :, pos] = v[:, :, 0]
            x = x + layer.self_attn.o_proj(attend_one(q, kb[:B, :, :Lk], vb[:B, :, :Lk], mask, self.scaling))
            x = x + mlp_decode(layer, layer.post_attention_layernorm(x))
        return self._logits(x[:, 0])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
