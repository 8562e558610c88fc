"""Scoring: prompts from the task stream, verifiable rewards and group advantages, greedy evaluation.

Owns: turning a task problem into prompt token ids (in the model's prompt format, ``prompts.py``), a group of finished samples into rewards
(the task's verifier on the decoded response, EOS removed) and advantages (``asyncrl.algo``), and
the held-out greedy accuracy used by the learner's periodic evaluation.
Never: decides admission or batching; talks to sockets.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl.algo import group_advantages
from asyncrl.controller.prompts import PromptEncoder, stop_token_ids
from asyncrl.tasks import Problem, Task, make_task


def task_kwargs(cfg) -> dict[str, Any]:
    t = cfg.task
    if t.name in ("addition", "addition2"):
        return {"seed": t.seed}
    if t.name == "jsonl_math":
        return {"path": t.path, "eval_size": t.eval_size, "seed": t.seed, "eval_path": t.eval_path or None,
                "prompt_key": t.prompt_key, "answer_key": t.answer_key,
                "answer_format": t.answer_format or "math_verify"}
    return {"dataset": t.dataset, "seed": t.seed, "eval_size": t.eval_size, "size": t.size,
            "config": dict(t.rg_config or {}), "answer_format": t.answer_format or "tag"}


class GroupScorer:
    """``prompt_format``/``system_prompt``: see ``asyncrl.controller.prompts``; ``stop_ids``: the tokens that
    end a response (sent with every assignment and used by the greedy evaluation)."""

    def __init__(self, task: Task, tokenizer, *, estimator: str = "grpo", max_new_tokens: int = 8,
                 prompt_format: str = "raw", system_prompt: str = "", stop_ids: Sequence[int] = ()) -> None:
        self.task = task
        self.tokenizer = tokenizer
        self.estimator = estimator
        self.max_new_tokens = max_new_tokens
        self.special_ids = set(tokenizer.all_special_ids)
        self.encoder = PromptEncoder(tokenizer, prompt_format, system_prompt)
        self.stop_ids = [int(i) for i in stop_ids]

    def encode(self, prompt: str) -> list[int]:
        return self.encoder.encode(prompt)

    def decode(self, response_ids: Sequence[int]) -> str:
        return self.tokenizer.decode([i for i in response_ids if i not in self.special_ids])

    def problem(self, position: int) -> dict[str, Any]:
        """The prompt at ``position`` of the training stream, as a checkpointable dict."""
        p = self.task.problem_at(position)
        return {"id": p.id, "prompt": p.prompt, "answer": p.answer, "split": p.split, "item": p.item,
                "position": position, "prompt_ids": self.encode(p.prompt)}

    def rewards(self, meta: dict[str, Any], responses: Sequence[Sequence[int]]) -> list[float]:
        problem = Problem(id=meta["id"], prompt=meta["prompt"], answer=meta["answer"], split=meta["split"],
                          item=meta["item"])
        return [float(self.task.score(problem, self.decode(r))) for r in responses]

    def score_group(self, meta: dict[str, Any], samples: Sequence[Any]) -> tuple[list[float], list[float]]:
        """Rewards and advantages of one complete group of ``FinishedSample``s."""
        rewards = self.rewards(meta, [s.response_ids.to_numpy().tolist() for s in samples])
        adv, _ = group_advantages(torch.tensor(rewards, dtype=torch.float32), estimator=self.estimator)
        return rewards, adv.tolist()


def build_scorer(cfg, model_dir: str | Path) -> GroupScorer:
    from transformers import AutoTokenizer

    task = make_task(cfg.task.name, **task_kwargs(cfg))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return GroupScorer(task, tokenizer, estimator=cfg.algo.advantage, max_new_tokens=cfg.rollout.max_new_tokens,
                       prompt_format=cfg.task.prompt_format, system_prompt=cfg.task.system_prompt,
                       stop_ids=stop_token_ids(model_dir, tokenizer))


def evaluate_greedy(engine, scorer: GroupScorer, *, max_new_tokens: int, limit: int | None = None) -> dict[str, float]:
    """Greedy accuracy (mean reward) of ``engine``'s policy on the task's fixed evaluation set."""
    from asyncrl.engine import GenRequest, SamplingParams

    problems = scorer.task.eval_set()[:limit]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                            stop_token_ids=tuple(scorer.stop_ids) or None)
    reqs = [GenRequest(sample_id=f"eval/{i}", prompt_ids=scorer.encode(p.prompt), params=params)
            for i, p in enumerate(problems)]
    by_id = {r.sample_id: r for r in engine.generate(reqs)}
    scores = [scorer.task.score(p, scorer.decode(by_id[f"eval/{i}"].response_ids)) for i, p in enumerate(problems)]
    return {"eval/accuracy": float(np.mean(scores)) if scores else float("nan"), "eval/n": float(len(scores))}
