"""Learner memory and speed: peak RSS and seconds per 1k trained tokens of real ``train_step`` calls.

Builds a synthetic step batch shaped like a rollout batch (``--samples`` responses of exactly
``--new-tokens`` tokens after prompts of ``--prompt-len`` +- a few tokens, GRPO-like advantages of
+-1, behaviour log-probs from a sampler) and times real learner steps on the chosen model, one
configuration per child process so each peak RSS is its own (``ru_maxrss`` of the child: model
load, optimiser, activations, everything). Time is reported as wall seconds and as the
process's CPU seconds per 1k trained tokens (the CPU figure is the steadier one on a shared
machine; with one thread it is the compute the step needs). All rows run in one invocation,
side by side, and are reported with their ratio to the first row.

Rows:
  fsdp-ws1-mb64   the learner's previous knobs on today's code: FSDP2 wrapper at world size 1,
                  64 sequences per micro-batch, a separate proximal pass, no activation checkpointing
  full            full fine-tuning as the learner now runs it: no wrapper at world size 1,
                  activation checkpointing, micro-batches of <= --token-budget padded tokens,
                  proximal log-probs reused from the first forward
  full-fsdp-ws1   ``full`` with the FSDP2 wrapper added at world size 1 (what the learner skips there):
                  its time and RSS against ``full``'s are the wrapper's cost alone
  full-bf16       the same under bf16 autocast (fp32 master weights)
  full-bf16-uncapped  ``full-bf16`` with oneDNN's and ideep's per-shape caches at their default 1024
                  entries: its RSS minus ``full-bf16``'s is what those caches keep (with ``--vary``)
  lora            LoRA r=16 (alpha 32) on every projection, same knobs as ``full``
  lora-bf16       ``lora`` under bf16 autocast, as ``+experiment=smollm2_signed_sums`` runs it
  lora-glibc-default  ``lora`` with glibc's default malloc settings: freed activations stay in
                  its heap (asyncrl/learner/memory.py); its RSS minus ``lora``'s is that retention
  lora-int8-base, lora-nvfp4-base  ``lora`` with its frozen base packed (``learner.base_format``, QeRL)
  lora-aligned-int8, full-aligned-int8  ``lora`` / ``full`` with a rollout-aligned forward through the int8
                  quantizer (``learner.rollout_aligned``): what alignment costs

Every other row bounds glibc's retention and the kernel caches as the learner process does
(``bound_malloc_retention`` and ``bound_kernel_caches`` at process start).

``--vary``: every step after the first trains a batch of other prompt and response lengths, as a
rollout stream does, and ``rss_growth_gb`` reports how far the process's resident memory rose from
the first step's end to the last's (bf16 autocast grew with every new shape, fp32 did not:
docs/benchmarks.md §6, "The two allocator bounds").

``--device cuda``: the same steps on the GPU, reported as trained tokens per second, peak GPU memory
(``torch.cuda.max_memory_allocated``: weights, gradients, AdamW state, activations) and MFU: model FLOPs
per second over the bf16 matrix rate measured in the same process (a timed 8192^3 bf16 matmul; on the
CPU a 512^3 one). Model FLOPs of a step, counted on the real (unpadded) positions, fwd + bwd:
``6 * N * positions + 6 * layers * q_dim * sum(S_i^2)`` with N the matmul parameters (every decoder
linear, routed experts at their active fraction top_k / E, plus the output head; not the embedding
lookup) and S_i each sequence's length
(causal attention: half of the S^2 score and value products). Activation checkpointing's recompute is
not counted (the usual MFU convention), so it lowers MFU.

``--model``: ``tiny`` / ``smollm2`` / an HF folder, a preset of published architecture built from its
config with random weights (no download; ``asyncrl.models.families.PRESETS``: ``qwen3-0.6b``,
``qwen3-1.7b``, ``qwen3-4b``, ``qwen3-8b``, ``llama-3.2-1b``), or ``family:NAME``, a tiny random-weight
model of a family (``family:qwen3``, ``family:qwen3_moe``, ...).

Run: ``python scripts/bench_learner.py [--quick] [--vary] [--model smollm2|tiny|PATH|PRESET|family:NAME]
[--device cpu|cuda] [--json PATH]``. The GPU measurement of the presets:
``python scripts/bench_learner.py --device cuda --model qwen3-0.6b --rows full-bf16,lora-bf16 --samples 64
--prompt-len 256 --new-tokens 768 --token-budget 32768 --steps 3`` (and ``--model qwen3-1.7b``).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

from asyncrl.bench.measure import device_sync
from asyncrl.bench.models import model_folder as hf_folder
from asyncrl.bench.report import parser, print_table, write_json
from asyncrl.bench.runs import proc_status_bytes

ROWS = {
    "fsdp-ws1-mb64": dict(fsdp=True, micro=64, budget=0, ac=False, reuse=False, autocast="", lora=0),
    "full": dict(fsdp=False, micro=64, budget=None, ac=True, reuse=True, autocast="", lora=0),
    "full-fsdp-ws1": dict(fsdp=True, micro=64, budget=None, ac=True, reuse=True, autocast="", lora=0),
    "full-bf16": dict(fsdp=False, micro=64, budget=None, ac=True, reuse=True, autocast="bf16", lora=0),
    "full-bf16-uncapped": dict(fsdp=False, micro=64, budget=None, ac=True, reuse=True, autocast="bf16", lora=0,
                               uncapped_kernel_caches=True),
    "lora": dict(fsdp=False, micro=64, budget=None, ac=True, reuse=True, autocast="", lora=16),
    "lora-bf16": dict(fsdp=False, micro=64, budget=None, ac=True, reuse=True, autocast="bf16", lora=16),
    "lora-glibc-default": dict(fsdp=False, micro=64, budget=None, ac=True, reuse=True, autocast="", lora=16,
                               unbounded_malloc=True),
    "lora-int8-base": dict(fsdp=False, micro=64, budget=None, ac=True, reuse=True, autocast="", lora=16,
                           base_format="int8"),
    "lora-nvfp4-base": dict(fsdp=False, micro=64, budget=None, ac=True, reuse=True, autocast="", lora=16,
                            base_format="nvfp4"),
    "lora-aligned-int8": dict(fsdp=False, micro=64, budget=None, ac=True, reuse=True, autocast="", lora=16,
                              aligned="int8"),
    "full-aligned-int8": dict(fsdp=False, micro=64, budget=None, ac=True, reuse=True, autocast="", lora=0,
                              aligned="int8"),
}


def model_folder(spec: str) -> str:
    """An HF folder for ``tiny`` / ``smollm2`` / a path; presets and ``family:NAME`` stay names (built
    from their config in the child)."""
    from asyncrl.models.families import FAMILIES, PRESETS

    if spec in PRESETS or spec.removeprefix("family:") in FAMILIES and spec.startswith("family:"):
        return spec
    if spec.startswith("family:"):
        raise SystemExit(f"unknown family {spec!r}; choose family:NAME with NAME in {', '.join(FAMILIES)}")
    return str(hf_folder(spec))


def build_model(folder: str):
    """The fp32 model of ``folder``: a preset or tiny family from its config (seeded random weights), else
    ``from_pretrained``."""
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.models.families import PRESETS, build_family_model, init_weights, preset_config

    if folder in PRESETS:
        model = AutoModelForCausalLM.from_config(preset_config(folder), dtype=torch.float32)
        return init_weights(model, 0)
    if folder.startswith("family:"):
        return build_family_model(folder.removeprefix("family:"), 0)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def matmul_params(model) -> float:
    """Parameters that multiply each token's activations: every weight of 2+ dimensions except the input
    embedding (a tied head counts it once), fused expert tensors ``[E, ...]`` at their active fraction
    ``num_experts_per_tok / E``."""
    emb = model.get_input_embeddings().weight
    top_k = getattr(model.config, "num_experts_per_tok", None)
    total = 0.0
    for p in model.parameters():
        if p.dim() == 3 and top_k:
            total += p.numel() * top_k / p.shape[0]
        elif p.dim() >= 2 and p is not emb:
            total += p.numel()
    return total + (emb.numel() if model.config.tie_word_embeddings else 0)  # a tied head multiplies by it


def step_model_flops(config, n_matmul: float, lengths: list[int]) -> float:
    """Model FLOPs of one fwd + bwd over sequences of ``lengths`` positions (module docstring)."""
    layers = int(config.num_hidden_layers)
    q_dim = int(config.num_attention_heads) * int(getattr(config, "head_dim", None)
                                                   or config.hidden_size // config.num_attention_heads)
    return 6.0 * n_matmul * sum(lengths) + 6.0 * layers * q_dim * sum(n * n for n in lengths)


def matrix_rate(device) -> float:
    """Measured bf16 matmul rate on ``device``, FLOP/s (8192^3 on a GPU, 512^3 on the CPU)."""
    import torch

    n, reps = (8192, 20) if device.type == "cuda" else (512, 5)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    device_sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    device_sync(device)
    return 2.0 * n**3 * reps / (time.perf_counter() - t0)


def synthetic_batch(vocab: int, samples: int, prompt_len: int, new_tokens: int, seed: int = 0):
    import numpy as np

    from asyncrl.learner import LearnerBatch

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(10, vocab, prompt_len - (i // 8) % 5).tolist() for i in range(samples)]
    responses = [rng.integers(10, vocab, new_tokens).tolist() for _ in range(samples)]
    behav = [(-rng.random(new_tokens) * 3).astype(np.float32) for _ in range(samples)]
    versions = [np.zeros(new_tokens, np.int32) for _ in range(samples)]
    adv = [float(rng.choice([-1.0, 1.0])) for _ in range(samples)]
    return LearnerBatch.from_samples(prompts, responses, behav, versions, adv, temperature=1.0)


def child(spec: dict) -> dict:
    """One configuration in this process: build, run ``steps`` learner steps, report."""
    import torch

    from asyncrl.algo import ObjectiveConfig
    from asyncrl.learner import (
        LRSchedule,
        StepConfig,
        TrainState,
        build_optimizer,
        build_scheduler,
        init_distributed,
        shard_model,
        train_step,
    )
    from asyncrl.learner.memory import KERNEL_CACHE_VARS, bound_kernel_caches, bound_malloc_retention
    from asyncrl.learner.policy import LoraSpec, prepare_policy

    row = ROWS[spec["row"]]
    if not row.get("unbounded_malloc"):
        bound_malloc_retention()
    if row.get("uncapped_kernel_caches"):
        for var in KERNEL_CACHE_VARS:
            os.environ.pop(var, None)
    else:
        bound_kernel_caches()
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    cuda = spec.get("device", "cpu") == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no GPU here; run with --device cpu")
    info = init_distributed(None if cuda else "gloo")
    model = build_model(spec["folder"])
    n_matmul = matmul_params(model)
    config = model.config
    vocab = int(model.config.vocab_size)
    if row["fsdp"] and not row["ac"]:  # the earlier knobs: the wrapper, nothing else
        model = shard_model(model, info)
    else:
        lora = None
        if row["lora"]:
            lora = LoraSpec(rank=row["lora"], alpha=2.0 * row["lora"], target_modules=(
                "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
        model = prepare_policy(model, info, lora=lora, activation_checkpointing=row["ac"],
                               base_format=row.get("base_format", ""))
        if row["fsdp"] and info.world_size == 1:  # the wrapper prepare_policy leaves out at world size 1
            model = shard_model(model, info)
    opt = build_optimizer(model, lr=1e-6)
    if row.get("aligned"):
        from asyncrl.learner.aligned import RolloutAlignment
        from asyncrl.quant import DEFAULT_KEEP_FULL_PRECISION

        RolloutAlignment(model, row["aligned"], keep_full_precision=DEFAULT_KEEP_FULL_PRECISION).watch(opt)
    state = TrainState(model, opt, build_scheduler(opt, LRSchedule()))
    batch = synthetic_batch(vocab, spec["samples"], spec["prompt_len"], spec["new_tokens"])
    tokens = batch.num_tokens  # the first (full-length) batch's
    budget = spec["token_budget"] if row["budget"] is None else row["budget"]
    cfg = StepConfig(micro_batch_size=row["micro"], max_tokens_per_micro_batch=budget, reuse_prox=row["reuse"],
                     autocast=row["autocast"])
    times, cpu, prox, rss_after, per_1k, cpu_per_1k, flops, ntoks = [], [], [], [], [], [], [], []
    for i in range(spec["steps"]):
        if spec.get("vary") and i:  # a rollout stream's batches: other prompt and response lengths each step
            batch = synthetic_batch(vocab, spec["samples"], spec["prompt_len"] + i % 7,
                                    max(1, spec["new_tokens"] - (i * 13) % 45), seed=i)
        device_sync(info.device)
        t0, c0 = time.perf_counter(), time.process_time()
        m = train_step(state, batch, ObjectiveConfig(objective="acr"), cfg, info)
        device_sync(info.device)
        times.append(time.perf_counter() - t0)
        lengths = batch.attention_mask.sum(dim=1).tolist()
        flops.append(step_model_flops(config, n_matmul, lengths))
        ntoks.append(batch.num_tokens)
        cpu.append(time.process_time() - c0)
        prox.append(m["learner/prox_seconds"])
        rss_after.append(_rss_now_gb())
        per_1k.append(times[-1] / batch.num_tokens * 1000)
        cpu_per_1k.append(cpu[-1] / batch.num_tokens * 1000)
    best = min(range(len(times)), key=lambda j: times[j])
    rate = matrix_rate(info.device)
    device_stats = {"device": info.device.type, "matmul_tflops": rate / 1e12,
                    "tokens_per_s": ntoks[best] / times[best],
                    "model_tflops_per_s": flops[best] / times[best] / 1e12, "mfu": flops[best] / times[best] / rate,
                    "peak_gpu_gb": torch.cuda.max_memory_allocated(info.device) / 2**30 if cuda else 0.0}
    return {**device_stats, "row": spec["row"],
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "step_s": min(times), "s_per_1k_tokens": min(per_1k), "prox_s": min(prox),
            "cpu_s_per_1k_tokens": min(cpu_per_1k),
            "trained_tokens": tokens, "sequences": batch.batch_size, "seq_len": batch.seq_len,
            "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "weights_gb": weights_gb(model),
            "steps": len(times), "entropy": m.get("actor/entropy", float("nan")),
            "rss_after_step_gb": rss_after, "rss_growth_gb": rss_after[-1] - rss_after[0]}


def weights_gb(model) -> float:
    """GB this rank's parameters and buffers hold (each storage once): what a packed base saves, whatever the
    allocator does with the memory the load freed."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        t = t.to_local() if callable(getattr(t, "to_local", None)) else t  # an FSDP2 shard: this rank's part
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total / 2**30


