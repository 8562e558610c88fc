"""Pure-torch CPU stand-ins for the few ``sgl_kernel`` functions SGLang 0.5.23 calls on a CPU without AMX.

Owns: reference implementations (torch / ctypes only) of the ``sgl_kernel`` names that SGLang's CPU code
path imports at module level when ``SGLANG_USE_CPU_ENGINE=1``. The PyPI wheel ``sglang-kernel==0.4.10`` is
a CUDA build: importing it on a machine without ``libcuda.so.1`` fails, and SGLang's CPU kernels live in a
separate ``sgl-kernel`` CPU build that is not on PyPI. ``scripts/sglang_cpu_server.py`` puts a package
named ``sgl_kernel`` that re-exports this module in front of site-packages (``PYTHONPATH``), so SGLang's own
Python code runs unchanged on this CPU; no installed file is modified.

Must never: be imported by the asyncrl engine itself (only the SGLang server process loads it), pretend to
be a GPU kernel library (every name here is a CPU function with the semantics of the call site in SGLang
0.5.23, read from that version's source), or silently accept a call it does not implement: any other
attribute raises ``AttributeError`` naming the missing kernel, so a new SGLang code path fails loudly.

Invariants: each function matches the contract of its single SGLang 0.5.23 call site (cited in its
docstring); SGLang's AMX paths stay off because ``torch.ops.sgl_kernel`` has no ops registered here
(``cpu_has_amx_support()`` is then False), so layers use their ``forward_native`` torch code.
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.4.10+asyncrl-cpu-shim"


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """Copy KV rows ``src_loc[j] -> tgt_loc[j]`` inside every KV buffer (all layers, K and V).

    Call site: ``sglang/kernels/ops/kvcache/cache_move.py`` (CPU branch of ``copy_all_layer_kv_cache``).
    ``data_ptrs: [L] int64`` base addresses of the layer buffers (one row per token slot), ``strides: [L]
    int64`` row size in bytes of each buffer, ``tgt_loc, src_loc: [N] int64`` slot indices. Rows are copied
    with ``memmove`` in order, as the triton kernel does per row (sources and targets do not overlap in
    SGLang's use: it moves live rows into freed slots).
    """
    ptrs = data_ptrs.tolist()
    row_bytes = strides.tolist()
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist(), strict=True))
    for base, stride in zip(ptrs, row_bytes, strict=True):
        for tgt, src in pairs:
            if tgt != src:
                ctypes.memmove(base + tgt * stride, base + src * stride, stride)


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write newly allocated KV slots into each request's row of the request-to-token table.

    Call site: ``sglang/srt/mem_cache/allocation.py`` ``assign_req_to_token_pool_func`` (CPU branch), the
    triton kernel ``assign_req_to_token_pool`` above it is the contract: for batch row ``i``,
    ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = out_cache_loc[o_i : o_i + n_i]``
    where ``n_i = end_offset[i] - start_offset[i]`` and ``o_i = sum(n_j for j < i)``.
    Shapes: ``req_pool_indices, start_offset, end_offset: [B]``, ``req_to_token: [R, pool_len]``,
    ``out_cache_loc: [sum(n_i)]``.
    """
    assert req_to_token.shape[1] == pool_len, (req_to_token.shape, pool_len)
    offset = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def _not_provided(name: str, why: str):
    """A kernel SGLang imports at module level on CPU but only calls on a path asyncrl never takes."""

    def kernel(*args, **kwargs):
        raise RuntimeError(
            f"sgl_kernel.{name} is not provided by asyncrl's CPU stand-in: {why}. "
            "Run that configuration on a GPU with the real sglang-kernel wheel"
        )

    kernel.__name__ = name
    kernel.__qualname__ = name
    return kernel


_SPECULATIVE = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
)
for _name in _SPECULATIVE:
    globals()[_name] = _not_provided(_name, "speculative decoding is not used by asyncrl rollouts")
build_draft_decode_metadata_cpu = _not_provided(
    "build_draft_decode_metadata_cpu", "the Intel AMX attention backend needs the sgl-kernel CPU build"
)
del _name


def __getattr__(name: str):
    raise AttributeError(
        f"sgl_kernel.{name} is not provided by asyncrl's CPU stand-in (asyncrl/engine/sglang/cpu_kernels.py); "
        "this SGLang code path needs the real sgl-kernel CPU build or a GPU"
    )
