"""Native rollout engine throughput per format, side by side with Hugging Face ``generate``.

For each format the model is quantized once (asyncrl.quant.quantize_model) and warmed up. Beside the
native engine, the same model runs Hugging Face ``generate`` (``--hf``, default on): fp32 as loaded,
and int8 as PyTorch's dynamic int8 quantization of every Linear (``torch.ao.quantization
.quantize_dynamic``, int8 weights and per-batch int8 activations: the "same precision" a user would
otherwise reach for on CPU), both with the KV cache, sampling, and exactly --new-tokens tokens.

For each batch size B, every path generates B samples of exactly --new-tokens tokens (no stop
tokens) from short prompts, once per round, the order of the paths shuffled every round
(scripts/benchlib.py ``interleaved``, --rounds, at least 5 unless --rounds says fewer). Reported:
generated tokens/s (prefill included), the median over rounds, and ratios taken per round (so a
burst of load elsewhere moves both sides of a ratio): each format vs native fp32, and native vs HF
generate at the same precision, with min, max and spread, and the load average during the rounds.

Run: ``python scripts/bench_engine.py [--quick] [--model tiny|smollm2|PATH] [--json PATH]``.
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from protocols.values import FORMATS  # noqa: E402
from scripts.benchlib import (  # noqa: E402
    interleaved,
    load_stats,
    parser,
    print_ratio,
    print_table,
    ratio_stats,
    write_json,
)

HF_FORMATS = ("fp32", "int8")
PROMPTS = ("What is 12+30? ", "Compute 7*8 and explain. ", "The sum of 101 and 99 is ", "Q: 5-9=? A: ")


def load_model(spec: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.models import ensure_smollm2, ensure_tiny_model

    folder = {"tiny": ensure_tiny_model, "smollm2": ensure_smollm2}.get(spec, lambda: spec)()
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    return model, AutoTokenizer.from_pretrained(str(folder)), str(folder)


def run_batch(engine, tok, batch: int, new_tokens: int, tag: str) -> tuple[int, float]:
    from asyncrl.engine import GenRequest, SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, stop_token_ids=(), seed=0)
    reqs = [GenRequest(f"{tag}-{i}", tok(PROMPTS[i % len(PROMPTS)]).input_ids, params) for i in range(batch)]
    t0 = time.perf_counter()
    results = list(engine.generate(reqs))
    dt = time.perf_counter() - t0
    return sum(len(r.response_ids) for r in results), dt


def hf_model(model, fmt: str):
    """The Hugging Face model a user would run at ``fmt``: fp32 as is, int8 by dynamic quantization."""
    import torch

    m = copy.deepcopy(model).eval()
    if fmt == "fp32":
        return m
    if fmt == "int8":
        from torch.ao.quantization import quantize_dynamic

        return quantize_dynamic(m, {torch.nn.Linear}, dtype=torch.qint8)
    raise ValueError(f"no Hugging Face comparator for {fmt!r}; choose from {HF_FORMATS}")


def run_hf(model, tok, batch: int, new_tokens: int, seed: int) -> tuple[int, float]:
    """``generate`` with sampling, the KV cache and exactly ``new_tokens`` new tokens per sample."""
    import torch

    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok([PROMPTS[i % len(PROMPTS)] for i in range(batch)], return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, use_cache=True,
                             pad_token_id=tok.pad_token_id)
    dt = time.perf_counter() - t0
    return int(out.shape[0] * (out.shape[1] - enc.input_ids.shape[1])), dt


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_engine", __doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny (default), smollm2, or an HF folder")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma list (default: all)")
    p.add_argument("--batch-sizes", default=None, help="comma list (default 1,16,64; --quick 1,16)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per sample (default 128; --quick 32)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; --quick 5)")
    p.add_argument("--repeats", type=int, default=None, help=argparse_suppress())
    p.add_argument("--hf", default="fp32,int8", help="HF generate comparators, comma list of fp32,int8 "
                                                      "('' for none; default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)

    import torch

    from asyncrl.engine.native import NativeEngine

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in (args.batch_sizes or ("1,16" if args.quick else "1,16,64")).split(",")]
    new_tokens = args.new_tokens or (32 if args.quick else 128)
    rounds = args.rounds or args.repeats or 5
    formats = [f for f in args.formats.split(",") if f]
    if "fp32" not in formats:
        formats.insert(0, "fp32")  # the reference of every ratio
    hf_formats = [f for f in args.hf.split(",") if f]
    bad = [f for f in hf_formats if f not in HF_FORMATS]
    if bad:
        raise SystemExit(f"--hf: no comparator for {bad}; choose from {HF_FORMATS}")
    model, tok, folder = load_model(args.model)
    engines = {}
    for fmt in formats:
        engines[fmt] = NativeEngine(copy.deepcopy(model), quant_format=fmt, device=args.device,
                                    max_batch_size=max(batches), num_threads=None)
        run_batch(engines[fmt], tok, 2, 4, f"warm-{fmt}")
    hf = {f: hf_model(model, f) for f in hf_formats}
    for m in hf.values():
        run_hf(m, tok, 2, 4, 0)
    rows, ratios, per_round = [], {}, {}
    for batch in batches:
        paths = {}
        for fmt, engine in engines.items():
            paths[fmt] = (lambda e=engine, f=fmt, b=batch: _rate(*run_batch(e, tok, b, new_tokens, f"{f}-{b}")))
        for f, m in hf.items():
            paths[f"hf-{f}"] = (lambda m=m, b=batch: _rate(*run_hf(m, tok, b, new_tokens, b)))
        res = interleaved(paths, rounds, warmup=0, seed=batch)
        per_round[str(batch)] = res
        v = res["values"]
        load = load_stats(res["load"])
        for name in paths:
            st = ratio_stats(v[name], v["fp32"])
            row = {"path": name if name.startswith("hf-") else f"native-{name}", "batch": batch,
                   "tok_per_s": statistics.median(v[name]), "vs_native_fp32": st["ratio_median"],
                   "vs_min": st["ratio_min"], "vs_max": st["ratio_max"], "spread": st["spread"],
                   "load_avg": load["load_median"]}
            rows.append(row)
        for f in hf:
            if f in engines:
                st = ratio_stats(v[f], v[f"hf-{f}"])
                ratios[f"batch {batch}: native {f} / HF generate {f}"] = st
                print_ratio(f"batch {batch}: native {f} / HF generate {f}", st, load)
        for f in engines:
            if f != "fp32":
                st = ratio_stats(v[f], v["fp32"])
                ratios[f"batch {batch}: native {f} / native fp32"] = st
                print_ratio(f"batch {batch}: native {f} / native fp32", st, load)
    for engine in engines.values():
        engine.close()
    title = (f"generated tokens/s, model={args.model}, {new_tokens} new tokens/sample, median of {rounds} "
             f"interleaved rounds, threads={args.threads}, {args.device}")
    print_table(title, rows, ["path", "batch", "tok_per_s", "vs_native_fp32", "vs_min", "vs_max", "spread",
                              "load_avg"])
    write_json(args.json, "bench_engine", {"throughput": rows}, args, model=folder, new_tokens=new_tokens,
               threads=args.threads, rounds=rounds, device=args.device, ratios=ratios, per_round=per_round)
    return 0


def _rate(n: int, dt: float) -> float:
    return n / dt


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
