"""Addition tasks: prompt format, scorer, evaluation split, deterministic resumable stream."""

from __future__ import annotations

import string

import pytest

from asyncrl.tasks import AdditionTask, PromptCursor, addition, addition2

TINY_VOCAB = set(string.digits + "+-= ?" + string.ascii_lowercase)


def test_prompt_is_sum_with_equals_and_answer_is_the_digits():
    task = addition()
    problems = [task.train_problem(i) for i in range(task.train_size)]
    assert {(p.prompt, p.answer) for p in problems} >= {("3+5=", "8"), ("9+9=", "18"), ("0+0=", "0")}
    for p in problems + addition2().eval_set():
        assert set(p.prompt) <= TINY_VOCAB and set(p.answer) <= TINY_VOCAB
        a, b = p.prompt[:-1].split("+")
        assert p.prompt.endswith("=") and int(p.answer) == int(a) + int(b)


@pytest.mark.parametrize(
    ("response", "reward"),
    [("8", 1.0), (" 8\n", 1.0), ("08", 0.0), ("8 9", 0.0), ("9", 0.0), ("", 0.0), ("8=8", 0.0)],
)
def test_score_is_exact_match_after_stripping_whitespace(response, reward):
    task = addition()
    problem = next(p for p in task.eval_set() if p.prompt == "3+5=")
    assert task.score(problem, response) == reward


def test_single_digit_eval_set_is_the_whole_space_in_fixed_order():
    ev = addition(seed=1).eval_set()
    assert len(ev) == 100 and len({p.prompt for p in ev}) == 100
    assert [p.prompt for p in ev] == [p.prompt for p in addition(seed=7).eval_set()]
    assert ev[0].id == "addition/eval/0" and ev[0].split == "eval"


def test_two_digit_eval_set_is_held_out_of_training():
    task = addition2()
    train = {task.train_problem(i).prompt for i in range(task.train_size)}
    ev = {p.prompt for p in task.eval_set()}
    assert len(ev) == 200 and task.train_size == 8100 - 200
    assert not train & ev
    assert ev == {p.prompt for p in addition2(seed=5).eval_set()}  # independent of the training seed
    assert all(10 <= int(x) <= 99 for p in task.eval_set() for x in p.prompt[:-1].split("+"))


def test_holdout_makes_single_digit_eval_disjoint_when_asked():
    task = addition(eval_holdout=20)
    train = {task.train_problem(i).prompt for i in range(task.train_size)}
    assert len(task.eval_set()) == 20 and not train & {p.prompt for p in task.eval_set()}


def test_each_epoch_visits_every_training_problem_once_in_a_new_order():
    task = addition(seed=3)
    epoch0 = [p.id for p in task.sample_prompts(0, 100)]
    epoch1 = [p.id for p in task.sample_prompts(100, 100)]
    assert sorted(epoch0) == sorted(epoch1) == sorted({f"addition/train/{i}" for i in range(100)})
    assert epoch0 != epoch1


def test_stream_depends_only_on_seed_and_position():
    a, b, c = addition(seed=11), addition(seed=11), addition(seed=12)
    assert [a.problem_at(i) for i in (250, 3, 99)] == [b.problem_at(i) for i in (250, 3, 99)]
    assert a.sample_prompts(0, 20) != c.sample_prompts(0, 20)


def test_cursor_resume_continues_at_the_same_position():
    task = addition2(seed=4)
    cursor = PromptCursor(task)
    cursor.take(7)
    cursor.next()
    state = cursor.state_dict()
    expected = [cursor.next() for _ in range(5)]
    resumed = PromptCursor(addition2(seed=4))
    resumed.load_state_dict(state)
    assert state["position"] == 8 and resumed.take(5) == expected


def test_cursor_refuses_a_checkpoint_of_another_task_or_seed():
    state = PromptCursor(addition(seed=1), position=3).state_dict()
    with pytest.raises(ValueError, match="same task settings"):
        PromptCursor(addition(seed=2)).load_state_dict(state)
    with pytest.raises(ValueError, match="same task settings"):
        PromptCursor(addition2(seed=1)).load_state_dict(state)


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"digits": 3}, "digits"), ({"eval_holdout": 100}, "eval_holdout")]
)
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdditionTask(**kwargs)
