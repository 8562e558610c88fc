"""The HF fallback runner: any causal LM's own Hugging Face forward, batched over rows with a per-row KV cache.

Owns: ``HFRunner`` (the eager ``prefill`` / ``decode`` / ``cache`` interface of the native decoder, run
through the model's own ``forward``), ``RowKVCache`` (the positional per-row K/V storage it hands the model
as its cache) and ``make_runner``, the choice between the native decoder and this fallback.

Must never: sample, know about requests or versions, or re-implement any layer: everything between the
token ids and the logits is the model's own code (attention variants, q/k norms, mixture-of-experts
routing, logit scaling), so whatever ``forward`` computes is what the engine samples from. Modules swapped
by ``asyncrl.quant`` are called as they are.

Invariants:
  * exact: row ``r``'s cache slot ``p`` holds the K/V of its position ``p``; every row has its own
    position ids ``0..len-1`` and an explicit boolean mask (causal, the row's own length, the sliding
    window where the model has one), so each row's logits equal an unpadded HF forward of that sequence
    up to float rounding (no left padding, no shared offset);
  * rows join by prefill into fresh rows and leave by ``cache.move_row`` (the engine keeps rows
    ``[0, B)`` live), exactly as with the native decoder;
  * logits come back ``[n, V] float32`` whatever the model dtype.
Slower than the native decoder (the model's generic forward, masks built per step); ``make_runner`` picks it
only when the native decoder is not exact for the model, and says so once per model type and process.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import numpy as np
import torch

from asyncrl.engine.native.decoder import upload_ints

log = logging.getLogger("asyncrl.engine")
_ANNOUNCED: set[str] = set()


class RowKVCache:
    """K/V per layer, ``k[l]: [cap_rows, n_kv_heads, cap_len, head_dim]`` (v alike; shapes taken from the
    first tensors the layer stores, so layers may differ), grown by doubling up to ``max_rows`` x ``max_len``.

    It is the ``cache`` object handed to the HF forward: the model calls ``update(k, v, layer_idx)`` in each
    attention layer and attends over what it returns. The runner sets what the next forward writes
    (``_prefill`` or ``_decode``) just before calling the model. ``need_len`` caps the doubling of
    ``cap_len`` (the engine sets it on admission, as for the native cache)."""

    def __init__(self, max_rows: int, max_len: int) -> None:
        self.max_rows, self.max_len = max_rows, max_len
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.cap_rows = self.cap_len = 0
        self.need_len = max_len
        self._prefill: tuple[int, int] | None = None  # (row0, n)
        self._decode: tuple[torch.Tensor, torch.Tensor, int] | None = None  # (rows [B], positions [B], Lk)

    def grow(self, rows: int, length: int) -> None:
        """Raise the capacity to hold ``rows`` rows of ``length`` positions (buffers grow at the next update)."""
        if rows > self.max_rows or length > self.max_len:
            raise ValueError(f"{rows} rows x {length} positions exceed the cache ({self.max_rows} x {self.max_len})")
        if rows > self.cap_rows:
            self.cap_rows = min(self.max_rows, max(rows, 2 * self.cap_rows, 1))
        if length > self.cap_len:
            self.cap_len = min(self.max_len, max(length, min(2 * self.cap_len, self.need_len), 16))

    def _buffers(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for store, t in ((self.k, k), (self.v, v)):
            buf = store.get(layer)
            if buf is not None and buf.dtype != t.dtype:
                raise ValueError(f"K/V dtype changed from {buf.dtype} to {t.dtype}; close and rebuild the engine")
            if buf is None or buf.shape[0] < self.cap_rows or buf.shape[2] < self.cap_len:
                new = torch.zeros((self.cap_rows, t.shape[1], self.cap_len, t.shape[3]), dtype=t.dtype, device=t.device)
                if buf is not None:
                    new[: buf.shape[0], :, : buf.shape[2]] = buf
                store[layer] = buf = new
            out.append(buf)
        return out[0], out[1]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new K/V ``[B, KV, L, hd]`` of layer ``layer_idx``; return the K/V the queries attend to."""
        kb, vb = self._buffers(layer_idx, key_states, value_states)
        if self._prefill is not None:
            row0, n = self._prefill
            length = key_states.shape[2]
            kb[row0 : row0 + n, :, :length] = key_states
            vb[row0 : row0 + n, :, :length] = value_states
            return key_states, value_states  # fresh rows attend to their own prompt only
        assert self._decode is not None, "the cache was called outside a runner step"
        rows, pos, lk = self._decode
        kb[rows, :, pos] = key_states[:, :, 0]
        vb[rows, :, pos] = value_states[:, :, 0]
        B = rows.shape[0]
        return kb[:B, :, :lk], vb[:B, :, :lk]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Unused by the runner's forwards (it always passes position ids); 0 for callers that ask."""
        return 0

    @torch.inference_mode()
    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of row ``src`` into row ``dst`` in every layer."""
        if src == dst or length == 0:
            return
        for store in (self.k, self.v):
            for buf in store.values():
                buf[dst, :, :length] = buf[src, :, :length]

    def release(self) -> None:
        self.k.clear()
        self.v.clear()
        self.cap_rows = self.cap_len = 0


class HFRunner:
    """Prefill for new rows and one decode step for live rows, through ``model.forward`` (module docstring)."""

    path = "hf_fallback"

    def __init__(self, model: torch.nn.Module, max_rows: int, max_len: int) -> None:
        hf: Any = model  # a transformers PreTrainedModel (config, get_input_embeddings, set_attn_implementation)
        config = hf.config
        if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
            hf.set_attn_implementation("sdpa")  # the explicit 4D masks need an attention that takes them
        self.model = hf
        self.config = config
        self.cache = RowKVCache(max_rows, max_len)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = "logits_to_keep" in params
        types = list(getattr(config, "layer_types", None) or [])
        window = getattr(config, "sliding_window", None)
        self._windows: dict[str, int | None] | None = None  # layer type -> window, for mixed-type models
        self._window: int | None = None  # one window for every layer
        if "sliding_attention" in types:
            if set(types) == {"sliding_attention"}:
                self._window = window
            else:
                self._windows = {t: (window if t == "sliding_attention" else None) for t in set(types)}
        elif not types:
            self._window = window  # Mistral/Mixtral style: sliding_window applies to every layer when set

    @property
    def device(self) -> torch.device:
        return self.model.device  # (its first parameter's: the embedding may hold int8 codes, quant.embedding)

    def _mask(self, qpos: torch.Tensor, lengths: torch.Tensor, lk: int) -> Any:
        """Masks for queries at positions ``qpos [B, Lq]`` over key slots ``0..lk-1`` of rows whose first
        ``lengths [B]`` slots are valid: ``[B, 1, Lq, Lk]`` (bool for sdpa, additive for eager), or a dict by
        layer type for models whose layers differ."""
        kpos = torch.arange(lk, device=qpos.device)[None, None, :]
        base = (kpos <= qpos[:, :, None]) & (kpos < lengths[:, None, None])

        def finish(window: int | None) -> torch.Tensor:
            m = base if window is None else base & (kpos > qpos[:, :, None] - window)
            m = m[:, None]
            if self.config._attn_implementation == "eager":
                dtype = self.model.dtype
                m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, torch.finfo(dtype).min)
            return m

        if self._windows is not None:
            return {t: finish(w) for t, w in self._windows.items()}
        return finish(self._window)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: Any, keep: torch.Tensor | int) -> torch.Tensor:
        kwargs: dict[str, Any] = {self._cache_kw: self.cache, "use_cache": True}
        if self._keep_kw:
            kwargs["logits_to_keep"] = keep
        return self.model(input_ids=ids, attention_mask=mask, position_ids=pos, **kwargs).logits

    @torch.inference_mode()
    def prefill(self, row0: int, prompts: list[list[int]], live_rows: int) -> torch.Tensor:
        """Write K/V of ``prompts`` into rows ``row0..row0+n-1``; return next-token logits ``[n, V] float32``.

        ``live_rows`` is the total number of live rows after these join (for cache sizing)."""
        device = self.device
        n = len(prompts)
        lp = max(len(p) for p in prompts)
        # one host array, one copy that does not block the host: rows 0..n-1 hold the right-padded ids, the
        # length and where the row's last position is in the logits kept; row n the positions kept (the sorted
        # distinct last positions, at most lp of them), so nothing is read back from the device
        last = [len(p) - 1 for p in prompts]
        kept = sorted(set(last)) if self._keep_kw else []
        where = {q: i for i, q in enumerate(kept)}
        host = np.zeros((n + 1, lp + 2), dtype=np.int64)
        for i, p in enumerate(prompts):
            host[i, : len(p)] = p
            host[i, lp] = len(p)
            host[i, lp + 1] = where[last[i]] if self._keep_kw else last[i]
        host[n, : len(kept)] = kept
        staged = upload_ints(host, device)
        ids, lens, rows_last = staged[:n, :lp], staged[:n, lp], staged[:n, lp + 1]
        keep: torch.Tensor | int = staged[n, : len(kept)] if self._keep_kw else 0
        pos = torch.arange(lp, device=device).expand(n, lp)
        self.cache.grow(live_rows, lp)
        self.cache._prefill = (row0, n)
        try:
            logits = self._forward(ids, pos, self._mask(pos, lens, lp), keep)
        finally:
            self.cache._prefill = None
        return logits[torch.arange(n, device=device), rows_last].float()

    @torch.inference_mode()
    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """Feed ``tokens[b]`` at position ``positions[b]`` of row b (rows ``0..B-1``); return ``[B, V] float32``."""
        device = self.device
        B = len(tokens)
        ids = torch.tensor(tokens, dtype=torch.long, device=device)[:, None]
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        lk = int(max(positions)) + 1
        self.cache.grow(B, lk)
        self.cache._decode = (torch.arange(B, device=device), pos, lk)
        try:
            logits = self._forward(ids, pos[:, None], self._mask(pos[:, None], pos + 1, lk), 1)
        finally:
            self.cache._decode = None
        return logits[:, -1].float()


def native_gaps(model: torch.nn.Module) -> list[str]:
    """Modules holding weights that the native decoder's forward never calls on ``model`` (empty when it
    calls them all): one two-token prefill of a one-row probe runner, with forward hooks on every module
    that owns parameters or buffers. A skipped module (a router, an extra norm) means the native forward is
    not the model's forward. Call it on the model as loaded (before ``quantize_actor`` rewrites its linears)
    and only for a config whose ``native_unsupported_reason`` is None."""
    from asyncrl.engine.native.decoder import DecoderRunner

    owners = [name for name, m in model.named_modules() if _holds_tensors(m)]
    called: set[str] = set()
    handles = [model.get_submodule(name).register_forward_hook(lambda m, a, o, _n=name: called.add(_n))
               for name in owners]
    try:
        probe = DecoderRunner(model, 1, 8)
        probe.prefill(0, [[0, 0]], 1)
        probe.cache.release()
    finally:
        for h in handles:
            h.remove()
    return [name for name in owners if name not in called]


def _holds_tensors(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


def fallback_reason(model: torch.nn.Module, max_len: int) -> str | None:
    """``None`` when the native decoder is exact for ``model`` (``native_unsupported_reason`` is None for its config
    at ``max_len`` and its forward calls every module that holds weights), else why the model needs the HF
    fallback."""
    from asyncrl.engine.native.decoder import native_unsupported_reason

    reason = native_unsupported_reason(model.config, max_len)
    if reason is None:
        gaps = native_gaps(model)
        reason = f"the native decoder does not call {', '.join(gaps[:4])}" if gaps else None
    return reason


def build_runner(model: torch.nn.Module, max_rows: int, max_len: int, reason: str | None) -> Any:
    """The native ``DecoderRunner`` when ``reason`` (``fallback_reason`` of the model as loaded) is ``None``,
    else ``HFRunner``; the fallback is announced once per model type."""
    from asyncrl.engine.native.decoder import DecoderRunner

    if reason is None:
        return DecoderRunner(model, max_rows, max_len)
    model_type = getattr(model.config, "model_type", "?")
    if model_type not in _ANNOUNCED:
        _ANNOUNCED.add(model_type)
        log.warning("model_type %s runs on the HF fallback path (exact, slower): %s", model_type,
                    reason.split(";")[0])
    return HFRunner(model, max_rows, max_len)


def make_runner(model: torch.nn.Module, max_rows: int, max_len: int) -> Any:
    """``build_runner`` for ``model`` as it is (no quantization in between)."""
    return build_runner(model, max_rows, max_len, fallback_reason(model, max_len))

