"""``bench_engine.py --shapes``: the native engine in every format against Hugging Face ``generate`` in bf16,
on random-weight models of real shapes, on any device (the GPU benchmark of the decode path).

Owns: the model configs (`SHAPES`: Qwen2.5-0.5B, Qwen2.5-1.5B and SmolLM2-135M, as published on the Hub;
nothing is downloaded, weights are drawn on the device), the decode roofline and the ``shapes`` table of
bench_engine.json.

Roofline: a decode step must at least read the weights its kernels read (every linear in the form its
kernel multiplies, ``lm_head`` included, norms; not the embedding, a lookup of B rows) and the K/V of
every live row up to its position. Over the device's copy bandwidth (read + write bytes per second of a
large device-to-device copy, measured in the same run) that is the fastest possible step, so
``roofline_tok_per_s = B / (step_bytes / bandwidth)`` and ``roofline_frac`` = measured tok/s over it.
The measured tok/s includes prefill, so the fraction is a lower bound. K/V bytes are taken at the mean
context (prompt + half the new tokens); the native cache is fp32 (it follows the activations), HF's bf16.

Must never: download anything, or leave engines running (each is closed before the next shape).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections import Counter
from typing import Any

from asyncrl.engine.sglang.weights import FULL_PRECISION_PUBLICATIONS
from scripts import benchlib

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-0.5b": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                                   rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "qwen2.5-1.5b": ("qwen2", dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                                   rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "smollm2-135m": ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                                   rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)),
}
HF_SHAPE_FORMATS = FULL_PRECISION_PUBLICATIONS  # the HF comparators run unquantized


def build_model(shape: str, device: str, *, layers: int | None = None, seed: int = 0):
    """A random-weight fp32 causal LM of ``shape``'s config, built on ``device``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if shape not in SHAPES:
        raise SystemExit(f"--shapes: unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    kind, kw = SHAPES[shape]
    kw = dict(kw)
    if layers:
        kw["num_hidden_layers"] = min(layers, kw["num_hidden_layers"])
    cfg, cls = (Qwen2Config, Qwen2ForCausalLM) if kind == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(cfg(**kw)).eval()
    model.generation_config.eos_token_id = None  # random weights: exactly --new-tokens tokens
    model.generation_config.pad_token_id = 0
    return model


def copy_bandwidth(device: str, nbytes: int, repeats: int = 5) -> float:
    """Bytes per second (read + write) of a ``nbytes`` device-to-device copy, best of ``repeats``."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):  # the first copy warms up
        benchlib.device_sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        benchlib.device_sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def step_weight_bytes(model) -> int:
    """Bytes of the tensors one decode step reads from the weights (module docstring)."""
    from torch import nn

    from asyncrl.quant.kernels import KERNELS
    from asyncrl.quant.linear import QuantLinear

    reads = {"bf16": ("weight",), "int_mm": ("qweight", "weight_scale"), "int_mm_compiled": ("qweight", "weight_scale"),
             "int_mm_fp32": ("_w_codes", "weight_scale"), "scaled_mm": ("qweight", "weight_scale"),
             "fp8_emul": ("_w_codes", "weight_scale"), "wo_fp32": ("_w_decoded",), "wo_bf16": ("_w_decoded",)}
    assert set(reads) == {k for ks in KERNELS.values() for k in ks}, "a kernel without its bytes read per step"
    total = 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            tensors = [getattr(mod, n) for n in reads[mod.kernel]] + [mod.bias]
        elif isinstance(mod, nn.Embedding):
            continue  # a lookup of B rows (a tied head is counted as lm_head)
        else:
            tensors = [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]
        total += sum(_nbytes(t) for t in tensors)
    return total


def kv_bytes(config, batch: int, context: float, itemsize: int) -> float:
    """K/V bytes a decode step reads at mean context ``context`` (all layers, all rows)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * batch * context * itemsize


def kernel_counts(model) -> str:
    from asyncrl.quant.linear import QuantLinear

    c = Counter(m.kernel for m in model.modules() if isinstance(m, QuantLinear))
    return ",".join(f"{k}:{n}" for k, n in sorted(c.items())) or "nn.Linear"


def native_rate(engine, prompts, new_tokens: int, tag: str, device: str) -> float:
    """Generated tokens/s of the native engine on ``prompts`` ([B, P] ids), exactly ``new_tokens`` each."""
    from asyncrl.engine import GenRequest, SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, stop_token_ids=(), seed=0)
    reqs = [GenRequest(f"{tag}-{i}", row.tolist(), params) for i, row in enumerate(prompts)]
    benchlib.device_sync(device)
    t0 = time.perf_counter()
    out = list(engine.generate(reqs))
    benchlib.device_sync(device)
    return sum(len(r.response_ids) for r in out) / (time.perf_counter() - t0)


def hf_rate(model, prompts, new_tokens: int, device: str) -> float:
    """Generated tokens/s of HF ``generate`` (sampling, KV cache) on ``prompts``, ``new_tokens`` each."""
    import torch

    ids = prompts.to(device)
    torch.manual_seed(ids.shape[0])
    benchlib.device_sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                             top_p=1.0, top_k=0, max_new_tokens=new_tokens, use_cache=True, pad_token_id=0)
    benchlib.device_sync(device)
    return out.shape[0] * (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)


