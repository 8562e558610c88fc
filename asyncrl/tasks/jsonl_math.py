"""Math problems from a JSONL file, graded with math-verify.

Owns: reading and validating the file (one ``{"prompt": str, "answer": str | number}`` object per
line; blank lines skipped), the training/evaluation split, and scoring through
``MathVerifyGrader`` (which works from any thread, see ``math_verifier.py``).

Must never: start grading processes at import or construction (only on first off-main-thread
grade), accept a file with a malformed line silently, or change the records' text.

Invariants:
- A missing or unreadable file, a malformed line, or too few records raise ``ValueError`` naming
  the path (and line) and what to change, when the task is built, before any process starts.
- Prompts are fed to the model as ``prompt_template.format(prompt=record["prompt"])``
  (default: the prompt unchanged); the response is graded against ``record["answer"]``.
- Evaluation set: the whole ``eval_path`` file when given (disjoint from training only if the
  files are); otherwise ``eval_size`` records drawn with ``eval_seed`` and removed from training
  (disjoint). Items are numbered in file order within each split.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

from asyncrl.tasks.base import EpochStreamMixin, Problem, check_reward, problem_id
from asyncrl.tasks.math_verifier import Isolation, MathVerifyGrader


def load_jsonl_problems(path: str | os.PathLike[str], *, what: str = "path") -> list[tuple[str, str]]:
    """``[(prompt, answer), ...]`` from a JSONL file, or ``ValueError`` saying what to fix."""
    resolved = os.path.abspath(os.fspath(path))
    fix = (
        f"set jsonl_math's `{what}` (for example task.{what}=/data/math.jsonl) to a JSONL file with one "
        '{"prompt": "...", "answer": "..."} object per line'
    )
    if not os.path.isfile(resolved):
        raise ValueError(
            f"jsonl_math: dataset file {os.fspath(path)!r} does not exist (looked at {resolved}); {fix}"
        )
    records: list[tuple[str, str]] = []
    try:
        with open(resolved, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                records.append(_parse_record(line, f"{resolved}:{lineno}", fix))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"jsonl_math: cannot read {resolved} ({e}); {fix}") from e
    if not records:
        raise ValueError(f"jsonl_math: {resolved} holds no records; {fix}")
    return records


def _parse_record(line: str, where: str, fix: str) -> tuple[str, str]:
    try:
        obj: Any = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"jsonl_math: {where} is not valid JSON ({e.msg}); {fix}") from e
    if not isinstance(obj, dict) or "prompt" not in obj or "answer" not in obj:
        raise ValueError(f"jsonl_math: {where} lacks a 'prompt' or an 'answer' field; {fix}")
    prompt, answer = obj["prompt"], obj["answer"]
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise ValueError(
            f"jsonl_math: {where} has an answer of type {type(answer).__name__}; use a string or number"
        )
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"jsonl_math: {where} has an empty or non-string prompt; {fix}")
    answer = str(answer).strip()
    if not answer:
        raise ValueError(f"jsonl_math: {where} has an empty answer; {fix}")
    return prompt, answer


class JsonlMathTask(EpochStreamMixin):
    """Problems from ``path``; rewards from math-verify.

    Args:
        path: training JSONL file.
        eval_path: evaluation JSONL file; ``None`` holds out ``eval_size`` records of ``path``.
        eval_size: records held out when ``eval_path`` is ``None``.
        seed: order of the training stream.
        eval_seed: which records are held out.
        prompt_template: ``str.format`` template with a ``{prompt}`` field.
        timeout_s: math-verify's per-step bound in seconds.
        isolation: grading isolation (``"auto"``, ``"inline"``, ``"process"``).
    """

    name = "jsonl_math"

    def __init__(
        self,
        path: str,
        eval_path: str | None = None,
        eval_size: int = 64,
        seed: int = 0,
        eval_seed: int = 1234,
        prompt_template: str = "{prompt}",
        timeout_s: int = 5,
        isolation: Isolation = "auto",
    ) -> None:
        if "{prompt}" not in prompt_template:
            raise ValueError(f"prompt_template must contain '{{prompt}}', got {prompt_template!r}")
        records = load_jsonl_problems(path, what="path")
        if eval_path is not None:
            self._train, self._eval = records, load_jsonl_problems(eval_path, what="eval_path")
        else:
            if not 1 <= eval_size < len(records):
                raise ValueError(
                    f"jsonl_math: eval_size={eval_size} must be between 1 and {len(records) - 1} for "
                    f"{path} ({len(records)} records); lower eval_size or give an eval_path"
                )
            held = set(random.Random(f"eval:{eval_seed}").sample(range(len(records)), eval_size))
            self._train = [r for i, r in enumerate(records) if i not in held]
            self._eval = [r for i, r in enumerate(records) if i in held]
        self.seed = seed
        self.prompt_template = prompt_template
        self.grader = MathVerifyGrader(timeout_s=timeout_s, isolation=isolation)

    @property
    def train_size(self) -> int:
        return len(self._train)

    def _problem(self, split: str, item: int, record: tuple[str, str]) -> Problem:
        prompt, answer = record
        return Problem(
            problem_id(self.name, split, item),
            self.prompt_template.format(prompt=prompt),
            answer,
            split,
            item,
        )

    def train_problem(self, item: int) -> Problem:
        return self._problem("train", item, self._train[item])

    def eval_set(self) -> list[Problem]:
        return [self._problem("eval", i, r) for i, r in enumerate(self._eval)]

    def score(self, problem: Problem, response: str) -> float:
        return check_reward(self.grader.grade(problem.answer, response), "math-verify")

    def close(self) -> None:
        self.grader.close()
