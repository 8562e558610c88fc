"""What decode benchmarks measure besides tokens/s: the memory roofline, HF ``generate``, one step's kernels.

Owns: the memory roofline of a decode step (``copy_bandwidth``, ``step_weight_bytes``, ``kv_bytes``: a step
must at least read the weights its kernels read, ``lm_head`` included, and the K/V of every live row; over
the device's measured copy bandwidth that is the fastest possible step), Hugging Face ``generate``'s
tokens/s on the same prompts (``hf_generate_rate``), and the kernels one decode step of a ``NativeEngine``
launches (``step_kernels``: CUDA kernels by ``torch.profiler`` on CUDA, aten ops by a ``TorchDispatchMode``
on a CPU). Used by ``scripts/bench_engine.py`` and ``scripts/gpu_check.py``.
Never: downloads anything, or counts a step that built a runner (a capture or compilation) as "one step".
"""

from __future__ import annotations

import time
from typing import Any

from asyncrl.bench.measure import device_sync


def copy_bandwidth(device: str, nbytes: int, repeats: int = 5) -> float:
    """Bytes per second (read + write) of a ``nbytes`` device-to-device copy, best of ``repeats``."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):  # the first copy warms up
        device_sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        device_sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def _nbytes(t: Any) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def step_weight_bytes(model: Any) -> int:
    """Bytes of the tensors one decode step reads from the weights: every linear in the form its kernel
    multiplies (``lm_head`` included), norms; not the embedding, a lookup of B rows."""
    from torch import nn

    from asyncrl.quant.kernels import KERNELS
    from asyncrl.quant.linear import QuantLinear

    reads = {"bf16": ("weight",), "int_mm": ("qweight", "weight_scale"), "int_mm_compiled": ("qweight", "weight_scale"),
             "int_mm_avx2": ("qweight", "weight_scale"), "int_mm_fp32": ("_w_codes", "weight_scale"),
             "scaled_mm": ("qweight", "weight_scale"),
             "fp8_emul": ("_w_codes", "weight_scale"), "wo_fp32": ("_w_decoded",), "wo_bf16": ("_w_decoded",),
             "wo_triton": ("qweight", "weight_scale", "weight_global_scale")}
    assert set(reads) == {k for ks in KERNELS.values() for k in ks}, "a kernel without its bytes read per step"
    total = 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            tensors = [getattr(mod, n, None) for n in reads[mod.kernel]] + [mod.bias]  # nvfp4 alone has a global scale
        elif isinstance(mod, nn.Embedding):
            continue  # a lookup of B rows (a tied head is counted as lm_head)
        else:
            tensors = [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]
        total += sum(_nbytes(t) for t in tensors)
    return total


def kv_bytes(config: Any, batch: int, context: float, itemsize: int) -> float:
    """K/V bytes a decode step reads at mean context ``context`` (all layers, all rows)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * batch * context * itemsize


def roofline_tok_per_s(model: Any, batch: int, context: float, kv_itemsize: int, bandwidth: float) -> float:
    """The fastest decode a step's bytes allow: ``batch`` tokens per (weight + K/V bytes) / ``bandwidth``."""
    return batch * bandwidth / (step_weight_bytes(model) + kv_bytes(model.config, batch, context, kv_itemsize))


def hf_generate_rate(model: Any, prompts: Any, new_tokens: int, device: str) -> float:
    """Generated tokens/s of HF ``generate`` (sampling, KV cache) on ``prompts`` ([B, P] ids), ``new_tokens``
    each (``min_new_tokens`` holds it when the model samples an EOS id)."""
    import torch

    ids = prompts.to(device)
    torch.manual_seed(ids.shape[0])
    device_sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                             top_p=1.0, top_k=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             use_cache=True, pad_token_id=0)
    device_sync(device)
    return out.shape[0] * (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)


def step_kernels(engine: Any, prompt: list[int], batch: int) -> dict[str, Any]:
    """The kernels of one decode step of ``batch`` rows of ``prompt`` on ``engine`` (a ``NativeEngine``).

    Admits the rows, runs two steps (the prefill and one decode step, which builds the bucket's runner if
    it is new), counts the third, then finishes the rows. ``kernels``: CUDA kernels the profiler saw (a
    replayed graph's kernels included; memory copies and sets are ``copies``) on CUDA, aten ops dispatched
    on a CPU. ``built_runner``: the counted step built a runner (a capture or compilation; False when it
    replayed one built before, or ran eagerly).
    """
    import torch

    from asyncrl.engine import GenRequest, SamplingParams

    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=(), seed=0)
    engine.submit([GenRequest(f"kernels-{i}", list(prompt), params) for i in range(batch)])
    engine.step()  # admission and prefill
    engine.step()  # the first decode step (a new bucket is built here, not in the counted step)
    before = engine.step_stats()
    cuda = engine.device.type == "cuda"
    out: dict[str, Any] = {"counted_as": "CUDA kernels (torch.profiler)" if cuda else "aten ops (TorchDispatchMode)"}
    if cuda:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize(engine.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.step()
            torch.cuda.synchronize(engine.device)
        device_events = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
        copies = [n for n in device_events if n.startswith(("Memcpy", "Memset"))]
        out |= {"kernels": len(device_events) - len(copies), "copies": len(copies)}
    else:
        from torch.utils._python_dispatch import TorchDispatchMode

        class OpCount(TorchDispatchMode):
            count = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.count += 1
                return func(*args, **(kwargs or {}))

        with OpCount() as ops:
            engine.step()
        out["kernels"] = ops.count
    after = engine.step_stats()
    out["built_runner"] = after["builds"] > before["builds"]
    for _ in engine.generate():  # the rows run to their end; nothing is left in the engine
        pass
    return out
