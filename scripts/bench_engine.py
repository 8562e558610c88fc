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
(``asyncrl.bench.measure.interleaved``, --rounds, at least 5 unless --rounds says fewer). Reported:
generated tokens/s (prefill included), the median over rounds, and ratios taken per round (so a
burst of load elsewhere moves both sides of a ratio): each format vs native fp32, and native vs HF
generate at the same precision, with min, max and spread, and the load average during the rounds.

Run: ``python scripts/bench_engine.py [--quick] [--model tiny|smollm2|PATH] [--json PATH]``.

**Nothing is built inside a timed round.** Where a native engine runs its decode steps as (batch, span)
buckets (CUDA graphs, the default on a GPU; ``--compile-step BACKEND``, a ``torch.compile``d step), the
first step of a bucket captures or compiles its runner, and a growth of the K/V cache drops them all. So
before its rounds every native engine first sizes its K/V cache with the longest request the rounds make
(the cache never shrinks, so nothing reallocates later), then runs each timed path once untimed: every
runner the rounds replay exists before them. The runners built and the K/V reallocations made inside
timed rounds are counted (``NativeEngine.step_stats``) and reported per row (``timed_builds``,
``valid``) and in total (``builds_in_timed_rounds``); a run where that total is not 0 says so on stderr
and exits with status 1 (the JSON is still written, its rows marked ``valid: false``).

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
import statistics
import sys
import time
from collections import deque
from typing import Any

from asyncrl.bench.decode import copy_bandwidth, hf_generate_rate, kv_bytes, step_weight_bytes
from asyncrl.bench.measure import device_sync, interleaved, load_average_stats, print_ratio, ratio_stats
from asyncrl.bench.models import SHAPES, RolloutPrompts, build_shape, kernel_counts, load_model
from asyncrl.bench.report import comma_list, parser, print_table, write_json
from asyncrl.engine.sglang.weights import FULL_PRECISION_PUBLICATIONS
from protocols.values import FORMATS

HF_FORMATS = ("fp32", "int8")
PROMPTS = ("What is 12+30? ", "Compute 7*8 and explain. ", "The sum of 101 and 99 is ", "Q: 5-9=? A: ")
ROLLOUT_REQUESTS_PER_SLOT = 4
WORKLOADS = ("fixed", "rollout")


def run_batch(engine, tok, batch: int, new_tokens: int, tag: str) -> tuple[int, float]:
    from asyncrl.engine import GenRequest, SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, stop_token_ids=(), seed=0)
    reqs = [GenRequest(f"{tag}-{i}", tok(PROMPTS[i % len(PROMPTS)]).input_ids, params) for i in range(batch)]
    t0 = time.perf_counter()
    results = list(engine.generate(reqs))
    dt = time.perf_counter() - t0
    return sum(len(r.response_ids) for r in results), dt


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


class BuildWatch:
    """Runners built (CUDA graph captures, step compilations) and K/V reallocations inside timed runs.

    ``watch(key, engine, fn)`` wraps one timed path: ``NativeEngine.step_stats`` before and after each call,
    the differences summed under ``key``. Both must stay 0: a build inside a round times a capture or a
    compilation, not a decode.
    """

    def __init__(self) -> None:
        self.builds: dict[str, int] = {}
        self.kv_allocations: dict[str, int] = {}

    def watch(self, key: str, engine, fn):
        self.builds.setdefault(key, 0)
        self.kv_allocations.setdefault(key, 0)

        def run():
            before = engine.step_stats()
            value = fn()
            after = engine.step_stats()
            self.builds[key] += after["builds"] - before["builds"]
            self.kv_allocations[key] += after["kv_allocations"] - before["kv_allocations"]
            return value
        return run

    def row(self, key: str) -> dict[str, Any]:
        """The columns of a native path's row: ``timed_builds``, ``timed_kv_allocations``, ``valid``."""
        return {"timed_builds": self.builds[key], "timed_kv_allocations": self.kv_allocations[key],
                "valid": self.builds[key] == 0}

    def total(self) -> int:
        return sum(self.builds.values())

    def report(self) -> int:
        """Say on stderr which paths built runners inside timed rounds; the exit status (0 when none)."""
        bad = {k: n for k, n in self.builds.items() if n}
        if not bad:
            return 0
        print(f"bench_engine: {sum(bad.values())} decode-step runners (CUDA graph captures or step compilations) "
              f"were built inside timed rounds, so those rounds timed them: {bad}; their rows are marked "
              "valid=false", file=sys.stderr)
        return 1


