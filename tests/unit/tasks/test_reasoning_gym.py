"""reasoning_gym task: deterministic splits, prompt format, the package's own scorers."""

from __future__ import annotations

import pytest

from asyncrl.tasks import PromptCursor, ReasoningGymTask, Task, make_task

pytest.importorskip("reasoning_gym")


@pytest.fixture(scope="module")
def chain_sum() -> ReasoningGymTask:
    """Built once: importing reasoning-gym takes about a second."""
    return make_task("reasoning_gym", dataset="chain_sum", seed=5, size=200, eval_size=10)


def test_prompt_asks_for_a_tagged_answer_and_the_tag_is_scored(chain_sum):
    p = chain_sum.problem_at(0)
    assert p.prompt.endswith("between <answer> and </answer>.") and p.id.startswith(
        "reasoning_gym/chain_sum/train/"
    )
    assert chain_sum.score(p, f"thinking...\n<answer>{p.answer}</answer>") == 1.0
    assert chain_sum.score(p, f"<answer>{int(p.answer) + 1}</answer>") == 0.0
    assert chain_sum.score(p, p.answer) == 0.0  # no tag, no answer


def test_splits_are_fixed_and_use_different_generator_seeds(chain_sum):
    again = ReasoningGymTask(dataset="chain_sum", seed=5, size=200, eval_size=10)
    assert chain_sum.eval_set() == again.eval_set() and len(again.eval_set()) == 10
    assert chain_sum.eval_seed == 205
    train = [chain_sum.train_problem(i).prompt for i in range(10)]
    assert train != [p.prompt for p in chain_sum.eval_set()]
    assert isinstance(chain_sum, Task) and chain_sum.train_size == 200


def test_cursor_resume_continues_with_the_same_problem(chain_sum):
    cursor = PromptCursor(chain_sum)
    cursor.take(3)
    state = cursor.state_dict()
    nxt = cursor.next()
    resumed = PromptCursor(chain_sum)
    resumed.load_state_dict(state)
    assert resumed.next() == nxt and state["task"] == "reasoning_gym/chain_sum"


def test_plain_format_scores_the_first_line(chain_sum):
    plain = ReasoningGymTask(dataset="chain_sum", seed=5, size=20, eval_size=2, answer_format="plain")
    p = plain.problem_at(1)
    assert "<answer>" not in p.prompt
    assert plain.score(p, f" {p.answer}\nbecause ...") == 1.0
    assert plain.extract("") == ""


def test_gsm_symbolic_uses_its_own_scorer():
    task = ReasoningGymTask(dataset="gsm_symbolic", seed=0, size=5, eval_size=2)
    p = task.eval_set()[0]
    assert task.score(p, f"<answer>{p.answer}</answer>") == 1.0
    assert task.score(p, "<answer>-1</answer>") == 0.01  # gsm_symbolic's credit for a wrong number


def test_unknown_dataset_and_bad_config_raise_value_error():
    with pytest.raises(ValueError, match="choose one of: .*chain_sum"):
        ReasoningGymTask(dataset="no_such_generator")
    with pytest.raises(ValueError, match="its settings are .*max_terms"):
        ReasoningGymTask(dataset="chain_sum", config={"bogus": 1})
    with pytest.raises(ValueError, match="not inside config"):
        ReasoningGymTask(dataset="chain_sum", config={"seed": 1})


def test_without_partial_credit_a_superstring_of_the_answer_scores_zero():
    """letter_counting gives 0.5 to "11" when the count is 1: the hack a LoRA run found in 20 steps."""
    kw = {"dataset": "letter_counting", "seed": 0, "size": 50, "eval_size": 20, "answer_format": "last_number",
          "config": {"min_words": 1, "max_words": 3}}
    lenient, strict = ReasoningGymTask(**kw), ReasoningGymTask(**kw, partial_credit=False)
    problem = next(p for p in lenient.eval_set() if len(p.answer) == 1 and p.answer != "1")
    hack = f"The letter appears 1{problem.answer} times."
    assert lenient.score(problem, hack) == 0.5
    assert strict.score(problem, hack) == 0.0
    right = f"The letter appears {problem.answer} times."
    assert lenient.score(problem, right) == strict.score(problem, right) == 1.0


def test_partial_credit_is_a_setting_of_the_reasoning_gym_task_only():
    from asyncrl.config.loader import load_train_config

    cfg = load_train_config(["task=chain_sum", "task.partial_credit=false"])
    from asyncrl.tasks.scoring import task_kwargs

    assert task_kwargs(cfg)["partial_credit"] is False
    with pytest.raises(ValueError, match="task.partial_credit is for task.name=reasoning_gym"):
        load_train_config(["task.partial_credit=false"])
