"""The learner's periodic evaluation: greedy accuracy (mean reward) of a policy on the task's fixed held-out set.

Owns: the requests (greedy, the model's stop tokens, prompts in the run's format) and their scores, by the
controller's own scorer (``asyncrl.tasks.scoring.GroupScorer``), so both score alike; a prompt longer than
the run's limit is left out and counted. Never: builds the engine (``workers/learner_rank0.py`` does).
"""

from __future__ import annotations

import numpy as np

from asyncrl.engine import GenRequest, RolloutEngine, SamplingParams
from asyncrl.tasks.scoring import GroupScorer


def evaluate_greedy(engine: RolloutEngine, scorer: GroupScorer, *, max_new_tokens: int,
                    limit: int | None = None) -> dict[str, float]:
    """Greedy accuracy (mean reward) of ``engine``'s policy on the task's fixed evaluation set."""
    listed = scorer.task.eval_set()[:limit]
    problems = [p for p in listed if scorer.fits(scorer.encode(p.prompt))]  # a too-long prompt is left out
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                            stop_token_ids=tuple(scorer.stop_ids) or None)
    reqs = [GenRequest(sample_id=f"eval/{i}", prompt_ids=scorer.encode(p.prompt), params=params)
            for i, p in enumerate(problems)]
    by_id = {r.sample_id: r for r in engine.generate(reqs)}
    scores = [scorer.task.score(p, scorer.decode(by_id[f"eval/{i}"].response_ids)) for i, p in enumerate(problems)]
    return {"eval/accuracy": float(np.mean(scores)) if scores else float("nan"), "eval/n": float(len(scores)),
            "eval/skipped_too_long": float(len(listed) - len(problems))}
