"""Procedurally generated problems from the PyPI package ``reasoning-gym``, scored by its own scorers.

Owns: building a training and an evaluation dataset of one reasoning-gym generator (for example
``chain_sum`` or ``gsm_symbolic``), the prompt format, answer extraction, and the call to the
dataset's ``score_answer``.

Must never: import ``reasoning_gym`` at module import (it takes about a second and is optional:
``pip install reasoning-gym==0.1.25``), or rescale or replace the package's rewards.

Invariants:
- reasoning-gym generates item ``i`` of a dataset with ``random.Random(seed + i)``. Training uses
  ``seed`` with ``size`` items; evaluation uses ``eval_seed`` (default ``seed + size``, so the two
  never share a generator seed) with ``eval_size`` items. Different seeds do not guarantee
  different questions when a generator's space is small (two-term single-digit sums repeat).
- ``answer_format="tag"`` (default) appends an instruction to answer inside
  ``<answer>...</answer>`` and scores the last tagged answer (``reasoning_gym.utils.extract_answer``;
  no tag scores like an empty answer). ``"plain"`` feeds the question unchanged and scores the
  first line of the response. Rewards are the package's own, in ``[0, 1]`` (``gsm_symbolic`` gives
  0.01 to a numeric but wrong answer, ``chain_sum`` partial credit to a superstring).
"""

from __future__ import annotations

import functools
from typing import Any, Literal

from asyncrl.tasks.base import EpochStreamMixin, Problem, check_reward, problem_id

AnswerFormat = Literal["tag", "plain"]
TAG_INSTRUCTION = "\nGive only the final answer, between <answer> and </answer>."
PIN = "reasoning-gym==0.1.25"


def _import_reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as e:
        raise ValueError(
            f"the reasoning_gym task needs the reasoning-gym package: pip install -c constraints.txt {PIN}"
        ) from e
    return reasoning_gym


class ReasoningGymTask(EpochStreamMixin):
    """One reasoning-gym generator as a task.

    Args:
        dataset: reasoning-gym dataset name (``chain_sum``, ``gsm_symbolic``, ...).
        seed: generator seed of the training set and order of the training stream.
        size: number of training items.
        eval_size: number of evaluation items.
        eval_seed: generator seed of the evaluation set (default ``seed + size``).
        config: the generator's own settings (for example ``{"min_terms": 2, "max_terms": 3}``).
        answer_format: ``"tag"`` or ``"plain"`` (module docstring).
    """

    def __init__(
        self,
        dataset: str = "chain_sum",
        seed: int = 0,
        size: int = 10_000,
        eval_size: int = 100,
        eval_seed: int | None = None,
        config: dict[str, Any] | None = None,
        answer_format: AnswerFormat = "tag",
    ) -> None:
        rg = _import_reasoning_gym()
        from reasoning_gym.factory import DATASETS

        if dataset not in DATASETS:
            raise ValueError(
                f"unknown reasoning-gym dataset {dataset!r}; choose one of: {', '.join(sorted(DATASETS))}"
            )
        if answer_format not in ("tag", "plain"):
            raise ValueError(f"answer_format must be 'tag' or 'plain', got {answer_format!r}")
        if size < 1 or eval_size < 1:
            raise ValueError(f"size and eval_size must be >= 1, got size={size}, eval_size={eval_size}")
        settings = dict(config or {})
        clash = {"seed", "size"} & settings.keys()
        if clash:
            raise ValueError(f"set {sorted(clash)} as task arguments, not inside config")
        self.dataset = dataset
        self.name = f"reasoning_gym/{dataset}"
        self.seed = seed
        self.answer_format = answer_format
        self.eval_seed = seed + size if eval_seed is None else eval_seed
        try:
            self._splits = {
                "train": rg.create_dataset(dataset, seed=seed, size=size, **settings),
                "eval": rg.create_dataset(dataset, seed=self.eval_seed, size=eval_size, **settings),
            }
        except TypeError as e:  # an unknown generator setting: the config dataclass rejects it
            fields = sorted(getattr(DATASETS[dataset][1], "__dataclass_fields__", {}))
            raise ValueError(
                f"bad config for reasoning-gym {dataset!r} ({e}); its settings are {fields}"
            ) from e
        from reasoning_gym.utils import extract_answer

        self._extract_tagged = extract_answer
        self._entry = functools.lru_cache(maxsize=8192)(self._make_entry)

    def _make_entry(self, split: str, item: int) -> dict[str, Any]:
        return self._splits[split][item]

    @property
    def train_size(self) -> int:
        return len(self._splits["train"])

    def _problem(self, split: str, item: int) -> Problem:
        entry = self._entry(split, item)
        prompt = entry["question"] + (TAG_INSTRUCTION if self.answer_format == "tag" else "")
        return Problem(problem_id(self.name, split, item), prompt, str(entry["answer"]), split, item)

    def train_problem(self, item: int) -> Problem:
        return self._problem("train", item)

    def eval_set(self) -> list[Problem]:
        return [self._problem("eval", i) for i in range(len(self._splits["eval"]))]

    def extract(self, response: str) -> str | None:
        """The answer text the scorer sees (``None`` when a tagged answer is missing)."""
        if self.answer_format == "tag":
            return self._extract_tagged(response)
        lines = response.strip().splitlines()
        return lines[0].strip() if lines else ""

    def score(self, problem: Problem, response: str) -> float:
        dataset = self._splits[problem.split]
        reward = dataset.score_answer(
            answer=self.extract(response), entry=self._entry(problem.split, problem.item)
        )
        return check_reward(reward, f"reasoning-gym {self.dataset}.score_answer")
