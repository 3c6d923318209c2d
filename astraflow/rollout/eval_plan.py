"""What the evaluator records: the versions it evaluates and the subjects each evaluation is recorded under.

The launcher reads these to know when a run's evaluations are done, so they live apart from the evaluator itself,
whose module loads the model stack (torch, transformers: seconds of CPU the launcher would spend before any role
starts)."""

from __future__ import annotations

from astraflow.config import Recipe
from astraflow.rollout.workflows.base import TEAM
from astraflow.rollout.workflows.registry import evaluation_of


def eval_versions(recipe: Recipe) -> list[int]:
    """The versions evaluated: 0, every ``eval.every`` steps, and the last."""
    every, last = recipe.eval.every, recipe.policies[recipe.eval_policy].trainer.steps
    return sorted({0, last, *range(every, last, every)})


def eval_subjects(recipe: Recipe) -> tuple[str, ...]:
    """What gets an ``eval.{subject}.{version}`` record: the evaluated policy; for a team workflow, every policy
    and the team (``TEAM``)."""
    if evaluation_of(recipe.workflow, recipe.workflow_options) == "team":
        return (*recipe.policy_names, TEAM)
    return (recipe.eval_policy,)
