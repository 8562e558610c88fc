"""Real datasets through Hugging Face ``datasets`` (Parquet, Arrow, saved folders) with column mapping,
file errors that name the file, line and fix, held-out splits that never overlap training, and strict
graders that known reward hacks cannot fool."""

from __future__ import annotations

import json
import re

import pytest

from asyncrl.tasks import JsonlMathTask, ReasoningGymTask, make_task
from asyncrl.tasks.answers import extract, strict_equal, strict_score
from asyncrl.tasks.math_verifier import grade_inline

ROWS = [{"question": f"What is {a} + {b}?", "solution": str(a + b), "extra": a} for a, b in
        [(1, 2), (3, 4), (5, 6), (7, 8), (9, 1), (2, 2)]]

# (reference, response): each offers a wrong or several answers. math-verify accepts the marked ones.
HACKS = [
    ("5", "4 - 1 = 4 + 1 = 5", True),            # a restated (false) expression ending in the answer
    ("5", "3 or 5", True),                       # several candidates
    ("5", "{3, 5}", True),                       # a set of candidates
    ("12", "1, 2, ..., 12", True),               # every number up to the answer
    ("5", "2+3", True),                          # the question restated, not answered
    ("5", "<answer>3</answer> <answer>5</answer>", False),
    ("5", "\\boxed{3} or \\boxed{5}", False),
    ("5", "<answer>4 - 1 = 4 + 1 = 5</answer>", True),
    ("5", "<answer>3 or 5</answer>", True),
    ("5", "\\boxed{3, 5}", False),
]
HONEST = [
    ("5", {"tag": "<answer>5</answer>", "boxed": "so \\boxed{5}", "last_number": "The answer is 5."}),
    ("12", {"tag": "7 + 5 = 12\n<answer>12</answer>", "boxed": "$\\boxed{12}$", "last_number": "7 + 5 = 12"}),
    ("1000", {"tag": "<answer>1,000</answer>", "boxed": "\\boxed{1000}", "last_number": "It is 1,000 apples."}),
    ("0.75", {"tag": "<answer>3/4</answer>", "boxed": "\\boxed{\\frac{3}{4}}", "last_number": "x = 0.75"}),
]


@pytest.mark.parametrize(("gold", "response", "math_verify_accepts"), HACKS)
def test_known_reward_hacks_score_zero_under_every_strict_format(gold, response, math_verify_accepts):
    for fmt in ("tag", "boxed", "last_number"):
        assert strict_score(response, gold, fmt) == 0.0, (fmt, response)
    # the free-form grader is the one that can be talked into them
    assert grade_inline(gold, response, 5) == (1.0 if math_verify_accepts else 0.0)


@pytest.mark.parametrize(("gold", "responses"), HONEST)
def test_honest_answers_score_one_in_their_format(gold, responses):
    for fmt, response in responses.items():
        assert strict_score(response, gold, fmt) == 1.0, (fmt, response)


def test_strict_equal_is_exact_and_never_raises():
    assert strict_equal("-3", "-3.0") and strict_equal("\\text{Paris}.", "paris")
    assert not strict_equal("5x", "5") and not strict_equal(None, "5") and not strict_equal("", "")
    assert extract("", "last_number") is None and extract("no number", "last_number") is None
    assert extract("1/0 = 2", "last_number") == "2"  # a side that is not arithmetic is skipped


