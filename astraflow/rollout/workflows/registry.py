"""Building the workflow a recipe's ``workflow:`` names, from the workflow registry (``astraflow.registry.WORKFLOWS``).

A built-in workflow registers when its module is imported (the registry imports them on first use).
A plug-in workflow registers the same way from a module in ``rollout.plugins`` (imported before the
recipe is validated, so its options are checked at load) or from a package's entry point in the
group ``astraflow.workflow``. The class declares the roles it calls and how it is evaluated:

    class CountdownOptions(Options):
        type: Literal["countdown"] = "countdown"
        max_turns: int = 2

    @WORKFLOWS.register("countdown", CountdownOptions)
    class Countdown:
        policies = ("solver",)
        evaluation = "workflow"

        def __init__(self, reward: Reward, options: CountdownOptions) -> None: ...
        def run(self, tasks, policies, node_id) -> list[Trajectory]: ...
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, get_args

from astraflow.registry import WORKFLOWS, Options
from astraflow.rollout.rewards import Reward
from astraflow.rollout.workflows.base import Evaluation, Workflow

WorkflowClass = Callable[[Reward, Any], Workflow]
"""Builds a workflow from the recipe's reward and its options (the recipe's ``workflow:``)."""


def workflow_class(name: str) -> WorkflowClass:
    """The workflow class registered as ``name``, refused unless it declares ``policies`` and ``evaluation``."""
    cls: WorkflowClass = WORKFLOWS.get(name)
    roles, evaluation = getattr(cls, "policies", None), getattr(cls, "evaluation", None)
    if not (isinstance(roles, tuple) and roles and all(isinstance(r, str) for r in roles)):
        raise TypeError(f"workflow {name!r} must declare policies: the roles it calls, e.g. ('solver',)")
    if evaluation not in get_args(Evaluation):
        raise TypeError(f"workflow {name!r} must declare evaluation: one of {get_args(Evaluation)}")
    return cls


def get_workflow(options: Options | str | Mapping[str, Any], reward: Reward) -> Workflow:
    """The workflow ``options`` names, scoring with ``reward``; a bare name or a mapping is validated as in a recipe
    (``"single_turn"``, ``{"type": "multi_turn_tools", "max_turns": 3}``)."""
    parsed: Options = WORKFLOWS.parse(options)
    return workflow_class(parsed.type)(reward, parsed)


def evaluation_of(name: str, options: Options | None = None) -> Evaluation:
    """How the evaluator scores the workflow ``name``: its class says, or, when the class has ``evaluation_for``, its
    options do (``openai_agent``: agent code in the node is played, external agents are not)."""
    cls = workflow_class(name)
    chosen = getattr(cls, "evaluation_for", None)
    evaluation: Evaluation = chosen(options) if chosen is not None and options is not None else getattr(cls, "evaluation")  # noqa: B009
    return evaluation


def check_policies(name: str, policies: tuple[str, ...]) -> None:
    """A recipe's policies fill the workflow's roles one for one; anything else would leave a trainer without data."""
    roles = getattr(workflow_class(name), "policies")  # noqa: B009
    if len(policies) != len(roles):
        raise ValueError(f"workflow {name!r} calls {len(roles)} {'policy' if len(roles) == 1 else 'policies'} "
                         f"({', '.join(roles)}); the recipe has {len(policies)}: {', '.join(policies)}")
