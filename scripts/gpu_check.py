"""GPU check: one command that exercises every CUDA path of asyncrl and prints one JSON document.

Sections (each timed and recorded even when it fails, so one broken path does not hide the others):

  native   the native engine on ``cuda`` in fp32 / bf16 / int8 (W8A8, ``torch._int_mm``): decode tokens/s
           at batch 32 and the ratio to fp32 measured in the same run; behaviour log-prob agreement with
           an fp32 Hugging Face forward on the sampled tokens (max / mean |diff|, per format).
  sglang   an SGLang 0.5.23 server on the GPU serving FP8 (``--quantization fp8 --load-format flash_rl``):
           generation, then a weight update through it (tokens after it carry the new version and the
           log-probs change), bf16 serving as a second entry; needs the venv of docs/sglang.md.
  train    ``asyncrl train rollout.device=cuda learner.device=cuda`` for a few steps: native int8 workers
           on the GPU and the learner on NCCL (FSDP2, ``cpu:gloo,cuda:nccl``); summary and step times.
  train_sglang  the same with ``rollout.engine=sglang quant.fmt=fp8`` (skipped with --skip train_sglang).

Run (one H100/H200, about 5-8 minutes):
  python scripts/gpu_check.py --json gpu_check.json              # everything
  python scripts/gpu_check.py --skip sglang,train_sglang          # without SGLang installed

Exit status: 0 when every section that ran passed, 1 otherwise. Record the JSON in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from asyncrl.rundir import RunDir  # noqa: E402

SECTIONS = ("native", "sglang", "train", "train_sglang")
PROMPT = "Compute 17+25 and explain step by step. "


def environment() -> dict:
    import torch

    env = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        env |= {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "cuda": torch.version.cuda}
    return env


def reference_logp(model, prompt: list[int], response: list[int], temperature: float = 1.0):
    """fp32 HF log-probs of ``response`` after ``prompt`` at ``temperature`` (the behaviour definition)."""
    import torch

    ids = torch.tensor([prompt + response], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0].cpu().numpy()


def check_native(model_dir: Path, batch: int, new_tokens: int) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.engine import GenRequest, SamplingParams
    from asyncrl.engine.native import NativeEngine

    tok = AutoTokenizer.from_pretrained(model_dir)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda").eval()
    prompt = tok(PROMPT).input_ids
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, stop_token_ids=(), seed=0)
    out: dict = {"batch": batch, "new_tokens": new_tokens, "formats": {}}
    for fmt in ("fp32", "bf16", "int8"):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        engine = NativeEngine(model, quant_format=fmt, device="cuda", max_batch_size=batch, num_threads=None)
        try:
            list(engine.generate([GenRequest(f"warm-{i}", prompt, params) for i in range(batch)]))  # warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            results = list(engine.generate([GenRequest(f"{fmt}-{i}", prompt, params) for i in range(batch)]))
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            diffs = np.concatenate([np.abs(r.behav_logp - reference_logp(ref, prompt, r.response_ids))
                                    for r in results[:8]])
            out["formats"][fmt] = {"tokens_per_s": sum(r.num_tokens for r in results) / dt,
                                   "logp_max_abs_diff": float(diffs.max()), "logp_mean_abs_diff": float(diffs.mean()),
                                   "device": engine.capabilities()["device"]}
        finally:
            engine.close()
            del model
            torch.cuda.empty_cache()
    base = out["formats"]["fp32"]["tokens_per_s"]
    for row in out["formats"].values():
        row["ratio_to_fp32"] = row["tokens_per_s"] / base
    out["passed"] = out["formats"]["fp32"]["logp_max_abs_diff"] < 1e-2
    return out


def check_sglang(model_dir: Path, serving: str, tmp: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.engine import GenRequest, SamplingParams
    from asyncrl.engine.factory import sglang_python
    from asyncrl.engine.sglang import SGLangEngine

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
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
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
    p.add_argument("--model", default="smollm2", help="smollm2 (default), tiny, or an HF folder (native, train)")
    p.add_argument("--sglang-model", default="tiny", help="model of the SGLang check (FP8 flash_rl wants Qwen2)")
    p.add_argument("--skip", default="", help=f"comma list of sections to skip: {','.join(SECTIONS)}")
    p.add_argument("--steps", type=int, default=20, help="learner steps of the train runs")
    args = p.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    from asyncrl.models import ensure_smollm2, ensure_tiny_model

    def folder(spec: str) -> Path:
        return Path({"tiny": ensure_tiny_model, "smollm2": ensure_smollm2}.get(spec, lambda: spec)())

    report: dict = {"env": environment(), "sections": {}}
    if not report["env"]["cuda_available"]:
        print(json.dumps(report | {"error": "no CUDA device visible; run this on a GPU machine"}, indent=2))
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="asyncrl-gpu-check-"))
    model = "smollm2" if args.model == "smollm2" else ("tiny" if args.model == "tiny" else "path")
    model_args = [f"model={model}"] if model != "path" else ["model.name=path", f"model.path={args.model}"]
    common = [f"learner.total_steps={args.steps}", "learner.eval_every=0", "learner.ckpt_every=0",
              "rollout.groups_per_step=8", "rollout.max_new_tokens=32", "learner.device=cuda"]
    jobs = {
        "native": lambda: check_native(folder(args.model), batch=32, new_tokens=128),
        "sglang": lambda: {s: check_sglang(folder(args.sglang_model), s, tmp) for s in ("fp8", "bf16")},
        "train": lambda: run_train("native-cuda", [*common, *model_args, "rollout.device=cuda", "quant.fmt=int8",
                                                   "rollout.num_workers=2"], tmp / "runs", 900),
        "train_sglang": lambda: run_train("sglang-fp8", [*common, "model=tiny", "rollout.engine=sglang",
                                                         "quant.fmt=fp8", "rollout.num_workers=1",
                                                         "sglang.device=cuda"], tmp / "runs", 900),
    }
    for name, job in jobs.items():
        if name in skip:
            report["sections"][name] = {"skipped": True}
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
        print(f"[gpu_check] {name}: {'passed' if result.get('passed') else 'FAILED'} "
              f"({result['section_s']:.0f} s)", file=sys.stderr, flush=True)
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    ran = [r for r in report["sections"].values() if not r.get("skipped")]
    return 0 if all(r.get("passed") for r in ran) else 1


if __name__ == "__main__":
    raise SystemExit(main())
