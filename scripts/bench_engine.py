"""Native rollout engine throughput: generated tokens/s for fp32 and every quantized actor format.

For each format the model is quantized once (asyncrl.quant.quantize_model), warmed up, then for each
batch size B it generates B samples of exactly --new-tokens tokens (no stop tokens) from short prompts in
one ``generate`` call, --repeats times, keeping the fastest (the machine may be shared). Reported: generated
tokens/s (prefill included, it is a few % of the work) and the ratio to fp32 at the same batch size, all
measured in the same run on the same engine code.

Run: ``python scripts/bench_engine.py [--quick] [--model tiny|smollm2|PATH] [--json PATH]``.
"""

from __future__ import annotations

import copy
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.benchlib import parser, print_table, write_json  # noqa: E402

FORMATS = ("fp32", "bf16", "int8", "int8_wo", "fp8", "nvfp4", "mxfp4")
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


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_engine", __doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny (default), smollm2, or an HF folder")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma list (default: all)")
    p.add_argument("--batch-sizes", default=None, help="comma list (default 1,8,32; --quick 1,8)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per sample (default 64; --quick 24)")
    p.add_argument(
        "--repeats", type=int, default=None, help="runs per point, fastest kept (default 3; --quick 1)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)

    import torch

    from asyncrl.engine.native import NativeEngine

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in (args.batch_sizes or ("1,8" if args.quick else "1,8,32")).split(",")]
    new_tokens = args.new_tokens or (24 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 3)
    formats = [f for f in args.formats.split(",") if f]
    model, tok, folder = load_model(args.model)
    rows = []
    fp32_rate: dict[int, float] = {}
    for fmt in formats:
        engine = NativeEngine(
            copy.deepcopy(model),
            quant_format=fmt,
            device=args.device,
            max_batch_size=max(batches),
            num_threads=None,
        )
        run_batch(engine, tok, 2, 4, f"warm-{fmt}")
        for batch in batches:
            n, dt = min(
                (run_batch(engine, tok, batch, new_tokens, f"{fmt}-{batch}-{r}") for r in range(repeats)),
                key=lambda nd: nd[1],
            )
            rate = n / dt
            if fmt == "fp32":
                fp32_rate[batch] = rate
            ratio = rate / fp32_rate[batch] if batch in fp32_rate else float("nan")
            rows.append(
                {
                    "format": fmt,
                    "batch": batch,
                    "tokens": n,
                    "seconds": dt,
                    "tok_per_s": rate,
                    "vs_fp32": ratio,
                }
            )
            print(f"{fmt:8s} batch {batch:3d}: {rate:9.1f} tok/s  ({ratio:.2f}x fp32)", flush=True)
        engine.close()
    title = (
        f"native engine, model={args.model}, {new_tokens} new tokens/sample, best of {repeats}, "
        f"threads={args.threads}, {args.device}"
    )
    print_table(title, rows, ["format", "batch", "tokens", "seconds", "tok_per_s", "vs_fp32"])
    write_json(
        args.json,
        "bench_engine",
        {"throughput": rows},
        args,
        model=folder,
        new_tokens=new_tokens,
        threads=args.threads,
        repeats=repeats,
        device=args.device,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
