"""A rollout node's task checks (``rollout/task_checks.py``) and the rewards' meta checks, as pure functions:
every task the run's dataflow issues passes, and each impossible value fails with its code."""

from __future__ import annotations

import math

import pytest
from factories import a_task
from hypothesis import given, settings
from hypothesis import strategies as st
from poison import RunView, draw_each, poisoned_tasks

from astraflow.config import load_recipe, parse_recipe
from astraflow.models import encode_prompt, load_tokenizer
from astraflow.rollout.rewards import REWARDS, meta_problem
from astraflow.rollout.task_checks import MAX_DEADLINE_S, TaskRules, check_content, check_prompt, check_task, check_versions
from astraflow.streams.messages import Task
from astraflow.tasks import load_split

TOK = load_tokenizer("byt5")
RECIPE = parse_recipe({"name": "c", "rollout": {"max_new_tokens": 4}, "dataflow": {"group_size": 4, "max_staleness": 2}})
RULES = TaskRules.of(RECIPE)


def count(policy: str, text: str) -> int:
    return len(encode_prompt(TOK, text))


def task(**over: object) -> Task:
    return a_task(1, prompt_id="add-1-2", group_size=4, **{"min_versions": {"solver": 3}, **over})


def problem(t: Task, newest: int = 5) -> str | None:
    found = check_task(t, RULES) or check_prompt(t.prompt, RULES, count) or check_versions(t, {"solver": newest}, RULES.window)
    return found.code if found else None


@pytest.mark.parametrize("path", ["arithmetic", "code", "search", "alfworld", "math-multi-agent", "code-multi-agent"])
def test_every_task_a_shipped_recipe_issues_passes(repo_root, path: str):
    from astraflow.rollout.workflows.registry import workflow_class

    r = load_recipe(repo_root / "recipes" / path)
    rules = TaskRules.of(r, getattr(workflow_class(r.workflow), "uses_reward", True))
    train, held_out = load_split(r.data)
    for p in train + held_out:
        t = Task(task_id="t00000001", workflow=r.workflow, policy=r.primary, prompt_id=p.prompt_id, prompt=p.prompt,
                 group_size=r.dataflow.group_size, meta=p.meta, min_versions={q: 0 for q in r.policy_names}, deadline=None)
        newest = {q: 0 for q in r.policy_names}
        found = check_task(t, rules) or check_prompt(t.prompt, rules, count) or check_versions(t, newest, rules.window)
        assert found is None, (p.prompt_id, found)


@settings(max_examples=50, deadline=None)
@given(newest=st.integers(0, 10**6), lag=st.integers(0, 2), timeout=st.one_of(st.none(), st.floats(0.001, 86400)))
def test_what_the_dataflow_issues_passes(newest: int, lag: int, timeout: float | None):
    t = task(min_versions={"solver": max(0, newest - lag)})
    t = t.model_copy(update={"deadline": None if timeout is None else t.created_at + timeout})
    assert problem(t, newest) is None
    assert problem(t, max(0, newest - RULES.window)) is None  # a node whose view of the newest version lags by the window


def test_each_impossible_field_names_its_code():
    view = RunView(vocab=384, group_size=4, max_new_tokens=4, context=64, newest=5)
    for p in draw_each(poisoned_tasks(task(), view), 5, at=7):
        if p.msg.group_size < 1:  # type: ignore[union-attr]
            continue  # the codec refuses it before any check (test_poison_fields: dead-lettered with the decode error)
        assert problem(p.msg) == p.expect.removeprefix("impossible task "), p.label  # type: ignore[arg-type]


def test_boundaries():
    assert problem(task(deadline=task().created_at + MAX_DEADLINE_S)) is None
    assert problem(task(deadline=math.inf)) == "time"
    assert problem(task(prompt="1" * 60)) is None and problem(task(prompt="1" * 61)) == "prompt"  # + 4 new tokens, a context of 64
    assert problem(task(min_versions={"solver": 7}), newest=5) is None and problem(task(min_versions={"solver": 8}), newest=5) == "version"
    assert problem(task(min_versions={}), newest=0) is None
    assert check_content("1+2=", {}, TaskRules.of(RECIPE, uses_reward=False)) is None  # an environment is its own verifier


META: dict[str, list[tuple[dict, bool]]] = {  # reward -> (meta, scorable)
    "arithmetic": [({"answer": "3"}, True), ({"answer": 12}, True), ({}, False), ({"answer": "x"}, False), ({"answer": [3]}, False),
                   ({"answer": "9" * 5000}, False), ({"answer": True}, False)],
    "math": [({"answer": "\\frac{1}{2}"}, True), ({}, False), ({"answer": None}, False)],
    "code": [({"tests": ["assert f(1) == 2"]}, True), ({"tests": ["assert f(1) == 2"], "setup": "import math", "timeout_s": 2}, True),
             ({"tests": []}, False), ({"tests": "assert 1"}, False), ({"tests": ["assert f(1) =="]}, False), ({"tests": ["x\0"]}, False),
             ({"tests": ["assert 1"], "timeout_s": math.nan}, False), ({"tests": ["assert 1"], "memory_mb": 10**9}, False),
             ({"tests": ["assert 1"], "reference": "def f(:"}, False), ({"tests": ["assert 1"], "setup": 3}, False)],
    "qa_em": [({"answer": "Paris"}, True), ({"answers": ["Paris", "paris"]}, True), ({"answers": [{}]}, False), ({}, False)],
    "reasoning_gym": [({"rg_task": "basic_arithmetic", "rg_size": 10, "rg_seed": 0, "rg_index": 3}, True),
                      ({"rg_task": "basic_arithmetic", "rg_size": 10**9, "rg_seed": 0, "rg_index": 3}, False),
                      ({"rg_task": "basic_arithmetic", "rg_size": 10, "rg_seed": 0, "rg_index": 10}, False), ({}, False)],
}


@pytest.mark.parametrize("reward", sorted(META))
def test_rewards_say_which_meta_they_can_score(reward: str):
    for meta, ok in META[reward]:
        assert (meta_problem(reward, meta) is None) == ok, (meta, meta_problem(reward, meta))


def test_every_built_in_reward_checks_its_meta_and_the_checks_agree_with_the_rewards():
    assert all(getattr(reward, "meta_check", None) for _, reward in REWARDS.items())
    assert REWARDS["arithmetic"]("3", {"answer": "3"}) == 1.0  # what the check passes, the reward scores
    with pytest.raises((KeyError, ValueError)):
        REWARDS["arithmetic"]("3", {"answer": "x"})  # what it refuses would have crashed the workflow
