#!/usr/bin/env python
"""Decode throughput and accuracy of the quantised actors against fp32, and published bytes.

Model: a randomly initialised (seeded) Qwen2-style causal LM of 22.0M parameters with the proportions
of Qwen2-0.5B (MLP 5.5x hidden, 2 KV heads, tied embeddings): vocab 4096, hidden 512, MLP 2816,
4 layers, 8 heads (head_dim 64). lm_head and embeddings stay fp32 (the default). One thread.

Decode: a plain Hugging Face forward with a KV cache (`cache=`), one token per step, sampling from
softmax(logits) by inverse CDF with a seeded generator; the timed loop is forward + fp32
log-softmax + sampling.
All formats run side by side in the same process, in rotating order, for several rounds. Time is
the CPU time of this (single-threaded) process, so time slices lost to other processes on a shared
machine do not count; cache and memory-bandwidth contention still do. A format's time is its best
round and `speedup_vs_fp32` is best fp32 time / best format time (the median of per-round ratios is
reported too). Wall-clock tokens/s of the best round are reported beside the CPU-time figure.

Accuracy: the tokens each actor sampled while being timed are scored teacher-forced by the fp32
model; mean |delta log-prob| of those tokens and mean KL(actor || fp32) over the full vocabulary at
the generated positions.

Publication: bytes of `asyncrl.quant.publish` per format vs fp32, bytes per parameter of the
quantised linears, and the time to publish and to load a publication.

Also: the layout check behind the int8 batch-1 path (torch._int_mm at M=1 on a transposed weight view,
on a contiguous [K, N] copy, and zero-padded to M=17 as CUDA kernels require).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import copy  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from asyncrl.bench.measure import ratio_stats  # noqa: E402
from asyncrl.bench.models import QWEN2_22M, build_qwen2_22m  # noqa: E402
from asyncrl.bench.report import parser, print_table, write_json  # noqa: E402

DEFAULT_FORMATS = ("fp32", "bf16", "int8", "fp8", "nvfp4", "mxfp4")
def build_parser():
    p = parser("bench_quant", __doc__)
    p.add_argument(
        "--formats",
        nargs="+",
        default=list(DEFAULT_FORMATS),
        help="actor formats (fp32 is always included as the baseline; default: %(default)s)",
    )
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16, 64], help="default: %(default)s")
    p.add_argument(
        "--steps", type=int, default=None, help="decode steps per timed run (default 48, quick 16)"
    )
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per format (default 7, quick 5)")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens before decoding (default 16)")
    p.add_argument("--seed", type=int, default=0)
    return p


def decode(model, prompt, steps: int, gen):
    """Timed KV-cache decode. prompt: [B, P] int64. Returns ((cpu seconds, wall seconds),
    tokens [B, steps], logp of sampled tokens [B, steps], full log-probs [B, steps, V])."""
    import torch

    with torch.inference_mode():
        out = model(prompt, use_cache=True)
        cache, logits = out.cache, out.logits[:, -1]
        toks, lps, full = [], [], []
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            logp = torch.log_softmax(logits.float(), dim=-1)
            # inverse-CDF sampling (torch.multinomial costs several times more at batch 64 on CPU:
            # docs/benchmarks.md §5, kernel choices)
            cdf = logp.exp().cumsum_(dim=-1)
            u = torch.rand(cdf.shape[0], 1, generator=gen) * cdf[:, -1:]
            tok = torch.searchsorted(cdf, u).clamp_(max=cdf.shape[1] - 1)
            toks.append(tok)
            lps.append(logp.gather(1, tok))
            full.append(logp)
            out = model(tok, cache=cache, use_cache=True)
            cache, logits = out.cache, out.logits[:, -1]
        dt = (time.process_time() - c0, time.perf_counter() - t0)
    return dt, torch.cat(toks, 1), torch.cat(lps, 1), torch.stack(full, 1)


def score_against_fp32(fp32_model, prompt, toks, lp_actor, full_actor) -> tuple[float, float]:
    """Teacher-forced fp32 scoring of the actor's sampled tokens -> (mean |dlogp|, mean KL)."""
    import torch

    with torch.inference_mode():
        seq = torch.cat([prompt, toks], 1)
        logits = fp32_model(seq).logits[:, prompt.shape[1] - 1 : -1].float()
        lf = torch.log_softmax(logits, dim=-1)
        dlogp = (lp_actor - lf.gather(2, toks[:, :, None])[:, :, 0]).abs().mean().item()
        kl = (full_actor.exp() * (full_actor - lf)).sum(-1).mean().item()
    return dlogp, kl


def bench_decode(models, fmts, args, steps, rounds):
    import torch

    fp32 = models["fp32"]
    rows = []
    for b in args.batch_sizes:
        g = torch.Generator().manual_seed(args.seed + b)
        prompt = torch.randint(0, QWEN2_22M["vocab_size"], (b, args.prompt_len), generator=g)
        times = {f: [] for f in fmts}
        walls = {f: [] for f in fmts}
        acc = {}
        for r in range(rounds):
            order = fmts[r % len(fmts) :] + fmts[: r % len(fmts)]
            for f in order:
                gen = torch.Generator().manual_seed(args.seed * 1000 + r)
                (dt, wall), toks, lp, full = decode(models[f], prompt, steps, gen)
                times[f].append(dt)
                walls[f].append(wall)
                if r == 0:
                    acc[f] = score_against_fp32(fp32, prompt, toks, lp, full)
            print(
                f"  batch {b} round {r + 1}/{rounds}: "
                + " ".join(f"{f}={b * steps / times[f][-1]:.0f}tok/s" for f in fmts),
                flush=True,
            )
        for f in fmts:
            st = ratio_stats(times["fp32"], times[f])
            rows.append(
                {
                    "format": f,
                    "batch": b,
                    "tok_per_s": b * steps / min(times[f]),
                    "wall_tok_per_s": b * steps / min(walls[f]),
                    "speedup_vs_fp32": min(times["fp32"]) / min(times[f]),
                    "speedup_round_median": st["ratio_median"],
                    "speedup_round_min": st["ratio_min"],
                    "speedup_round_max": st["ratio_max"],
                    "spread": st["spread"],
                    "load_avg": os.getloadavg()[0],
                    "mean_abs_dlogp": acc[f][0],
                    "mean_kl_vs_fp32": acc[f][1],
                }
            )
    return rows


