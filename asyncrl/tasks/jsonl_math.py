"""Math problems from a local dataset file, graded with math-verify or a strict answer format.

Owns: reading and validating the file (JSONL: one object per line, read line by line so an error
names the line, blank lines skipped; Parquet, Arrow and ``save_to_disk`` folders through Hugging Face
``datasets``, an error naming the row), the column mapping (``prompt_key``/``answer_key``, like verl's
``data.prompt_key``), the training/evaluation split, and scoring: ``answer_format="math_verify"``
(free-form, through ``MathVerifyGrader``, which works from any thread, see ``math_verifier.py``) or a
strict format of ``answers.py`` (``tag``, ``boxed``, ``last_number``).

Must never: start grading processes at import or construction (only on first off-main-thread
grade), accept a file with a malformed line silently, or change the records' text.

Invariants:
- A missing or unreadable file, a malformed line (row), a missing column, or too few records raise
  ``ValueError`` naming the path (and line) and what to change, when the task is built, before any
  process starts.
- Prompts are fed to the model as ``prompt_template.format(prompt=record["prompt"])``
  (default: the prompt unchanged); the response is graded against ``record["answer"]``.
- Evaluation set: the whole ``eval_path`` file when given, otherwise ``eval_size`` records drawn with
  ``eval_seed``. Either way no training problem has the prompt of an evaluation problem (duplicates
  are removed from training), so held-out accuracy is never measured on trained prompts. Items are
  numbered in file order within each split.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

from asyncrl.constants import STRICT_FORMATS
from asyncrl.tasks.answers import strict_score
from asyncrl.tasks.base import EpochStreamMixin, Problem, check_reward, problem_id
from asyncrl.tasks.math_verifier import Isolation, MathVerifyGrader
from protocols.values import require_choice


def _fix(what: str, prompt_key: str, answer_key: str) -> str:
    return (f"set jsonl_math's `{what}` (for example task.{what}=/data/math.jsonl) to a JSONL file with one "
            f'{{"{prompt_key}": "...", "{answer_key}": "..."}} object per line, or a Parquet/Arrow file or '
            "datasets folder with those columns (other column names: task.prompt_key=... task.answer_key=...)")


def load_jsonl_problems(path: str | os.PathLike[str], *, what: str = "path", prompt_key: str = "prompt",
                        answer_key: str = "answer") -> list[tuple[str, str]]:
    """``[(prompt, answer), ...]`` from a dataset file (module docstring), or ``ValueError`` saying what to fix."""
    resolved = os.path.abspath(os.fspath(path))
    fix = _fix(what, prompt_key, answer_key)
    if not os.path.exists(resolved):
        raise ValueError(
            f"jsonl_math: dataset file {os.fspath(path)!r} does not exist (looked at {resolved}); {fix}"
        )
    keys = (prompt_key, answer_key)
    if os.path.isdir(resolved) or resolved.endswith((".parquet", ".arrow")):
        records = _load_with_datasets(resolved, keys, fix)
    else:
        records = []
        try:
            with open(resolved, encoding="utf-8") as f:
                for lineno, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    records.append(_parse_record(_json_line(line, f"{resolved}:{lineno}", fix),
                                                 f"{resolved}:{lineno}", fix, keys))
        except UnicodeDecodeError as e:
            bad_line = _count_lines(resolved, e.start)
            raise ValueError(f"jsonl_math: {resolved}:{bad_line} is not UTF-8 text ({e.reason}); save the file as "
                             f"UTF-8; {fix}") from e
        except OSError as e:
            raise ValueError(f"jsonl_math: cannot read {resolved} ({e}); {fix}") from e
    if not records:
        raise ValueError(f"jsonl_math: {resolved} holds no records; {fix}")
    return records


def _count_lines(path: str, byte_offset: int) -> int:
    with open(path, "rb") as f:
        return f.read(byte_offset).count(b"\n") + 1


def _json_line(line: str, where: str, fix: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"jsonl_math: {where} is not valid JSON ({e.msg}); {fix}") from e


def _load_with_datasets(resolved: str, keys: tuple[str, str], fix: str) -> list[tuple[str, str]]:
    try:
        import datasets
    except ImportError as e:
        raise ValueError("reading Parquet/Arrow files needs Hugging Face datasets: "
                         "pip install -c constraints.txt datasets==5.2.0 (or convert the file to JSONL)") from e
    try:
        if os.path.isdir(resolved):
            ds = datasets.load_from_disk(resolved)
        elif resolved.endswith(".parquet"):
            ds = datasets.Dataset.from_parquet(resolved, keep_in_memory=True)
        else:
            ds = datasets.Dataset.from_file(resolved, in_memory=True)
    except (OSError, ValueError, datasets.exceptions.DatasetGenerationError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(f"jsonl_math: cannot read {resolved} as a dataset ({str(e)[:300]}); {fix}") from e
    if isinstance(ds, datasets.DatasetDict):
        raise ValueError(f"jsonl_math: {resolved} is a DatasetDict with splits {sorted(ds)}; point "
                         f"task.path at one split's folder (e.g. {resolved}/train)")
    missing = [k for k in keys if k not in ds.column_names]
    if missing:
        raise ValueError(f"jsonl_math: {resolved} has no column {missing[0]!r} (its columns: "
                         f"{', '.join(ds.column_names)}); {fix}")
    return [_parse_record(row, f"{resolved} row {i}", fix, keys)
            for i, row in enumerate(ds.select_columns(list(keys)))]


def _parse_record(obj: Any, where: str, fix: str, keys: tuple[str, str] = ("prompt", "answer")) -> tuple[str, str]:
    prompt_key, answer_key = keys
    if not isinstance(obj, dict) or prompt_key not in obj or answer_key not in obj:
        raise ValueError(f"jsonl_math: {where} lacks a '{prompt_key}' or an '{answer_key}' field; {fix}")
    prompt, answer = obj[prompt_key], obj[answer_key]
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


JSONL_ANSWER_FORMATS = ("math_verify", *STRICT_FORMATS)


def _key(prompt: str) -> str:
    return " ".join(prompt.split())


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
        prompt_key, answer_key: the columns (JSON fields) holding the problem and its answer.
        answer_format: ``"math_verify"`` (free-form) or a strict format: ``"tag"``, ``"boxed"``,
            ``"last_number"`` (``answers.py``).
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
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        answer_format: str = "math_verify",
    ) -> None:
        if "{prompt}" not in prompt_template:
            raise ValueError(f"prompt_template must contain '{{prompt}}', got {prompt_template!r}")
        require_choice("answer_format", answer_format, JSONL_ANSWER_FORMATS)
        keys = {"prompt_key": prompt_key, "answer_key": answer_key}
        records = load_jsonl_problems(path, what="path", **keys)
        if eval_path is not None:
            train, self._eval = records, load_jsonl_problems(eval_path, what="eval_path", **keys)
        else:
            if not 1 <= eval_size < len(records):
                raise ValueError(
                    f"jsonl_math: eval_size={eval_size} must be between 1 and {len(records) - 1} for "
                    f"{path} ({len(records)} records); lower eval_size or give an eval_path"
                )
            held = set(random.Random(f"eval:{eval_seed}").sample(range(len(records)), eval_size))
            train = [r for i, r in enumerate(records) if i not in held]
            self._eval = [r for i, r in enumerate(records) if i in held]
        held_prompts = {_key(p) for p, _ in self._eval}
        self._train = [r for r in train if _key(r[0]) not in held_prompts]
        self.removed_from_train = len(train) - len(self._train)
        if not self._train:
            raise ValueError(f"jsonl_math: every training problem of {path} is also an evaluation problem; "
                             "give an eval_path with other problems or lower eval_size")
        self.seed = seed
        self.prompt_template = prompt_template
        self.answer_format = answer_format
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
        if self.answer_format != "math_verify":
            return strict_score(response, problem.answer, self.answer_format)
        return check_reward(self.grader.grade(problem.answer, response), "math-verify")

    def unparsable_answers(self) -> list[Problem]:
        """Problems (both splits) whose reference answer math-verify cannot parse: every response to them
        scores 0, so the launcher warns and counts them."""
        from asyncrl.tasks.math_verifier import gold_parses

        if self.answer_format != "math_verify":
            return []
        problems = [self.train_problem(i) for i in range(len(self._train))] + self.eval_set()
        return [p for p in problems if not gold_parses(p.answer, self.grader.timeout_s)]

    def close(self) -> None:
        self.grader.close()
