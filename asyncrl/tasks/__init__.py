"""Tasks: datasets and verifiable rewards (see docs/tasks.md).

Owns the ``Task`` contract (``base.py``), the synthetic addition tasks, JSONL math problems graded
with math-verify, reasoning-gym generators, and the ``TASKS`` registry with ``make_task``.
Importing this package is cheap: no torch, and math-verify / reasoning-gym load only when a task
that needs them is built or scores.
"""

from asyncrl.tasks.arithmetic import AdditionTask, addition, addition2
from asyncrl.tasks.base import EpochOrder, Problem, PromptCursor, Task
from asyncrl.tasks.jsonl_math import JsonlMathTask, load_jsonl_problems
from asyncrl.tasks.math_verifier import MathVerifyGrader, grade_inline
from asyncrl.tasks.reasoning import ReasoningGymTask
from asyncrl.tasks.registry import TASKS, make_task, task_parameters

__all__ = [
    "TASKS",
    "AdditionTask",
    "EpochOrder",
    "JsonlMathTask",
    "MathVerifyGrader",
    "Problem",
    "PromptCursor",
    "ReasoningGymTask",
    "Task",
    "addition",
    "addition2",
    "grade_inline",
    "load_jsonl_problems",
    "make_task",
    "task_parameters",
]