def bench_publish(base, fmts):
    from asyncrl.quant import load_published, publication_metrics, publish, quantize_model

    sd = base.state_dict()
    rows, fp32_bytes = [], None
    for f in fmts:
        t0 = time.perf_counter()
        pub = publish(sd, f, version=1)
        t_pub = time.perf_counter() - t0
        worker = quantize_model(copy.deepcopy(base), f)
        t0 = time.perf_counter()
        load_published(worker, pub)
        t_load = time.perf_counter() - t0
        m = publication_metrics(pub, state_dict=sd)
        fp32_bytes = pub.total_bytes() if f == "fp32" else fp32_bytes
        rows.append(
            {
                "format": f,
                "published_MB": pub.total_bytes() / 1e6,
                "bytes_vs_fp32": pub.total_bytes() / fp32_bytes,
                "linear_bytes_per_param": m["quant/linear_bytes_per_param"],
                "rel_error_mean": m["quant/rel_error_mean"],
                "publish_s": t_pub,
                "load_s": t_load,
            }
        )
        del worker

    return rows


def bench_int_mm_m1(reps: int):
    import torch

    def best(fn):
        for _ in range(10):
            fn()
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            ts.append((time.perf_counter() - t0) / reps * 1e6)
        return min(ts)

    g = torch.Generator().manual_seed(0)
    k, n = QWEN2_22M["hidden_size"], QWEN2_22M["intermediate_size"]
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    x = torch.randint(-127, 128, (1, k), generator=g, dtype=torch.int8)
    w_kn = w.t().contiguous()
    xf, wf = x.float(), w.float()
    pad = torch.zeros(16, k, dtype=torch.int8)
    variants = {
        "int_mm(x, W[N,K].t()) (used)": lambda: torch._int_mm(x, w.t()),
        "int_mm(x, W[K,N] contiguous)": lambda: torch._int_mm(x, w_kn),
        "int_mm(pad x to M=17, W.t())": lambda: torch._int_mm(torch.cat([x, pad]), w.t())[:1],
        "fp32 linear (reference)": lambda: torch.nn.functional.linear(xf, wf),
    }
    return [
        {"variant": name, "M": 1, "K": k, "N": n, "us_per_call": best(fn)} for name, fn in variants.items()
    ]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from asyncrl.quant import FORMATS, quantize_model

    torch.set_num_threads(1)
    bad = [f for f in args.formats if f not in FORMATS]
    if bad:
        raise SystemExit(f"unknown format(s) {bad}; choose from {FORMATS}")
    fmts = ["fp32"] + [f for f in args.formats if f != "fp32"]
    steps = args.steps or (16 if args.quick else 48)
    rounds = args.rounds or (5 if args.quick else 7)

    base = build_qwen2_22m(args.seed)
    n_params = sum(p.numel() for p in base.parameters())
    print(
        f"model: Qwen2 {QWEN2_22M} -> {n_params / 1e6:.1f}M parameters; threads={torch.get_num_threads()}"
    )
    models = {f: quantize_model(copy.deepcopy(base), f) for f in fmts}

    print(
        f"decode: batch sizes {args.batch_sizes}, {steps} steps after a {args.prompt_len}-token prompt, "
        f"{rounds} rounds"
    )
    decode_rows = bench_decode(models, fmts, args, steps, rounds)
    print_table(
        "Decode tokens per CPU-second (one thread) and accuracy vs fp32 (same process, same prompts)",
        decode_rows,
        [
            "format",
            "batch",
            "tok_per_s",
            "wall_tok_per_s",
            "speedup_vs_fp32",
            "speedup_round_median",
            "spread",
            "mean_abs_dlogp",
            "mean_kl_vs_fp32",
        ],
    )
    pub_rows = bench_publish(base, fmts)
    print_table(
        "Published bytes per format (quantise-on-send)",
        pub_rows,
        [
            "format",
            "published_MB",
            "bytes_vs_fp32",
            "linear_bytes_per_param",
            "rel_error_mean",
            "publish_s",
            "load_s",
        ],
    )
    mm_rows = bench_int_mm_m1(200 if args.quick else 1000)
    print_table(
        "int8 batch-1 layout check (torch._int_mm, one call)",
        mm_rows,
        ["variant", "M", "K", "N", "us_per_call"],
    )
    write_json(
        args.json,
        "bench_quant",
        {"decode": decode_rows, "publish": pub_rows, "int_mm_m1": mm_rows},
        args,
        model_config=QWEN2_22M,
        n_params=n_params,
        steps=steps,
        rounds=rounds,
        prompt_len=args.prompt_len,
        threads=torch.get_num_threads(),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
