"""Workflows by name: ``register_workflow`` records a workflow class and its option model,
``get_workflow`` builds the one a recipe's ``workflow:`` names.

A built-in workflow registers when its module is imported (``workflow_class`` imports them all).
A plug-in workflow registers the same way from a module in ``rollout.plugins``, which is imported
before the recipe is validated, so its options are checked at load:

    class CountdownOptions(Options):
        type: Literal["countdown"] = "countdown"
        max_turns: int = 2

    @register_workflow("countdown", CountdownOptions)
    class Countdown:
        policies = ("solver",)
        evaluation = "workflow"

        def __init__(self, reward: Reward, options: CountdownOptions) -> None: ...
        def run(self, tasks, policies, node_id) -> list[Trajectory]: ...
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, get_args

from astraflow.registry import WORKFLOW_OPTIONS, Options, type_name
from astraflow.rollout.rewards import Reward
from astraflow.rollout.workflows.base import Evaluation, Workflow

WorkflowClass = Callable[[Reward, Any], Workflow]
"""Builds a workflow from the recipe's reward and its options (the recipe's ``workflow:``)."""
WORKFLOWS: dict[str, WorkflowClass] = {}
BUILTIN = ("single_turn", "tools", "retrieval", "env", "multi_policy", "openai_agent")  # modules of this package


def register_workflow(name: str, options: type[Options] | None = None) -> Callable[[WorkflowClass], WorkflowClass]:
    """Register a workflow class under ``name``, with its option model (none: the one registered for the name,
    else a bare one that takes no options). The class declares ``policies`` and ``evaluation``."""
    if options is not None and type_name(options) != name:
        raise ValueError(f"workflow {name!r} registered with options of type {type_name(options)!r}")

    def deco(cls: WorkflowClass) -> WorkflowClass:
        roles, evaluation = getattr(cls, "policies", None), getattr(cls, "evaluation", None)
        if not (isinstance(roles, tuple) and roles and all(isinstance(r, str) for r in roles)):
            raise TypeError(f"workflow {name!r} must declare policies: the roles it calls, e.g. ('solver',)")
        if evaluation not in get_args(Evaluation):
            raise TypeError(f"workflow {name!r} must declare evaluation: one of {get_args(Evaluation)}")
        if options is None:
            WORKFLOW_OPTIONS.ensure(name)
        else:
            WORKFLOW_OPTIONS.register(options)
        WORKFLOWS[name] = cls
        return cls

    return deco


def workflow_class(name: str) -> WorkflowClass:
    for module in BUILTIN:  # cached after the first call; registers workflows and tools
        importlib.import_module(f"astraflow.rollout.workflows.{module}")
    try:
        return WORKFLOWS[name]
    except KeyError:
        raise ValueError(f"unknown workflow {name!r}; registered: {sorted(WORKFLOWS)}") from None


def get_workflow(options: Options | str | Mapping[str, Any], reward: Reward) -> Workflow:
    """The workflow ``options`` names, scoring with ``reward``; a bare name or a mapping is validated as in a recipe
    (``"single_turn"``, ``{"type": "multi_turn_tools", "max_turns": 3}``)."""
    parsed: Options = WORKFLOW_OPTIONS.parse(options)
    return workflow_class(parsed.type)(reward, parsed)


def evaluation_of(name: str) -> Evaluation:
    """How the evaluator scores the workflow ``name`` (its class says)."""
    evaluation: Evaluation = getattr(workflow_class(name), "evaluation")  # noqa: B009 (a class attribute of Workflow classes)
    return evaluation


def check_policies(name: str, policies: tuple[str, ...]) -> None:
    """A recipe's policies fill the workflow's roles one for one; anything else would leave a trainer without data."""
    roles = getattr(workflow_class(name), "policies")  # noqa: B009
    if len(policies) != len(roles):
        raise ValueError(f"workflow {name!r} calls {len(roles)} {'policy' if len(roles) == 1 else 'policies'} "
                         f"({', '.join(roles)}); the recipe has {len(policies)}: {', '.join(policies)}")
