"""Procedurally generated problems from the PyPI package ``reasoning-gym``, scored by its own scorers.

Owns: building a training and an evaluation dataset of one reasoning-gym generator (for example
``chain_sum`` or ``gsm_symbolic``), the prompt format, answer extraction, and the call to the
dataset's ``score_answer``.

Must never: import ``reasoning_gym`` at module import (it takes about a second and is optional:
``pip install reasoning-gym==0.1.25``), or rescale the package's rewards or grade by another rule (the
one change allowed is ``partial_credit=False``, below: the package's own verdict, made binary).

Invariants:
- reasoning-gym generates item ``i`` of a dataset with ``random.Random(seed + i)``. Training uses
  ``seed`` with ``size`` items; evaluation draws from the stream of ``eval_seed`` (default
  ``seed + size``) the first ``eval_size`` items whose question is not a training question, so the
  held-out set never overlaps the training stream (a generator whose space is too small for that is
  refused with the fix: widen ``config`` or lower ``size``).
- ``answer_format`` (``answers.py``) says how the answer is taken from a response, and what the prompt
  asks for: ``"tag"`` (default) appends an instruction to answer inside ``<answer>...</answer>`` and
  takes the tagged answer (several different tagged answers: none); ``"boxed"`` asks for
  ``\\boxed{}``; ``"last_number"`` feeds the question unchanged and takes the last number of the final
  line (an inconsistent equation chain or several different numbers there: none); ``"plain"`` feeds
  the question unchanged and takes the first line. No answer scores like an empty answer. Rewards are
  the package's own, in ``[0, 1]`` (``gsm_symbolic`` gives 0.01 to a numeric but wrong answer,
  ``chain_sum`` and ``letter_counting`` 0.5 to a superstring), or with ``partial_credit=False`` the
  package's verdict made binary: 1 when it scores the answer 1, else 0 (a superstring is a reward hack:
  a policy that answers "11" to every letter count earns half of every "1").
"""

from __future__ import annotations

import functools
from typing import Any, Literal

from asyncrl.tasks.answers import extract
from asyncrl.tasks.base import EpochStreamMixin, Problem, check_reward, problem_id

AnswerFormat = Literal["tag", "boxed", "last_number", "plain"]
TAG_INSTRUCTION = "\nGive only the final answer, between <answer> and </answer>."
INSTRUCTIONS = {"tag": TAG_INSTRUCTION, "boxed": "\nPut the final answer in \\boxed{}.", "last_number": "",
                "plain": ""}
EVAL_DRAW_FACTOR = 50
"""Evaluation candidates scanned per held-out item before the generator is called too small."""
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
        answer_format: ``"tag"``, ``"boxed"``, ``"last_number"`` or ``"plain"`` (module docstring).
        partial_credit: the package's partial scores as rewards; False: 1 only for a full score, else 0.
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
        partial_credit: bool = True,
    ) -> None:
        rg = _import_reasoning_gym()
        from reasoning_gym.factory import DATASETS

        if dataset not in DATASETS:
            raise ValueError(
                f"unknown reasoning-gym dataset {dataset!r}; choose one of: {', '.join(sorted(DATASETS))}"
            )
        if answer_format not in INSTRUCTIONS:
            raise ValueError(f"answer_format must be one of {', '.join(INSTRUCTIONS)}, got {answer_format!r}")
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
        self.partial_credit = bool(partial_credit)
        self.eval_seed = seed + size if eval_seed is None else eval_seed
        try:
            train = rg.create_dataset(dataset, seed=seed, size=size, **settings)
            draws = rg.create_dataset(dataset, seed=self.eval_seed, size=eval_size * EVAL_DRAW_FACTOR, **settings)
        except TypeError as e:  # an unknown generator setting: the config dataclass rejects it
            fields = sorted(getattr(DATASETS[dataset][1], "__dataclass_fields__", {}))
            raise ValueError(
                f"bad config for reasoning-gym {dataset!r} ({e}); its settings are {fields}"
            ) from e
        except (ValueError, AssertionError) as e:  # the generator's own validation of its settings
            raise ValueError(f"reasoning-gym {dataset!r} refused config {settings} ({e}); fix task.rg_config") from e
        seen = {train[i]["question"] for i in range(len(train))}
        self._eval_index: list[int] = []
        for j in range(len(draws)):
            if len(self._eval_index) == eval_size:
                break
            if draws[j]["question"] not in seen:
                self._eval_index.append(j)
        if len(self._eval_index) < eval_size:
            raise ValueError(
                f"reasoning-gym {dataset!r} with config {settings} found only {len(self._eval_index)} of "
                f"eval_size={eval_size} evaluation questions that are not among the {size} training items: its "
                "space is too small; widen task.rg_config (more terms or digits), lower task.size or lower "
                "task.eval_size")
        self._splits = {"train": train, "eval": draws}
        self._extract = functools.partial(extract, fmt=answer_format)
        self._entry = functools.lru_cache(maxsize=8192)(self._make_entry)

    def _make_entry(self, split: str, item: int) -> dict[str, Any]:
        return self._splits[split][item if split == "train" else self._eval_index[item]]

    @property
    def train_size(self) -> int:
        return len(self._splits["train"])

    def _problem(self, split: str, item: int) -> Problem:
        entry = self._entry(split, item)
        prompt = entry["question"] + INSTRUCTIONS[self.answer_format]
        return Problem(problem_id(self.name, split, item), prompt, str(entry["answer"]), split, item)

    def train_problem(self, item: int) -> Problem:
        return self._problem("train", item)

    def eval_set(self) -> list[Problem]:
        return [self._problem("eval", i) for i in range(len(self._eval_index))]

    def extract(self, response: str) -> str | None:
        """The answer text the scorer sees (``None`` when the response gives no single answer)."""
        return self._extract(response)

    def score(self, problem: Problem, response: str) -> float:
        dataset = self._splits[problem.split]
        reward = dataset.score_answer(
            answer=self.extract(response), entry=self._entry(problem.split, problem.item)
        )
        reward = check_reward(reward, f"reasoning-gym {self.dataset}.score_answer")
        return reward if self.partial_credit else float(reward >= 1.0)
