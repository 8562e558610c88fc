"""Scoring: prompts from the task stream and verifiable rewards, for the controller and the learner's evaluation.

Owns: turning a task problem into prompt token ids (in the model's prompt format, ``prompts.py``), a
group's responses into rewards (the task's verifier on the decoded response, EOS removed; the controller
turns them into advantages, ``asyncrl.controller.core.score_group``), and the prompt-length limit
(``max_prompt_tokens``: the model's context minus one token to generate, or ``task.max_prompt_tokens``):
``prompt_length_report`` checks a dataset at load (``task.too_long=error`` refuses it up front,
``skip`` counts what admission will skip), and the evaluation set leaves out (and counts) prompts
that do not fit, so a too-long prompt never reaches an engine.
Never: decides admission or batching, computes advantages, runs an engine (the greedy evaluation that
scores with it is ``asyncrl.learner.evaluate``); talks to sockets.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.tasks.base import Problem, Task
from asyncrl.tasks.prompts import PromptEncoder, load_tokenizer, stop_token_ids
from asyncrl.tasks.registry import make_task


def task_kwargs(cfg) -> dict[str, Any]:
    t = cfg.task
    if t.name in ("addition", "addition2"):
        return {"seed": t.seed}
    if t.name == "jsonl_math":
        return {"path": t.path, "eval_size": t.eval_size, "seed": t.seed, "eval_path": t.eval_path or None,
                "prompt_key": t.prompt_key, "answer_key": t.answer_key,
                "answer_format": t.answer_format or "math_verify"}
    return {"dataset": t.dataset, "seed": t.seed, "eval_size": t.eval_size, "size": t.size,
            "config": dict(t.rg_config or {}), "answer_format": t.answer_format or "tag",
            "partial_credit": t.partial_credit}


class GroupScorer:
    """``prompt_format``/``system_prompt``: see ``asyncrl.tasks.prompts``; ``stop_ids``: the tokens that
    end a response (sent with every assignment and used by the greedy evaluation); ``max_prompt_tokens``:
    the longest prompt a run takes (0: no limit)."""

    def __init__(self, task: Task, tokenizer, *, max_new_tokens: int = 8,
                 prompt_format: str = "raw", system_prompt: str = "", stop_ids: Sequence[int] = (),
                 max_prompt_tokens: int = 0) -> None:
        self.task = task
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.max_prompt_tokens = max_prompt_tokens  # 0: no limit
        self.special_ids = set(tokenizer.all_special_ids)
        self.encoder = PromptEncoder(tokenizer, prompt_format, system_prompt)
        self.stop_ids = [int(i) for i in stop_ids]

    def fits(self, prompt_ids: Sequence[int]) -> bool:
        return not self.max_prompt_tokens or len(prompt_ids) <= self.max_prompt_tokens

    def prompt_length_report(self, *, max_train_scan: int = 1_000_000) -> dict[str, Any]:
        """Prompts longer than ``max_prompt_tokens`` in the training split (if it has at most
        ``max_train_scan`` items) and in the evaluation set: counts and the first of each."""
        out: dict[str, Any] = {"limit": self.max_prompt_tokens, "train_too_long": 0, "eval_too_long": 0,
                               "train_scanned": False, "first": None}
        if not self.max_prompt_tokens:
            return out
        n_train = getattr(self.task, "train_size", max_train_scan + 1)
        n_train = n_train() if callable(n_train) else int(n_train)
        problems = list(self.task.eval_set())
        if n_train <= max_train_scan:
            out["train_scanned"] = True
            problems = [self.task.train_problem(i) for i in range(n_train)] + problems
        for p in problems:
            n = len(self.encode(p.prompt))
            if n > self.max_prompt_tokens:
                out[f"{p.split}_too_long"] += 1
                if out["first"] is None:
                    out["first"] = f"{p.id} has {n} prompt tokens"
        return out

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


def build_scorer(cfg, model_dir: str | Path, *, tokenizer_class: str = "") -> GroupScorer:
    """``tokenizer_class``: see ``load_tokenizer`` (given, the scorer loads no torch)."""
    task = make_task(cfg.task.name, **task_kwargs(cfg))
    tokenizer = load_tokenizer(model_dir, tokenizer_class)
    return GroupScorer(task, tokenizer, max_new_tokens=cfg.rollout.max_new_tokens,
                       prompt_format=cfg.task.prompt_format, system_prompt=cfg.task.system_prompt,
                       stop_ids=stop_token_ids(model_dir, tokenizer),
                       max_prompt_tokens=prompt_limit(cfg, model_dir))


def prompt_limit(cfg, model_dir: str | Path) -> int:
    """Longest prompt a run takes: ``task.max_prompt_tokens`` if set, else the model's context - 1."""
    import json

    context = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings") or 0
    limit = cfg.task.max_prompt_tokens or max(0, int(context) - 1)
    if context and limit >= context:
        raise ValueError(f"task.max_prompt_tokens={limit} leaves no room to generate in the model's context of "
                         f"{context} tokens; use at most {context - 1}")
    return limit