def size_kv_cache(engine, prompt: list[int], new_tokens: int) -> None:
    """Grow ``engine``'s K/V cache to what its longest timed request needs (``prompt`` + ``new_tokens``
    positions) before anything is built on it: the cache never shrinks, so later runs reallocate nothing
    and no runner built after this is dropped."""
    from asyncrl.engine import GenRequest, SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, stop_token_ids=(), seed=0)
    list(engine.generate([GenRequest("size-kv-cache", list(prompt), params)]))


def engine_options(args) -> dict[str, Any]:
    """``NativeEngine`` keywords of ``--cuda-graphs`` and ``--compile-step``. The script builds the buckets it
    times itself, on a K/V cache sized to its longest request (``size_kv_cache``), so the engine's own
    ``prewarm`` (every bucket up to ``max_seq_len``) is off."""
    return {"cuda_graphs": args.cuda_graphs, "compile_step": args.compile_step or "false", "prewarm": "false"}


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_engine", __doc__)
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
    p.add_argument("--cuda-graphs", default="auto", help="native engines: auto (on for CUDA), true or false")
    p.add_argument("--compile-step", default="auto",
                   help="native engines: torch.compile the decode step with this backend (inductor, aot_eager, "
                        "eager); auto (default): the engine's default, inductor on CUDA and none on a CPU; "
                        "false or '' for none")
    args = p.parse_args(argv)
    if args.shapes is None:
        args.shapes = ",".join(SHAPES) if args.device.startswith("cuda") else ""
    if args.hf is None:
        args.hf = "bf16" if args.shapes else "fp32,int8"
    if args.shapes:
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
    hf_formats = comma_list(args.hf, "--hf", HF_FORMATS)
    model, tok, folder = load_model(args.model)
    engines = {}
    for fmt in formats:
        engines[fmt] = NativeEngine(copy.deepcopy(model), quant_format=fmt, device=args.device,
                                    max_batch_size=max(batches), num_threads=None, **engine_options(args))
        run_batch(engines[fmt], tok, 2, 4, f"warm-{fmt}")
    for fmt in [f for f in args.head_formats.split(",") if f]:
        if fmt == "fp32":
            raise SystemExit("--head-formats: fp32 has no head to quantize; name quantized formats (e.g. int8)")
        engines[f"{fmt}+head"] = NativeEngine(copy.deepcopy(model), quant_format=fmt, device=args.device,
                                              max_batch_size=max(batches), num_threads=None, quantize_head=True,
                                              **engine_options(args))
        run_batch(engines[f"{fmt}+head"], tok, 2, 4, f"warm-{fmt}+head")
    hf = {f: hf_model(model, f) for f in hf_formats}
    for m in hf.values():
        run_hf(m, tok, 2, 4, 0)
    workloads = comma_list(args.workloads, "--workloads", WORKLOADS)
    rp = RolloutPrompts(tok, folder) if "rollout" in workloads else None
    longest = max([tok(x).input_ids for x in PROMPTS] + (rp.ids if rp else []), key=len)
    for engine in engines.values():
        size_kv_cache(engine, longest, new_tokens)
    rows, ratios, per_round = [], {}, {}
    watch = BuildWatch()
    for workload in workloads:
        native, hf_run = runners(workload, tok, rp, new_tokens)
        for batch in batches:
            label = f"{workload} batch {batch}" if workload != "fixed" else f"batch {batch}"
            paths = {fmt: (lambda e=engine, f=fmt, b=batch, run=native: run(e, b, f"{f}-{b}"))
                     for fmt, engine in engines.items()}
            for fmt, fn in paths.items():  # untimed: every runner the rounds replay is built here
                if engines[fmt].step_stats()["bucketed"]:
                    fn()
            paths = {fmt: watch.watch(f"{label}: {fmt}", engines[fmt], fn) for fmt, fn in paths.items()}
            paths |= {f"hf-{f}": (lambda m=m, b=batch, run=hf_run: run(m, b)) for f, m in hf.items()}
            counts: dict[str, list[int]] = {name: [] for name in paths}
            paths = {name: (lambda fn=fn, c=counts[name]: _rate(*_counted(c, fn()))) for name, fn in paths.items()}
            res = interleaved(paths, rounds, warmup=0, seed=batch)
            per_round[label] = res
            v = res["values"]
            load = load_average_stats(res["load"])
            for name in paths:
                st = ratio_stats(v[name], v["fp32"])
                row = {"workload": workload, "path": name if name.startswith("hf-") else f"native-{name}",
                       "batch": batch, "tok_per_s": statistics.median(v[name]), "vs_native_fp32": st["ratio_median"],
                       "vs_min": st["ratio_min"], "vs_max": st["ratio_max"], "spread": st["spread"],
                       "load_avg": load["load_median"],
                       "tokens_per_request": statistics.median(counts[name]) / (
                           batch * (ROLLOUT_REQUESTS_PER_SLOT if workload == "rollout" else 1))}
                if name in engines:
                    row |= watch.row(f"{label}: {name}")
                rows.append(row)
            for f in hf:
                if f in engines:
                    st = ratio_stats(v[f], v[f"hf-{f}"])
                    ratios[f"{label}: native {f} / HF generate {f}"] = st
                    print_ratio(f"{label}: native {f} / HF generate {f}", st, load)
            for f in engines:
                if f != "fp32":
                    st = ratio_stats(v[f], v["fp32"])
                    ratios[f"{label}: native {f} / native fp32"] = st
                    print_ratio(f"{label}: native {f} / native fp32", st, load)
    step_stats = {f: e.step_stats() for f, e in engines.items()}
    for engine in engines.values():
        engine.close()
    title = (f"generated tokens/s, model={args.model}, {new_tokens} new tokens/sample, median of {rounds} "
             f"interleaved rounds, threads={args.threads}, {args.device}")
    print_table(title, rows, ["workload", "path", "batch", "tok_per_s", "tokens_per_request", "vs_native_fp32", "vs_min", "vs_max", "spread",
                              "load_avg", "timed_builds"])
    write_json(args.json, "bench_engine", {"throughput": rows}, args, model=folder, new_tokens=new_tokens,
               threads=args.threads, rounds=rounds, device=args.device, ratios=ratios, per_round=per_round,
               workloads=workloads, rollout_prompt_format=rp.format if rp else None,
               rollout_requests_per_slot=ROLLOUT_REQUESTS_PER_SLOT, builds_in_timed_rounds=watch.total(),
               step_stats=step_stats)
    return watch.report()


