"""jsonl_math: file validation with actionable errors, splits, math-verify grading from any thread."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from asyncrl.tasks import JsonlMathTask, MathVerifyGrader, make_task
from asyncrl.tasks.math_verifier import ChildProcess

RECORDS = [
    {"prompt": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}"},
    {"prompt": "Solve 2x = 10.", "answer": 5},
    {"prompt": "What is 0.1 * 30?", "answer": "3"},
    {"prompt": "Simplify sqrt(8).", "answer": "2\\sqrt{2}"},
    {"prompt": "What is 7 * 6?", "answer": "42"},
]


@pytest.fixture(scope="module")
def math_verify_loaded():
    """Pay math-verify's one-time import (sympy, about a second) outside the timed tests."""
    from asyncrl.tasks.math_verifier import grade_inline

    grade_inline("1", "1", None)


def _write(tmp_path, records, name="train.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return str(path)


def task_path(tmp_path):
    return str(tmp_path / "train.jsonl")


def _run_in_thread(fn):
    out: dict = {}

    def target():
        out["main"] = threading.current_thread() is threading.main_thread()
        out["value"] = fn()

    t = threading.Thread(target=target)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive() and out["main"] is False
    return out["value"]


def test_missing_file_raises_value_error_with_path_and_fix(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match=r"nope\.jsonl' does not exist.*set jsonl_math's `path`"):
        JsonlMathTask(path=missing)
    with pytest.raises(ValueError, match="`eval_path`"):
        JsonlMathTask(path=_write(tmp_path, RECORDS), eval_path=missing)


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("{not json", "is not valid JSON"),
        ('{"prompt": "x"}', "lacks a 'prompt' or an 'answer'"),
        ('{"prompt": "", "answer": "1"}', "empty or non-string prompt"),
        ('{"prompt": "x", "answer": [1]}', "answer of type list"),
        ('{"prompt": "x", "answer": " "}', "empty answer"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, line, match):
    path = _write(tmp_path, [RECORDS[0], line])
    with pytest.raises(ValueError, match=match) as info:
        JsonlMathTask(path=path, eval_size=1)
    assert f"{path}:2" in str(info.value)


def test_empty_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="holds no records"):
        JsonlMathTask(path=_write(tmp_path, ["", " "]))


def test_held_out_eval_set_is_disjoint_fixed_and_numbered(tmp_path):
    task = make_task("jsonl_math", path=_write(tmp_path, RECORDS), eval_size=2, seed=9)
    train = {task.train_problem(i).prompt for i in range(task.train_size)}
    ev = task.eval_set()
    assert task.train_size == 3 and len(ev) == 2 and not train & {p.prompt for p in ev}
    assert [p.id for p in ev] == ["jsonl_math/eval/0", "jsonl_math/eval/1"]
    assert ev == JsonlMathTask(path=task_path(tmp_path), eval_size=2, seed=1).eval_set()
    assert {p.answer for p in ev} | {task.train_problem(i).answer for i in range(3)} == {
        "\\frac{3}{4}",
        "5",
        "3",
        "2\\sqrt{2}",
        "42",
    }


def test_eval_path_and_prompt_template(tmp_path):
    task = JsonlMathTask(
        path=_write(tmp_path, RECORDS),
        eval_path=_write(tmp_path, RECORDS[:1], name="eval.jsonl"),
        prompt_template="Question: {prompt}\nAnswer:",
    )
    # the evaluation problem is also in the training file: it is removed from training
    assert task.train_size == 4 and len(task.eval_set()) == 1 and task.removed_from_train == 1
    assert task.eval_set()[0].prompt == "Question: What is 1/2 + 1/4?\nAnswer:"
    with pytest.raises(ValueError, match="prompt_template"):
        JsonlMathTask(path=task_path(tmp_path), prompt_template="no field")


def test_eval_size_must_leave_training_records(tmp_path):
    with pytest.raises(ValueError, match="lower eval_size or give an eval_path"):
        JsonlMathTask(path=_write(tmp_path, RECORDS), eval_size=5)


@pytest.mark.parametrize(
    ("gold", "response", "reward"),
    [
        ("\\frac{3}{4}", "The answer is \\boxed{0.75}", 1.0),
        ("\\frac{3}{4}", "so it is 3/4", 1.0),
        ("5", "x = 5", 1.0),
        ("2\\sqrt{2}", "$\\sqrt{8}$", 1.0),
        ("42", "\\boxed{41}", 0.0),
        ("42", "no idea", 0.0),
        ("42", "", 0.0),
    ],
)
def test_math_verify_grades_equivalent_forms_on_the_main_thread(math_verify_loaded, gold, response, reward):
    assert MathVerifyGrader(isolation="auto").grade(gold, response) == reward


def test_inline_grading_works_from_a_worker_thread_without_alarms(math_verify_loaded, tmp_path):
    task = JsonlMathTask(path=_write(tmp_path, RECORDS), eval_size=1, isolation="inline")
    problem = next(p for p in task.eval_set() + [task.train_problem(i) for i in range(4)] if p.answer == "42")
    assert _run_in_thread(lambda: (task.score(problem, "\\boxed{42}"), task.score(problem, "43"))) == (
        1.0,
        0.0,
    )
    assert task.grader._child._pool is None  # no process was started


def test_main_thread_auto_grading_starts_no_process(math_verify_loaded):
    grader = MathVerifyGrader()
    assert grader.grade("3", "3") == 1.0 and grader._child._pool is None


@pytest.mark.integration
def test_auto_grading_from_a_worker_thread_runs_in_a_child_with_working_timeouts(tmp_path):
    """Starts one spawned process (about half a second) and waits for math-verify's 1 s alarm."""
    grader = MathVerifyGrader(timeout_s=1)
    try:
        good = _run_in_thread(lambda: grader.grade("\\frac{1}{2}", "\\boxed{0.5}"))
        hang = _run_in_thread(lambda: grader.grade("5", "9^9^9^9"))  # sympy spins forever unbounded
        assert (good, hang) == (1.0, 0.0)
        # the child's own alarm fired: the child answered, the hard deadline (which counts a timeout) never hit
        assert grader.timeouts == 0 and grader._child.restarts == 0
        assert grader._child.pid() != os.getpid()
    finally:
        grader.close()


@pytest.mark.integration
def test_child_stuck_past_the_hard_deadline_is_replaced():
    child = ChildProcess(warm=os.getpid)
    try:
        first = child.call(os.getpid, (), 30)
        with pytest.raises(TimeoutError):
            child.call(time.sleep, (30,), 0.2)
        assert child.restarts == 1
        second = child.call(os.getpid, (), 30)
        assert first != second != os.getpid()
    finally:
        child.close()


def test_bad_grader_settings_raise_value_error():
    with pytest.raises(ValueError, match="isolation"):
        MathVerifyGrader(isolation="thread")
    with pytest.raises(ValueError, match="timeout_s"):
        MathVerifyGrader(timeout_s=0)
