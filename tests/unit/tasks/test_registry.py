"""TASKS / make_task: names, argument errors, the Task contract, cheap import."""

from __future__ import annotations

import subprocess

import pytest

from asyncrl.constants import TASK_NAMES
from asyncrl.tasks import TASKS, Task, make_task


def test_registry_names_the_four_tasks():
    assert set(TASKS) == {"addition", "addition2", "jsonl_math", "reasoning_gym"}


def test_the_configuration_checks_task_names_against_the_registry():
    # asyncrl.config validates task.name without importing the tasks: the names it knows are the registry's
    assert tuple(TASKS) == TASK_NAMES


def test_unknown_task_lists_the_valid_names():
    with pytest.raises(ValueError, match="addition, addition2, jsonl_math, reasoning_gym"):
        make_task("subtraction")


def test_unknown_argument_lists_the_accepted_ones():
    with pytest.raises(ValueError, match=r"takes no argument\(s\) \['digits'\].*'eval_holdout'"):
        make_task("addition", digits=2)


def test_missing_required_argument_names_it():
    with pytest.raises(ValueError, match=r"needs \['path'\].*task.path="):
        make_task("jsonl_math")


def test_built_tasks_satisfy_the_task_protocol():
    for name in ("addition", "addition2"):
        task = make_task(name, seed=3)
        assert isinstance(task, Task) and task.name == name and task.seed == 3


def test_importing_tasks_loads_no_heavy_dependency(procs):
    code = (
        "import sys, asyncrl.tasks\n"
        "heavy = [m for m in ('torch', 'numpy', 'math_verify', 'sympy', 'reasoning_gym') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    child = procs.python("-c", code, stdout=subprocess.PIPE, text=True)
    stdout, _ = child.communicate(timeout=60)
    assert child.returncode == 0 and stdout.strip() == "[]"
