#!/usr/bin/env python
"""Greedy accuracy of a Hugging Face model folder on a run configuration's held-out set, with a 95% CI.

The evaluation is the learner's own (``asyncrl.tasks.scoring``: the task's fixed evaluation set,
prompts in the run's format, the model's stop tokens, the task's scorer on the decoded response), on
any HF folder: the base model, a run's exported ``model/``, or a model trained by another library.
So every row of ``scripts/bench_real.py`` is scored by the same code on the same problems.

Reported: ``accuracy`` (the share of problems whose score is 1: fully correct), ``mean_score`` (the
mean of the task's scores, which may give partial credit; the learner's ``eval/accuracy``), ``n``,
``majority_answer_share`` (what answering the most common reference answer to every problem would
score), ``answers_top`` (the five answers the model gives most, as the task extracts them),
``ci95`` (Wilson score interval of ``accuracy``), and the first responses for a look at what the model
writes. One process, ``--threads`` torch threads; nothing is trained or written except ``--json``.

Run: ``python scripts/eval_greedy.py --model DIR [--json OUT] [--threads N] -- [train overrides ...]``
(the overrides select model, task and sizes exactly as ``asyncrl train`` would, e.g.
``model=smollm2 task.eval_size=200``; the tokenizer is the configured model's).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

from asyncrl.bench.measure import wilson


def evaluate(model_dir: str | Path, overrides: list[str], *, threads: int = 1, max_batch_size: int = 64,
             examples: int = 3) -> dict[str, Any]:
    """Greedy evaluation of ``model_dir`` on the held-out set of the run configured by ``overrides``."""
    import numpy as np
    import torch

    from asyncrl.config.loader import load_train_config
    from asyncrl.engine import GenRequest, SamplingParams
    from asyncrl.engine.native.engine import NativeEngine
    from asyncrl.models.prepare import prepare_model
    from asyncrl.tasks.scoring import build_scorer

    torch.set_num_threads(threads)
    cfg = load_train_config(overrides)
    base_dir = prepare_model(cfg, log=lambda _m: None)
    scorer = build_scorer(cfg, base_dir)
    problems = scorer.task.eval_set()
    stop = getattr(scorer, "stop_ids", None)
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0,
                            stop_token_ids=tuple(stop) if stop else None)
    engine = NativeEngine.from_pretrained(model_dir, quant_format="fp32", version=0,
                                          max_batch_size=max_batch_size, num_threads=threads)
    reqs = [GenRequest(sample_id=f"eval/{i}", prompt_ids=scorer.encode(p.prompt), params=params)
            for i, p in enumerate(problems)]
    t0 = time.perf_counter()
    by_id = {r.sample_id: r for r in engine.generate(reqs)}
    seconds = time.perf_counter() - t0
    engine.close()
    texts = [scorer.decode(by_id[f"eval/{i}"].response_ids) for i in range(len(problems))]
    scores = [float(scorer.task.score(p, t)) for p, t in zip(problems, texts, strict=True)]
    correct = sum(1 for s in scores if s >= 1.0)
    n = len(scores)
    tokens = sum(len(by_id[f"eval/{i}"].response_ids) for i in range(n))
    extract = getattr(scorer.task, "extract", None)
    given = Counter(str(extract(t)) if extract else t.strip()[:40] for t in texts)
    reference = Counter(p.answer for p in problems)
    return {"model": str(model_dir), "task": scorer.task.name, "n": n, "correct": correct,
            "accuracy": correct / n if n else math.nan, "ci95": list(wilson(correct, n)),
            "mean_score": float(np.mean(scores)) if n else math.nan,
            "mean_response_tokens": tokens / n if n else math.nan, "seconds": seconds,
            # a policy that gives one answer to everything scores the share of its answer: read
            # accuracy against the best constant answer's score
            "majority_answer_share": reference.most_common(1)[0][1] / n if n else math.nan,
            "answers_top": given.most_common(5),
            "examples": [{"prompt": p.prompt, "answer": p.answer, "response": t, "score": s}
                         for p, t, s in list(zip(problems, texts, scores, strict=True))[:examples]]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eval_greedy.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model folder to evaluate")
    ap.add_argument("--json", metavar="PATH", default="", help="write the result here as JSON")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    ap.add_argument("overrides", nargs="*", help="asyncrl train overrides (model=..., task=..., task.eval_size=...)")
    args = ap.parse_args(argv)
    result = evaluate(args.model, args.overrides, threads=args.threads)
    lo, hi = result["ci95"]
    print(f"{result['task']}: accuracy {result['accuracy']:.3f} [{lo:.3f}, {hi:.3f}] "
          f"({result['correct']}/{result['n']}), mean score {result['mean_score']:.3f}, {result['seconds']:.1f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