def run_shapes(args) -> int:
    import torch

    from asyncrl.engine.native.engine import NativeEngine
    from protocols.values import FORMATS

    torch.set_num_threads(args.threads)
    device = args.device
    cuda = device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible; run this on a GPU machine or use --device cpu")
    batches = [int(b) for b in (args.batch_sizes or ("128" if args.quick else "32,128") if cuda
                                else (args.batch_sizes or "1,4")).split(",")]
    new_tokens = args.new_tokens or (32 if args.quick or not cuda else 128)
    rounds = args.rounds or args.repeats or (2 if args.quick else 5)
    formats = [f for f in args.formats.split(",") if f]
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise SystemExit(f"--formats: unknown {bad}; choose from {FORMATS}")
    if "bf16" not in formats:
        formats.insert(0, "bf16")  # the reference of the native ratios
    hf_formats = [f for f in args.hf.split(",") if f]
    bad = [f for f in hf_formats if f not in HF_SHAPE_FORMATS]
    if bad:
        raise SystemExit(f"--hf: no comparator {bad} with --shapes; choose from {HF_SHAPE_FORMATS}")
    bandwidth = copy_bandwidth(device, (1 << 30) if cuda else (64 << 20))
    print(f"device copy bandwidth: {bandwidth / 1e9:.1f} GB/s (read + write)")
    rows: list[dict[str, Any]] = []
    ratios: dict[str, dict[str, float]] = {}
    per_round: dict[str, Any] = {}
    for shape in [s for s in args.shapes.split(",") if s]:
        t_build = time.perf_counter()
        model = build_model(shape, device, layers=args.layers)
        cfg = model.config
        params = sum(p.numel() for p in model.parameters())
        actors, engines = {}, {}
        for fmt in formats:
            actors[fmt] = copy.deepcopy(model)  # quantized in place by the engine
            engines[fmt] = NativeEngine(actors[fmt], quant_format=fmt, device=device, max_batch_size=max(batches),
                                        num_threads=None)
        hf = {f: copy.deepcopy(model).to(torch.bfloat16 if f == "bf16" else torch.float32) for f in hf_formats}
        del model
        gen = torch.Generator().manual_seed(1)
        prompts = torch.randint(0, cfg.vocab_size, (max(batches), args.prompt_len), generator=gen)

        for fmt, engine in engines.items():  # warm-up: kernels, allocator, caches
            native_rate(engine, prompts[:2], 4, f"warm-{fmt}", device)
        for m in hf.values():
            hf_rate(m, prompts[:2], 4, device)
        build_s = time.perf_counter() - t_build
        step_bytes = {f"native-{f}": step_weight_bytes(a) for f, a in actors.items()}
        step_bytes |= {f"hf-{f}": step_weight_bytes(m) for f, m in hf.items()}
        kv_item = {f"native-{f}": 4 for f in actors} | {f"hf-{f}": 2 if f == "bf16" else 4 for f in hf}
        for batch in batches:
            rows_in = prompts[:batch]
            paths = {f"native-{f}": (lambda e=e, tag=f"{shape}-{f}-{batch}", p=rows_in:
                                     native_rate(e, p, new_tokens, tag, device)) for f, e in engines.items()}
            paths |= {f"hf-{f}": (lambda m=m, p=rows_in: hf_rate(m, p, new_tokens, device)) for f, m in hf.items()}
            res = benchlib.interleaved(paths, rounds, warmup=0, seed=batch)
            label = f"{shape} batch {batch}"
            per_round[label] = res
            v = res["values"]
            load = benchlib.load_average_stats(res["load"])
            context = args.prompt_len + new_tokens / 2
            for name in paths:
                total = step_bytes[name] + kv_bytes(cfg, batch, context, kv_item[name])
                roof = batch * bandwidth / total
                row: dict[str, Any] = {"shape": shape, "path": name, "batch": batch,
                                       "tok_per_s": statistics.median(v[name]),
                                       "vs_native_bf16": benchlib.ratio_stats(v[name], v["native-bf16"])["ratio_median"],
                                       "step_MB": total / 1e6, "roofline_tok_per_s": roof,
                                       "roofline_frac": statistics.median(v[name]) / roof,
                                       "spread": benchlib.ratio_stats(v[name], v["native-bf16"])["spread"],
                                       "kernels": kernel_counts(actors[name[7:]]) if name.startswith("native-")
                                       else "hf", "load_avg": load["load_median"]}
                if "bf16" in hf:
                    row["vs_hf_bf16"] = benchlib.ratio_stats(v[name], v["hf-bf16"])["ratio_median"]
                rows.append(row)
                for ref in ("hf-bf16", "native-bf16"):
                    if ref in v and name != ref:
                        st = benchlib.ratio_stats(v[name], v[ref])
                        ratios[f"{label}: {name} / {ref}"] = st
                        benchlib.print_ratio(f"{label}: {name} / {ref}", st, load)
        for engine in engines.values():
            engine.close()
        print(f"{shape}: {params / 1e6:.0f}M parameters, {cfg.num_hidden_layers} layers, built and warmed up in "
              f"{build_s:.0f} s")
        del actors, engines, hf
        if cuda:
            torch.cuda.empty_cache()
    title = (f"generated tokens/s, random-weight shapes, prompt {args.prompt_len} + {new_tokens} new tokens/sample, "
             f"median of {rounds} interleaved rounds, {device}, copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    cols = ["shape", "path", "batch", "tok_per_s", "vs_hf_bf16", "vs_native_bf16", "roofline_frac", "step_MB",
            "spread", "kernels"]
    benchlib.print_table(title, rows, cols)
    env = {"torch": torch.__version__}
    if cuda:
        env |= {"gpu": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
                "cuda": torch.version.cuda}
    benchlib.write_json(args.json, "bench_engine", {"shapes": rows}, args, device=device, new_tokens=new_tokens,
               prompt_len=args.prompt_len, rounds=rounds, layers=args.layers, copy_bandwidth_Bps=bandwidth,
               ratios=ratios, per_round=per_round, env=env, shapes=args.shapes.split(","))
    return 0
