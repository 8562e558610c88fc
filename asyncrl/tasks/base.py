"""The task contract: problems, verifiable rewards, a fixed evaluation set, a resumable prompt cursor.

Owns: ``Problem`` (what the controller sends to a worker and logs), the ``Task`` protocol every
task implements, ``EpochOrder`` (the deterministic order in which a finite training set is
visited) and ``PromptCursor`` (a position in that order with a checkpointable state; the controller
keeps its position as a plain int, ``ControllerCore.cursor``).

Must never: import torch or a tokenizer (prompts are plain text; the controller tokenizes them in the
model's prompt format, ``asyncrl/tasks/prompts.py``), touch the
network, or depend on wall-clock time or on the global ``random`` state.

Invariants:
- Formatting convention: ``Problem.prompt`` is the user's text (a chat template, if any, is added
  by the controller, never here) and the model's response is scored as the text generated after it, with the end
  of sequence token removed. For the character-level arithmetic tasks prompts look like ``"3+5="``
  and the expected response is ``"8"`` followed by EOS.
- ``score`` is a rule-based verifiable reward in ``[0, 1]``; it is a pure function of the problem
  and the response text and may be called from any thread.
- Determinism: ``problem_at(position)`` depends only on the task's arguments (seed included) and
  ``position``. Training visits the ``train_size`` items in epochs; each epoch is a fresh seeded
  permutation, so every item is seen once per epoch. ``PromptCursor.state_dict()`` holds the
  position, and a resumed cursor continues with exactly the problem the old one would have
  produced next.
- ``eval_set()`` returns the same list, in the same order, for the same task arguments.
- ``Problem.id`` is ``"{task}/{split}/{item}"``: the same problem content has the same id in
  every epoch, so the trajectory log can group repeats.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class Problem:
    """One prompt with its reference answer. All fields are plain values (msgpack/JSON friendly)."""

    id: str
    prompt: str
    answer: str
    split: str = "train"
    """``"train"`` or ``"eval"``."""
    item: int = 0
    """Index of the problem within its split (``Problem.id`` ends with it)."""


@runtime_checkable
class Task(Protocol):
    """What the controller needs from a task (see the module docstring for the conventions)."""

    name: str
    seed: int

    @property
    def train_size(self) -> int:
        """Number of distinct training problems."""
        ...

    def train_problem(self, item: int) -> Problem:
        """Training problem ``item`` in ``[0, train_size)``."""
        ...

    def problem_at(self, position: int) -> Problem:
        """Problem at ``position`` of the endless, epoch-shuffled training stream."""
        ...

    def sample_prompts(self, start: int, n: int) -> list[Problem]:
        """``[problem_at(start), ..., problem_at(start + n - 1)]``."""
        ...

    def score(self, problem: Problem, response: str) -> float:
        """Verifiable reward in ``[0, 1]`` of ``response`` (generated text, EOS removed)."""
        ...

    def eval_set(self) -> list[Problem]:
        """The fixed evaluation problems, always the same list in the same order."""
        ...


def problem_id(task: str, split: str, item: int) -> str:
    return f"{task}/{split}/{item}"


class EpochOrder:
    """Maps a stream position to an item of a finite set: epoch ``e = position // size`` visits
    all items in a permutation seeded by ``(seed, e)``. One epoch's permutation is cached."""

    def __init__(self, size: int, seed: int) -> None:
        if size < 1:
            raise ValueError(f"a training set needs at least one problem, got {size}")
        self.size = size
        self.seed = seed
        self._epoch = -1
        self._perm: list[int] = []

    def item(self, position: int) -> int:
        if position < 0:
            raise ValueError(f"stream position must be >= 0, got {position}")
        epoch, offset = divmod(position, self.size)
        if epoch != self._epoch:
            perm = list(range(self.size))
            random.Random(f"epoch:{self.seed}:{epoch}").shuffle(perm)
            self._epoch, self._perm = epoch, perm
        return self._perm[offset]


class EpochStreamMixin:
    """``problem_at`` / ``sample_prompts`` for tasks with ``train_size``, ``seed`` and
    ``train_problem``."""

    seed: int
    _order: EpochOrder | None = None

    def problem_at(self, position: int) -> Problem:
        if self._order is None:
            self._order = EpochOrder(self.train_size, self.seed)  # type: ignore[attr-defined]
        return self.train_problem(self._order.item(position))  # type: ignore[attr-defined]

    def sample_prompts(self, start: int, n: int) -> list[Problem]:
        return [self.problem_at(start + i) for i in range(n)]


class PromptCursor:
    """A position in a task's training stream, checkpointable (refuses a state saved for another task or seed)."""

    def __init__(self, task: Task, position: int = 0) -> None:
        if position < 0:
            raise ValueError(f"cursor position must be >= 0, got {position}")
        self.task = task
        self.position = position

    def next(self) -> Problem:
        problem = self.task.problem_at(self.position)
        self.position += 1
        return problem

    def take(self, n: int) -> list[Problem]:
        out = self.task.sample_prompts(self.position, n)
        self.position += n
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"task": self.task.name, "seed": self.task.seed, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["task"], state["seed"]) != (self.task.name, self.task.seed):
            raise ValueError(
                f"checkpoint cursor belongs to task {state['task']!r} with seed {state['seed']}, but the "
                f"config builds {self.task.name!r} with seed {self.task.seed}; resume with the same task "
                "settings or start a new run"
            )
        self.position = int(state["position"])


def check_reward(value: float, where: str) -> float:
    """Rewards leave a task only in ``[0, 1]``; anything else is a bug in the scorer."""
    if not 0.0 <= value <= 1.0:
        raise AssertionError(f"{where} returned reward {value}, outside [0, 1]")
    return float(value)
