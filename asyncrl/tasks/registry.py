"""Task registry: name -> factory, and ``make_task`` with errors that say what to change.

Owns: the ``TASKS`` dict (an explicit dict, no plugin magic; its names are ``asyncrl.constants.TASK_NAMES``,
which the configuration checks ``task.name`` against) and argument checking for it.

Must never: import a task's heavy dependency (math-verify, reasoning-gym) at import time; the
factories import them when a task is built.

Invariants: ``make_task`` raises ``ValueError`` (never ``KeyError`` / ``TypeError``) for an unknown
name or an argument the factory does not take, listing the valid choices.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from asyncrl.tasks.arithmetic import addition, addition2
from asyncrl.tasks.base import Task
from asyncrl.tasks.jsonl_math import JsonlMathTask
from asyncrl.tasks.reasoning import ReasoningGymTask

TASKS: dict[str, Callable[..., Task]] = {
    "addition": addition,
    "addition2": addition2,
    "jsonl_math": JsonlMathTask,
    "reasoning_gym": ReasoningGymTask,
}


def task_parameters(name: str) -> list[str]:
    """Keyword arguments the task ``name`` accepts."""
    return [p for p in inspect.signature(TASKS[name]).parameters if p != "self"]


def make_task(name: str, **kwargs: Any) -> Task:
    """Build task ``name`` with ``kwargs``; ``ValueError`` says what to change on bad input."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}")
    accepted = task_parameters(name)
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(f"task {name!r} takes no argument(s) {unknown}; it accepts {accepted}")
    signature = inspect.signature(TASKS[name])
    missing = [
        p.name
        for p in signature.parameters.values()
        if p.default is inspect.Parameter.empty and p.name not in kwargs
    ]
    if missing:
        raise ValueError(f"task {name!r} needs {missing} (for example task.{missing[0]}=...)")
    return TASKS[name](**kwargs)
