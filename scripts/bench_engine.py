"""Native rollout engine throughput per format, side by side with Hugging Face ``generate``.

For each format the model is quantized once (asyncrl.quant.quantize_model) and warmed up. Beside the
native engine, the same model runs Hugging Face ``generate`` (``--hf``, default on): fp32 as loaded,
and int8 as PyTorch's dynamic int8 quantization (``torch.ao.quantization.quantize_dynamic``, int8
weights and per-batch int8 activations, fbgemm: what a user would otherwise reach for on CPU) of the
layers the native int8 engine quantizes, the attention and MLP projections (``lm_head`` stays fp32 on
both sides; before 2026-12-03 the comparator quantized ``lm_head`` too), both with the KV cache and
sampling.

``--head-formats`` (default int8) adds each named format once more with the output head quantized too
(``quant.lm_head``), as path ``native-FMT+head``.

Two workloads (``--workloads``, default both):

* ``fixed``: for each batch size B, every path generates B samples of exactly --new-tokens tokens
  (no stop tokens) from short prompts: the same GEMMs on both sides, continuous batching has nothing
  to win.
* ``rollout``: what a rollout worker does: 4 x B requests of math questions in the model's prompt
  format (chat template when the tokenizer has one), sampled until a stop token (the model folder's
  EOS ids, ``<|im_end|>`` for SmolLM2-Instruct) or --new-tokens. The native engine keeps B slots busy
  (continuous batching: a finished row's slot takes the next request); HF ``generate`` runs the
  requests B at a time, each call lasting until its longest row ends. Counted: response tokens up to
  and including the stop token (what training receives), per second.

Each path runs once per round, the order of the paths shuffled every round
(scripts/benchlib.py ``interleaved``, --rounds, at least 5 unless --rounds says fewer). Reported:
generated tokens/s (prefill included), the median over rounds, and ratios taken per round (so a
burst of load elsewhere moves both sides of a ratio): each format vs native fp32, and native vs HF
generate at the same precision, with min, max and spread, and the load average during the rounds.

Run: ``python scripts/bench_engine.py [--quick] [--model tiny|smollm2|PATH] [--json PATH]``.

**Model shapes on a device** (``--shapes``, the default with ``--device cuda``): random-weight models built
from the configs of Qwen2.5-0.5B, Qwen2.5-1.5B and SmolLM2-135M (nothing is downloaded; weights are drawn
on the device), batches of identical-length random prompts, exactly --new-tokens tokens per sample. Paths:
Hugging Face ``generate`` in bf16 and the native engine in every format. Reported per path: tok/s, the
ratio to HF bf16 and to native bf16 (per round), and the fraction of the memory roofline: the bytes a
decode step must read (the weights its kernels read, `lm_head` included, plus the K/V of the mean context)
over the device's copy bandwidth measured in the same run gives the fastest possible step; measured
tok/s over that bound is the fraction. ``--layers N`` keeps the first N layers (CPU smoke runs).
Run: ``python scripts/bench_engine.py --device cuda [--quick] [--shapes qwen2.5-0.5b,...]``.
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from collections import deque

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from protocols.values import FORMATS  # noqa: E402
from scripts import benchlib  # noqa: E402
from scripts.bench_engine_shapes import SHAPES  # noqa: E402

HF_FORMATS = ("fp32", "int8")
PROMPTS = ("What is 12+30? ", "Compute 7*8 and explain. ", "The sum of 101 and 99 is ", "Q: 5-9=? A: ")
ROLLOUT_QUESTIONS = ("What is 17 - 25?", "Compute 6 * 7 - 9.", "What is the sum of 48 and 75?",
                     "Is 91 a prime number? Explain briefly.", "What is 3 + 4 * 5?", "Compute -8 - 13.",
                     "What is half of 126?", "Add 19, 23 and 8.")
ROLLOUT_REQUESTS_PER_SLOT = 4
WORKLOADS = ("fixed", "rollout")


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


class RolloutPrompts:
    """The rollout workload's requests: questions in the model's own prompt format, its stop tokens."""

    def __init__(self, tok, folder: str) -> None:
        from asyncrl.controller.prompts import PromptEncoder, stop_token_ids

        enc = PromptEncoder(tok, "auto")
        self.format = enc.format
        self.ids = [enc.encode(q) for q in ROLLOUT_QUESTIONS]
        self.stops = tuple(stop_token_ids(folder, tok))
        if not self.stops:
            raise SystemExit(f"{folder}: no EOS id in its tokenizer, config.json or generation_config.json; the "
                             "rollout workload needs a stop token (use --workloads fixed)")

    def prompt(self, i: int) -> list[int]:
        return self.ids[i % len(self.ids)]


def useful_tokens(row: list[int], stops: tuple[int, ...]) -> int:
    """Response tokens up to and including the first stop token (all of them when none is sampled)."""
    for i, t in enumerate(row):
        if t in stops:
            return i + 1
    return len(row)


def run_rollout_native(engine, rp: RolloutPrompts, batch: int, new_tokens: int, tag: str) -> tuple[int, float]:
    from asyncrl.engine import GenRequest, SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, stop_token_ids=rp.stops, seed=0)
    n = ROLLOUT_REQUESTS_PER_SLOT * batch
    pending = deque(GenRequest(f"{tag}-{i}", rp.prompt(i), params) for i in range(n))
    live = total = 0
    t0 = time.perf_counter()
    while pending or live:  # at most `batch` requests in the engine: B slots, refilled as rows finish
        while pending and live < batch:
            engine.submit([pending.popleft()])
            live += 1
        for r in engine.step():
            total += len(r.response_ids)
            live -= 1
    return total, time.perf_counter() - t0


def run_rollout_hf(model, tok, rp: RolloutPrompts, batch: int, new_tokens: int, seed: int) -> tuple[int, float]:
    """The same requests through ``generate``, ``batch`` at a time, left-padded, stopping at the stop tokens."""
    import torch

    pad = tok.pad_token_id if tok.pad_token_id is not None else rp.stops[0]
    n = ROLLOUT_REQUESTS_PER_SLOT * batch
    torch.manual_seed(seed)
    total, t0 = 0, time.perf_counter()
    for lo in range(0, n, batch):
        prompts = [rp.prompt(i) for i in range(lo, min(n, lo + batch))]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                                 top_k=0, max_new_tokens=new_tokens, eos_token_id=list(rp.stops),
                                 pad_token_id=pad, use_cache=True)
        total += sum(useful_tokens(row, rp.stops) for row in out[:, width:].tolist())
    return total, time.perf_counter() - t0


def runners(workload: str, tok, rp: RolloutPrompts | None, new_tokens: int):
    """(native(engine, batch, tag), hf(model, batch)) -> (tokens, seconds), for one workload."""
    if workload == "fixed":
        def native(e, b, tag):
            return run_batch(e, tok, b, new_tokens, tag)

        def hf(m, b):
            return run_hf(m, tok, b, new_tokens, b)
    else:
        assert rp is not None

        def native(e, b, tag):
            return run_rollout_native(e, rp, b, new_tokens, f"r-{tag}")

        def hf(m, b):
            return run_rollout_hf(m, tok, rp, b, new_tokens, b)
    return native, hf


def hf_model(model, fmt: str):
    """The Hugging Face model a user would run at ``fmt``: fp32 as is, int8 by dynamic quantization."""
    import torch

    m = copy.deepcopy(model).eval()
    if fmt == "fp32":
        return m
    if fmt == "int8":
        from torch.ao.quantization import quantize_dynamic

        from asyncrl.quant.model import DEFAULT_KEEP_FULL_PRECISION, is_target_linear

        # the layers the native int8 engine quantizes (attention and MLP projections; lm_head stays fp32)
        names = {n for n, mod in m.named_modules()
                 if isinstance(mod, torch.nn.Linear) and is_target_linear(n, DEFAULT_KEEP_FULL_PRECISION)}
        return quantize_dynamic(m, names, dtype=torch.qint8)
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
    p = benchlib.parser("bench_engine", __doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny (default), smollm2, or an HF folder")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma list (default: all)")
    p.add_argument("--head-formats", default="int8",
                   help="quantized formats also run with the output head quantized (quant.lm_head), as path "
                        "FMT+head; '' for none (default int8)")
    p.add_argument("--batch-sizes", default=None, help="comma list (default 1,16,64; --quick 1,16; --shapes on cuda: 32,128, --quick 128; on cpu 1,4)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per sample (default 128; --quick 32; --shapes on cpu 32)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; --quick 5; --shapes --quick 2)")
    p.add_argument("--repeats", type=int, default=None, help=argparse_suppress())
    p.add_argument("--hf", default=None, help="HF generate comparators, comma list of fp32,int8 (--shapes: bf16,fp32) "
                                               "('' for none; default: fp32,int8; --shapes: bf16)")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help="comma list of fixed (exactly N tokens per sample) and rollout (4 x batch requests until "
                        "a stop token, continuous batching vs batches of generate); default: %(default)s")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--shapes", default=None,
                   help=f"comma list of {', '.join(SHAPES)}: random-weight models of these configs instead of "
                        "--model (default: all on cuda, none on cpu)")
    p.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (--shapes only)")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per sample (--shapes only)")
    args = p.parse_args(argv)
    if args.shapes is None:
        args.shapes = ",".join(SHAPES) if args.device.startswith("cuda") else ""
    if args.hf is None:
        args.hf = "bf16" if args.shapes else "fp32,int8"
    if args.shapes:
        from scripts.bench_engine_shapes import run_shapes

        return run_shapes(args)

    import torch

    from asyncrl.engine.native.engine import NativeEngine

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
    for fmt in [f for f in args.head_formats.split(",") if f]:
        if fmt == "fp32":
            raise SystemExit("--head-formats: fp32 has no head to quantize; name quantized formats (e.g. int8)")
        engines[f"{fmt}+head"] = NativeEngine(copy.deepcopy(model), quant_format=fmt, device=args.device,
                                              max_batch_size=max(batches), num_threads=None, quantize_head=True)
        run_batch(engines[f"{fmt}+head"], tok, 2, 4, f"warm-{fmt}+head")
    hf = {f: hf_model(model, f) for f in hf_formats}
    for m in hf.values():
        run_hf(m, tok, 2, 4, 0)
    workloads = [w for w in args.workloads.split(",") if w]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        raise SystemExit(f"--workloads: unknown {bad}; choose from {WORKLOADS}")
    rp = RolloutPrompts(tok, folder) if "rollout" in workloads else None
    rows, ratios, per_round = [], {}, {}
    for workload in workloads:
        native, hf_run = runners(workload, tok, rp, new_tokens)
        for batch in batches:
            paths = {fmt: (lambda e=engine, f=fmt, b=batch, run=native: run(e, b, f"{f}-{b}"))
                     for fmt, engine in engines.items()}
            paths |= {f"hf-{f}": (lambda m=m, b=batch, run=hf_run: run(m, b)) for f, m in hf.items()}
            counts: dict[str, list[int]] = {name: [] for name in paths}
            paths = {name: (lambda fn=fn, c=counts[name]: _rate(*_counted(c, fn()))) for name, fn in paths.items()}
            res = benchlib.interleaved(paths, rounds, warmup=0, seed=batch)
            label = f"{workload} batch {batch}" if workload != "fixed" else f"batch {batch}"
            per_round[label] = res
            v = res["values"]
            load = benchlib.load_average_stats(res["load"])
            for name in paths:
                st = benchlib.ratio_stats(v[name], v["fp32"])
                row = {"workload": workload, "path": name if name.startswith("hf-") else f"native-{name}",
                       "batch": batch, "tok_per_s": statistics.median(v[name]), "vs_native_fp32": st["ratio_median"],
                       "vs_min": st["ratio_min"], "vs_max": st["ratio_max"], "spread": st["spread"],
                       "load_avg": load["load_median"],
                       "tokens_per_request": statistics.median(counts[name]) / (
                           batch * (ROLLOUT_REQUESTS_PER_SLOT if workload == "rollout" else 1))}
                rows.append(row)
            for f in hf:
                if f in engines:
                    st = benchlib.ratio_stats(v[f], v[f"hf-{f}"])
                    ratios[f"{label}: native {f} / HF generate {f}"] = st
                    benchlib.print_ratio(f"{label}: native {f} / HF generate {f}", st, load)
            for f in engines:
                if f != "fp32":
                    st = benchlib.ratio_stats(v[f], v["fp32"])
                    ratios[f"{label}: native {f} / native fp32"] = st
                    benchlib.print_ratio(f"{label}: native {f} / native fp32", st, load)
    for engine in engines.values():
        engine.close()
    title = (f"generated tokens/s, model={args.model}, {new_tokens} new tokens/sample, median of {rounds} "
             f"interleaved rounds, threads={args.threads}, {args.device}")
    benchlib.print_table(title, rows, ["workload", "path", "batch", "tok_per_s", "tokens_per_request", "vs_native_fp32", "vs_min", "vs_max", "spread",
                              "load_avg"])
    benchlib.write_json(args.json, "bench_engine", {"throughput": rows}, args, model=folder, new_tokens=new_tokens,
               threads=args.threads, rounds=rounds, device=args.device, ratios=ratios, per_round=per_round,
               workloads=workloads, rollout_prompt_format=rp.format if rp else None,
               rollout_requests_per_slot=ROLLOUT_REQUESTS_PER_SLOT)
    return 0


def _rate(n: int, dt: float) -> float:
    return n / dt


def _counted(into: list[int], result: tuple[int, float]) -> tuple[int, float]:
    """Record a run's token count (tokens per request is a column) and pass the result on."""
    into.append(result[0])
    return result


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