def _rate(n: int, dt: float) -> float:
    return n / dt


def _counted(into: list[int], result: tuple[int, float]) -> tuple[int, float]:
    """Record a run's token count (tokens per request is a column) and pass the result on."""
    into.append(result[0])
    return result


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


# ------------------------------------------------------------ --shapes: random-weight Hub shapes on a device
# Roofline: a decode step must at least read the weights its kernels read (every linear in the form its kernel
# multiplies, ``lm_head`` included, norms; not the embedding, a lookup of B rows) and the K/V of every live row
# up to its position. Over the device's copy bandwidth (read + write bytes per second of a large
# device-to-device copy, measured in the same run) that is the fastest possible step, so
# ``roofline_tok_per_s = B / (step_bytes / bandwidth)`` and ``roofline_frac`` = measured tok/s over it. The
# measured tok/s includes prefill, so the fraction is a lower bound. K/V bytes are taken at the mean context
# (prompt + half the new tokens); the native cache is fp32 (it follows the activations), HF's bf16. Each
# shape's engines are closed before the next shape is built.
HF_SHAPE_FORMATS = FULL_PRECISION_PUBLICATIONS  # the HF comparators run unquantized


def native_rate(engine, prompts, new_tokens: int, tag: str, device: str) -> float:
    """Generated tokens/s of the native engine on ``prompts`` ([B, P] ids), exactly ``new_tokens`` each."""
    from asyncrl.engine import GenRequest, SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, stop_token_ids=(), seed=0)
    reqs = [GenRequest(f"{tag}-{i}", row.tolist(), params) for i, row in enumerate(prompts)]
    device_sync(device)
    t0 = time.perf_counter()
    out = list(engine.generate(reqs))
    device_sync(device)
    return sum(len(r.response_ids) for r in out) / (time.perf_counter() - t0)


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
    formats = comma_list(args.formats, "--formats", FORMATS)
    if "bf16" not in formats:
        formats.insert(0, "bf16")  # the reference of the native ratios
    hf_formats = comma_list(args.hf, "--hf (with --shapes)", HF_SHAPE_FORMATS)
    bandwidth = copy_bandwidth(device, (1 << 30) if cuda else (64 << 20))
    print(f"device copy bandwidth: {bandwidth / 1e9:.1f} GB/s (read + write)")
    rows: list[dict[str, Any]] = []
    ratios: dict[str, dict[str, float]] = {}
    per_round: dict[str, Any] = {}
    step_stats: dict[str, Any] = {}
    watch = BuildWatch()
    for shape in [s for s in args.shapes.split(",") if s]:
        t_build = time.perf_counter()
        model = build_shape(shape, device, layers=args.layers)
        cfg = model.config
        params = sum(p.numel() for p in model.parameters())
        actors, engines = {}, {}
        for fmt in formats:
            actors[fmt] = copy.deepcopy(model)  # quantized in place by the engine
            engines[fmt] = NativeEngine(actors[fmt], quant_format=fmt, device=device, max_batch_size=max(batches),
                                        num_threads=None, **engine_options(args))
        hf = {f: copy.deepcopy(model).to(torch.bfloat16 if f == "bf16" else torch.float32) for f in hf_formats}
        del model
        gen = torch.Generator().manual_seed(1)
        prompts = torch.randint(0, cfg.vocab_size, (max(batches), args.prompt_len), generator=gen)

        for fmt, engine in engines.items():  # warm-up: kernels, allocator, caches; the K/V cache at its final size
            native_rate(engine, prompts[:2], 4, f"warm-{fmt}", device)
            size_kv_cache(engine, prompts[0].tolist(), new_tokens)
        for m in hf.values():
            hf_generate_rate(m, prompts[:2], 4, device)
        build_s = time.perf_counter() - t_build
        step_bytes = {f"native-{f}": step_weight_bytes(a) for f, a in actors.items()}
        step_bytes |= {f"hf-{f}": step_weight_bytes(m) for f, m in hf.items()}
        kv_item = {f"native-{f}": 4 for f in actors} | {f"hf-{f}": 2 if f == "bf16" else 4 for f in hf}
        for batch in batches:
            rows_in = prompts[:batch]
            paths = {f"native-{f}": (lambda e=e, tag=f"{shape}-{f}-{batch}", p=rows_in:
                                     native_rate(e, p, new_tokens, tag, device)) for f, e in engines.items()}
            label = f"{shape} batch {batch}"
            for name, fn in paths.items():  # untimed: every runner the rounds replay is built here
                if engines[name[7:]].step_stats()["bucketed"]:
                    fn()
            paths = {name: watch.watch(f"{label}: {name}", engines[name[7:]], fn) for name, fn in paths.items()}
            paths |= {f"hf-{f}": (lambda m=m, p=rows_in: hf_generate_rate(m, p, new_tokens, device)) for f, m in hf.items()}
            res = interleaved(paths, rounds, warmup=0, seed=batch)
            per_round[label] = res
            v = res["values"]
            load = load_average_stats(res["load"])
            context = args.prompt_len + new_tokens / 2
            for name in paths:
                total = step_bytes[name] + kv_bytes(cfg, batch, context, kv_item[name])
                roof = batch * bandwidth / total
                row: dict[str, Any] = {"shape": shape, "path": name, "batch": batch,
                                       "tok_per_s": statistics.median(v[name]),
                                       "vs_native_bf16": ratio_stats(v[name], v["native-bf16"])["ratio_median"],
                                       "step_MB": total / 1e6, "roofline_tok_per_s": roof,
                                       "roofline_frac": statistics.median(v[name]) / roof,
                                       "spread": ratio_stats(v[name], v["native-bf16"])["spread"],
                                       "kernels": kernel_counts(actors[name[7:]]) if name.startswith("native-")
                                       else "hf", "load_avg": load["load_median"]}
                if "bf16" in hf:
                    row["vs_hf_bf16"] = ratio_stats(v[name], v["hf-bf16"])["ratio_median"]
                if name.startswith("native-"):
                    row |= watch.row(f"{label}: {name}")
                rows.append(row)
                for ref in ("hf-bf16", "native-bf16"):
                    if ref in v and name != ref:
                        st = ratio_stats(v[name], v[ref])
                        ratios[f"{label}: {name} / {ref}"] = st
                        print_ratio(f"{label}: {name} / {ref}", st, load)
        step_stats[shape] = {f: e.step_stats() for f, e in engines.items()}
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
            "spread", "timed_builds", "kernels"]
    print_table(title, rows, cols)
    env = {"torch": torch.__version__}
    if cuda:
        env |= {"gpu": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
                "cuda": torch.version.cuda}
    write_json(args.json, "bench_engine", {"shapes": rows}, args, device=device, new_tokens=new_tokens,
               prompt_len=args.prompt_len, rounds=rounds, layers=args.layers, copy_bandwidth_Bps=bandwidth,
               ratios=ratios, per_round=per_round, env=env, shapes=args.shapes.split(","),
               builds_in_timed_rounds=watch.total(), step_stats=step_stats)
    return watch.report()


if __name__ == "__main__":
    sys.exit(main())
