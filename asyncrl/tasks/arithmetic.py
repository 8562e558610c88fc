"""Synthetic addition tasks for the character-level tiny model: ``addition`` and ``addition2``.

Owns: the problem space (all ordered pairs of operands), the split into training and evaluation
problems, the prompt format and the exact-match scorer.

Must never: use a vocabulary beyond digits, ``'+'`` and ``'='`` in prompts and answers (the tiny
model's character vocabulary), or depend on anything but its arguments.

Invariants:
- Prompt ``f"{a}+{b}="``, answer ``str(a + b)``; the response scores 1.0 when, with surrounding
  whitespace removed, it equals the answer, else 0.0 (``"08"`` or ``"8 9"`` score 0).
- ``addition``: ``a, b`` in 0..9 (100 problems). The default evaluation set is the whole space
  (``eval_holdout=0``): evaluation measures mastery of all 100 sums and is *not* disjoint from
  training, because a 100-problem space has nothing meaningful to hold out.
- ``addition2``: ``a, b`` in 10..99 (8100 problems). The default evaluation set holds out 200
  problems that training never sees (disjoint).
- With ``eval_holdout=k > 0`` the evaluation set is ``k`` problems drawn with ``eval_seed`` (not the
  training ``seed``, so runs with different seeds evaluate on the same problems) and removed from
  training. Items are numbered in (a, b) order within each split.
"""

from __future__ import annotations

import random

from asyncrl.tasks.base import EpochStreamMixin, Problem, problem_id


class AdditionTask(EpochStreamMixin):
    """``a+b=`` with ``digits``-digit operands.

    Args:
        digits: 1 (operands 0..9) or 2 (operands 10..99).
        seed: order of the training stream.
        eval_holdout: problems held out for evaluation; 0 evaluates on the whole space.
        eval_seed: which problems are held out.
        name: the task's registry name (used in problem ids and checkpoints).
    """

    def __init__(
        self,
        digits: int = 1,
        seed: int = 0,
        eval_holdout: int = 0,
        eval_seed: int = 1234,
        name: str | None = None,
    ) -> None:
        if digits not in (1, 2):
            raise ValueError(f"addition supports digits=1 or digits=2, got {digits!r}")
        lo, hi = (0, 9) if digits == 1 else (10, 99)
        space = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
        if not 0 <= eval_holdout < len(space):
            raise ValueError(
                f"eval_holdout must be in [0, {len(space) - 1}] for {digits}-digit addition, got {eval_holdout}"
            )
        self.name = name or ("addition" if digits == 1 else f"addition{digits}")
        self.seed = seed
        self.digits = digits
        if eval_holdout == 0:
            self._train, self._eval = space, space
        else:
            held = set(random.Random(f"eval:{eval_seed}").sample(range(len(space)), eval_holdout))
            self._train = [p for i, p in enumerate(space) if i not in held]
            self._eval = [p for i, p in enumerate(space) if i in held]

    @property
    def train_size(self) -> int:
        return len(self._train)

    def _problem(self, split: str, item: int, pair: tuple[int, int]) -> Problem:
        a, b = pair
        return Problem(problem_id(self.name, split, item), f"{a}+{b}=", str(a + b), split, item)

    def train_problem(self, item: int) -> Problem:
        return self._problem("train", item, self._train[item])

    def eval_set(self) -> list[Problem]:
        return [self._problem("eval", i, pair) for i, pair in enumerate(self._eval)]

    def score(self, problem: Problem, response: str) -> float:
        return 1.0 if response.strip() == problem.answer else 0.0


def addition(seed: int = 0, eval_holdout: int = 0, eval_seed: int = 1234) -> AdditionTask:
    """Single-digit addition (the embedded default): 100 problems, evaluated on all of them."""
    return AdditionTask(digits=1, seed=seed, eval_holdout=eval_holdout, eval_seed=eval_seed, name="addition")


def addition2(seed: int = 0, eval_holdout: int = 200, eval_seed: int = 1234) -> AdditionTask:
    """Two-digit addition (10..99 + 10..99): 8100 problems, 200 held out for evaluation."""
    return AdditionTask(digits=2, seed=seed, eval_holdout=eval_holdout, eval_seed=eval_seed, name="addition2")
