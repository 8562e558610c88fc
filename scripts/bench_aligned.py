#!/usr/bin/env python
"""The lag-0 log-prob gap between a quantized sampler and the learner, full precision vs rollout-aligned.

For each format, the native engine (the workers' engine, converted to that format) samples responses to the
rollout questions at temperature 1 with the model's own prompt format, keeping the behaviour log-prob of each
token it sampled. The learner then computes the log-probs of the same tokens at the same weights, no update
in between (lag 0), three ways (asyncrl/learner/mismatch.py, docs/algorithms.md §7.1 and §8b):

  full      the full-precision learner (the default; ``mismatch/lag0`` of an unaligned run)
  aligned   the learner through the format's quantizer (``learner.rollout_aligned=true``)
  noise     each learner against itself with each sequence alone (the floor a sampler computing the same
            function would show: another batch shape, amplified by the roundings inside the function)

Reported per format: mean |behaviour - learner| per response token (nats) for ``full`` and ``aligned`` with
95% intervals over the seeds (Student's t; a seed is one sampling of every question), their ratio, the
quantization gap (``mismatch/quant``) and the two noise floors. Seeds vary the sampling only.

Run: ``python scripts/bench_aligned.py [--model tiny|smollm2|DIR] [--formats int8,nvfp4] [--seeds 0,1,2,3,4]
[--samples N] [--new-tokens N]``; ``--smoke`` is the tiny model, two formats, one seed.
"""

from __future__ import annotations

import contextlib
import copy
import statistics

from asyncrl.bench.measure import ci95
from asyncrl.bench.models import RolloutPrompts, load_model
from asyncrl.bench.report import parser, print_table, write_json

FORMATS = ("bf16", "int8", "int8_wo", "fp8", "nvfp4", "mxfp4")


def sample(model, fmt: str, prompts: list[list[int]], stops: tuple[int, ...], *, seed: int, new_tokens: int,
           pad_id: int):
    """A LearnerBatch of the native ``fmt`` engine's samples (version 0, advantages 0)."""
    import numpy as np

    from asyncrl.engine import GenRequest, SamplingParams
    from asyncrl.engine.native.engine import NativeEngine
    from asyncrl.learner import LearnerBatch

    engine = NativeEngine(copy.deepcopy(model), quant_format=fmt, max_batch_size=len(prompts), num_threads=None,
                          eos_token_ids=stops or None)
    try:
        params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, stop_token_ids=stops or None, seed=seed)
        results = sorted(engine.generate([GenRequest(f"s{i}", p, params) for i, p in enumerate(prompts)]),
                         key=lambda r: int(r.sample_id[1:]))
    finally:
        engine.close()
    results = [r for r in results if r.response_ids]
    return LearnerBatch.from_samples([r.prompt_ids for r in results], [r.response_ids for r in results],
                                     [r.behav_logp for r in results], [np.zeros(len(r.response_ids), np.int32)
                                                                       for r in results],
                                     [0.0] * len(results), temperature=1.0, pad_id=pad_id)


def measure(model, fmt: str, batch) -> dict[str, float]:
    """The §7.1 decomposition at lag 0 with the learner unaligned, then aligned, on a fresh copy of ``model``."""
    from asyncrl.learner.aligned import RolloutAlignment
    from asyncrl.learner.mismatch import mismatch_decomposition
    from asyncrl.quant import DEFAULT_KEEP_FULL_PRECISION

    learner = copy.deepcopy(model)
    al = RolloutAlignment(learner, fmt, keep_full_precision=DEFAULT_KEEP_FULL_PRECISION, enabled=False)
    kw = {"version": 0, "rows": batch.batch_size, "aligned": al, "autocast": contextlib.nullcontext()}
    full = mismatch_decomposition(learner, batch, **kw)
    with al.set_enabled(True):
        aligned = mismatch_decomposition(learner, batch, **kw)
    return {"full": full["mismatch/lag0"], "aligned": aligned["mismatch/lag0"], "quant": full["mismatch/quant"],
            "noise_full": full["mismatch/noise"], "noise_aligned": aligned["mismatch/noise"]}


def main(argv: list[str] | None = None) -> int:
    p = parser("bench_aligned", __doc__, smoke=True)
    p.add_argument("--model", default=None, help="tiny, smollm2 or a model folder (default smollm2; smoke tiny)")
    p.add_argument("--formats", default=None, help=f"comma list (default {','.join(FORMATS)})")
    p.add_argument("--seeds", default=None, help="comma list (default 0,1,2,3,4; smoke 0)")
    p.add_argument("--samples", type=int, default=16, help="responses per seed (default %(default)s)")
    p.add_argument("--new-tokens", type=int, default=None, help="max response tokens (default 64; tiny 8)")
    args = p.parse_args(argv)
    import torch

    spec = args.model or ("tiny" if args.smoke else "smollm2")
    formats = (args.formats or ("int8,nvfp4" if args.smoke or args.quick else ",".join(FORMATS))).split(",")
    seeds = [int(s) for s in (args.seeds or ("0" if args.smoke else "0,1,2,3,4")).split(",")]
    new_tokens = args.new_tokens or (8 if spec == "tiny" else 64)
    torch.set_num_threads(1)
    model, tok, folder = load_model(spec)
    rp = RolloutPrompts(tok, folder)
    prompts = [rp.prompt(i) for i in range(args.samples)]
    rows = []
    for fmt in formats:
        per_seed = []
        for seed in seeds:
            batch = sample(model, fmt, prompts, rp.stops, seed=seed, new_tokens=new_tokens,
                           pad_id=tok.pad_token_id or 0)
            per_seed.append(measure(model, fmt, batch))
            print(f"  {fmt} seed {seed}: {per_seed[-1]}", flush=True)
        row: dict = {"format": fmt, "seeds": len(seeds)}
        for part in ("full", "aligned"):
            row[f"lag0_{part}"], row[f"lag0_{part}_ci95"] = ci95([m[part] for m in per_seed])
        row["aligned_vs_full"] = row["lag0_aligned"] / row["lag0_full"] if row["lag0_full"] else float("nan")
        for part in ("quant", "noise_full", "noise_aligned"):
            row[part] = statistics.fmean(m[part] for m in per_seed)
        rows.append(row)
    print_table(
        f"{spec}: mean |behaviour - learner log-prob| per token at lag 0 (nats; mean over {len(seeds)} seeds, 95% CI), "
        f"{args.samples} responses of <= {new_tokens} tokens per seed, temperature 1",
        rows, ["format", "seeds", "lag0_full", "lag0_full_ci95", "lag0_aligned", "lag0_aligned_ci95",
               "aligned_vs_full", "quant", "noise_full", "noise_aligned"])
    write_json(args.json, "bench_aligned", {"summary": rows}, args, model=spec, seeds=seeds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