def _rss_now_gb() -> float:
    """This process's resident memory now (``VmRSS``), GB."""
    return proc_status_bytes("self", "VmRSS") / 2**30


def main() -> int:
    ap = parser("bench_learner", __doc__)
    ap.add_argument("--model", default="smollm2", help="tiny | smollm2 | an HF folder (default smollm2)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2, help="learner steps per row (the fastest is reported)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--token-budget", type=int, default=2048, help="max padded tokens per micro-batch")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {', '.join(ROWS)}")
    ap.add_argument("--vary", action="store_true", help="each step after the first gets other prompt and response "
                    "lengths (as a rollout stream's batches do); rss_growth_gb then shows memory that grows with "
                    "new shapes (the timed figure stays the fastest step)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the learner steps run; cuda "
                    "reports peak GPU memory and MFU against the bf16 matmul rate measured in the same run")
    ap.add_argument("--child", default="", help=argparse_hidden())
    args = ap.parse_args()
    if args.child:
        print("BENCH_ROW " + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    if args.quick:
        args.samples, args.steps = min(args.samples, 16), 1
    folder = model_folder(args.model)
    rows = []
    for name in args.rows.split(","):
        if name not in ROWS:
            raise SystemExit(f"unknown row {name!r}; choose from {', '.join(ROWS)}")
        spec = {"row": name, "folder": folder, "samples": args.samples, "prompt_len": args.prompt_len,
                "new_tokens": args.new_tokens, "steps": args.steps, "threads": args.threads,
                "token_budget": args.token_budget, "vary": args.vary, "device": args.device}
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
        res = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                             capture_output=True, text=True, env=env)
        lines = [x for x in res.stdout.splitlines() if x.startswith("BENCH_ROW ")]
        if res.returncode != 0 or not lines:
            raise SystemExit(f"row {name} failed (rc {res.returncode}):\n{res.stderr[-3000:]}")
        row = json.loads(lines[-1][len("BENCH_ROW "):])
        print(f"{name}: {row['peak_rss_gb']:.2f} GB RSS, {row['peak_gpu_gb']:.2f} GB GPU, {row['tokens_per_s']:.0f} "
              f"tokens/s, MFU {row['mfu']:.3f}", flush=True)
        rows.append(row)
    base = rows[0]
    for r in rows:
        r["rss_ratio"] = r["peak_rss_gb"] / base["peak_rss_gb"]
        r["time_ratio"] = r["s_per_1k_tokens"] / base["s_per_1k_tokens"]
        r["cpu_ratio"] = r["cpu_s_per_1k_tokens"] / base["cpu_s_per_1k_tokens"]
    print_table(f"learner steps, {args.model}, {args.samples} x ({args.prompt_len} + {args.new_tokens}) tokens, "
                f"{args.threads} thread(s)", rows,
                ["row", "peak_rss_gb", "rss_ratio", "rss_growth_gb", "weights_gb", "s_per_1k_tokens", "time_ratio",
                 "cpu_s_per_1k_tokens", "cpu_ratio", "prox_s", "trainable_params"]
                + (["tokens_per_s", "peak_gpu_gb", "model_tflops_per_s", "matmul_tflops", "mfu"]
                   if args.device == "cuda" else ["tokens_per_s", "mfu"]))
    write_json(args.json, "bench_learner", {"rows": rows}, args, model=args.model, samples=args.samples,
               prompt_len=args.prompt_len, new_tokens=args.new_tokens, threads=args.threads,
               token_budget=args.token_budget, vary=args.vary, device=args.device)
    return 0


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    raise SystemExit(main())