def test_jsonl_task_with_a_strict_format_refuses_the_hacks(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": r["question"], "answer": r["solution"]}) for r in ROWS))
    task = make_task("jsonl_math", path=str(path), eval_size=2, answer_format="last_number")
    p = task.train_problem(0)
    assert task.score(p, f"{p.prompt[8:-1]} = {p.answer}") == 1.0
    assert task.score(p, f"9 - 1 = {p.answer}") == 0.0  # inconsistent chain
    assert task.score(p, f"{int(p.answer) - 1} or {p.answer}") == 0.0
    with pytest.raises(ValueError, match="answer_format='plain' is not valid; choose one of: math_verify, tag"):
        JsonlMathTask(path=str(path), eval_size=2, answer_format="plain")


def _save_all_formats(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(ROWS)
    ds.to_parquet(str(tmp_path / "t.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    return {"parquet": tmp_path / "t.parquet", "arrow": arrow, "folder": tmp_path / "saved",
            "jsonl": tmp_path / "t.jsonl"}


def test_parquet_arrow_folder_and_jsonl_give_the_same_problems_with_column_mapping(tmp_path):
    files = _save_all_formats(tmp_path)
    tasks = {k: JsonlMathTask(path=str(v), eval_size=2, prompt_key="question", answer_key="solution",
                              answer_format="tag") for k, v in files.items()}
    ref = tasks["jsonl"]
    for task in tasks.values():
        assert task.eval_set() == ref.eval_set() and task.train_size == 4
        assert [task.train_problem(i) for i in range(4)] == [ref.train_problem(i) for i in range(4)]
    p = ref.train_problem(0)
    assert ref.score(p, f"<answer>{p.answer}</answer>") == 1.0


def test_missing_column_names_the_file_its_columns_and_the_key_to_set(tmp_path):
    files = _save_all_formats(tmp_path)
    with pytest.raises(ValueError, match=r"t\.parquet has no column 'prompt' \(its columns: question, solution, "
                                         r"extra\).*task\.prompt_key="):
        JsonlMathTask(path=str(files["parquet"]), eval_size=2)
    with pytest.raises(ValueError, match=r"t\.jsonl:1 lacks a 'prompt' or an 'answer' field.*task\.prompt_key="):
        JsonlMathTask(path=str(files["jsonl"]), eval_size=2)


def test_bad_files_are_refused_naming_file_line_and_fix(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "\xff\xfe"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2 is not UTF-8 text.*save the file as UTF-8"):
        JsonlMathTask(path=str(bad), eval_size=1)
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"not a parquet file")
    with pytest.raises(ValueError, match=r"cannot read .*empty\.parquet as a dataset.*task\.path="):
        JsonlMathTask(path=str(empty), eval_size=1)


def test_config_reaches_datasets_and_strict_graders_from_the_cli(tmp_path):
    from asyncrl.config.loader import load_train_config
    from asyncrl.tasks.scoring import task_kwargs

    files = _save_all_formats(tmp_path)
    cfg = load_train_config(["task=jsonl_math", f"task.path={files['parquet']}", "task.prompt_key=question",
                             "task.answer_key=solution", "task.answer_format=boxed", "task.eval_size=2"])
    task = make_task(cfg.task.name, **task_kwargs(cfg))
    assert task.answer_format == "boxed" and task.train_size == 4
    cfg = load_train_config(["task=chain_sum", "task.rg_config={min_terms:2,max_terms:2,max_digits:2}",
                             "task.answer_format=last_number", "task.size=300", "task.eval_size=8"])
    task = make_task(cfg.task.name, **task_kwargs(cfg))
    assert task.answer_format == "last_number" and task.train_size == 300
    assert all(len(re.findall(r"\d+", p.prompt.split(":")[1].split("=")[0])) == 2 for p in task.eval_set())


def test_reasoning_gym_eval_never_overlaps_training_and_small_spaces_are_refused():
    task = ReasoningGymTask(dataset="chain_sum", seed=0, size=500, eval_size=20,
                            config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2})
    train = {task.train_problem(i).prompt for i in range(task.train_size)}
    assert not train & {p.prompt for p in task.eval_set()}
    with pytest.raises(ValueError, match="space is too small; widen task.rg_config"):
        ReasoningGymTask(dataset="chain_sum", size=2000, eval_size=10,
                         config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})


def test_reasoning_gym_strict_formats():
    task = ReasoningGymTask(dataset="chain_sum", seed=1, size=50, eval_size=4, answer_format="last_number",
                            config={"min_terms": 2, "max_terms": 2, "max_digits": 2})
    p = task.eval_set()[0]
    assert "<answer>" not in p.prompt
    assert task.score(p, f"The sum is {p.answer}.") == 1.0
    assert task.score(p, f"{int(p.answer) + 1} or {p.answer}") == 0.0
    boxed = ReasoningGymTask(dataset="chain_sum", seed=1, size=50, eval_size=4, answer_format="boxed")
    q = boxed.eval_set()[0]
    assert q.prompt.endswith("\\boxed{}.") and boxed.score(q, f"\\boxed{{{q.answer}}}") == 1.0
    tag = ReasoningGymTask(dataset="chain_sum", seed=1, size=50, eval_size=4)
    r = tag.eval_set()[0]
    assert tag.score(r, f"<answer>{int(r.answer) + 1}</answer><answer>{r.answer}</answer>") == 0.0
