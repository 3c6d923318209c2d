"""What a task may ask of a rollout node: the checks a node runs before it plays one (pure, no I/O).

The plane is open, so a node does not assume a task came from its run's dataflow. A task it
cannot serve sensibly is dead-lettered (``dlq.task``) with its reason and terminated, never
nak'ed forever nor allowed to crash a workflow it shares with other tasks; the dataflow settles
a task of its own that comes back this way ``failed:rollout``. Every bound below is one the run's
own dataflow keeps, so none of them turns a task of the run away:

| code | the task is turned away when |
|---|---|
| ``workflow`` | ``workflow`` is not the recipe's workflow |
| ``policy`` | ``policy`` is not the recipe's first policy (the dataflow issues every task for it), or ``min_versions`` |
|  | names a policy the recipe does not have |
| ``group_size`` | ``group_size`` is not the recipe's ``dataflow.group_size`` (the dataflow issues exactly that, and turns |
|  | away trajectories of any other; a bigger one would also make the node generate without bound) |
| ``version`` | a ``min_versions`` entry is more than ``dataflow.max_staleness`` above the newest version of that policy the |
|  | node could confirm on the plane: no node would ever hold such weights, so the task would be nak'ed forever |
| ``time`` | ``created_at`` is not finite; ``deadline`` is not finite, before ``created_at``, or more than |
|  | ``MAX_DEADLINE_S`` after it |
| ``prompt`` | more than ``MAX_CHARS_PER_TOKEN`` characters per position of the smallest context (not even encoded), or, |
|  | encoded, prompt + ``rollout.max_new_tokens`` longer than the context of a policy's model |
| ``meta`` | the recipe's reward cannot score it (the reward's own check, ``rewards.meta_problem``: a missing reference |
|  | answer, tests that do not parse, sandbox limits out of range), for workflows that score with the recipe's |
|  | reward (a workflow class with ``uses_reward = False``, like ``env_http``, is its own verifier) |

``group_size`` < 1 and undecodable tasks never get here: the codec refuses them (DLQ, ``Consumer.pull``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from astraflow.config import Recipe
from astraflow.models import model_limits
from astraflow.rollout.rewards import meta_problem
from astraflow.streams.messages import Task

MAX_DEADLINE_S = 7 * 24 * 3600.0  # the trajectory stream keeps a result this long; a later deadline means nothing
MAX_CHARS_PER_TOKEN = 32  # no tokenizer packs more characters into one token: a longer prompt is not even encoded


@dataclass(frozen=True)
class TaskProblem:
    code: str
    detail: str

    @property
    def reason(self) -> str:
        return f"impossible task {self.code}: {self.detail}"


@dataclass(frozen=True)
class TaskRules:
    """What any task of the run may ask, from the recipe (built once per node)."""

    workflow: str
    primary: str  # tasks are addressed to it
    policies: frozenset[str]
    group_size: int
    contexts: Mapping[str, int]  # per policy: positions of its model (prompt + completion)
    max_new_tokens: int
    window: int  # versions a task's floor may lie above the newest confirmed one (dataflow.max_staleness)
    reward: str | None  # the reward whose meta check applies; None: the workflow is its own verifier

    @classmethod
    def of(cls, recipe: Recipe, uses_reward: bool = True) -> TaskRules:
        return cls(workflow=recipe.workflow, primary=recipe.primary, policies=frozenset(recipe.policy_names),
                   group_size=recipe.dataflow.group_size,
                   contexts={p: model_limits(c.model).context for p, c in recipe.policies.items()},
                   max_new_tokens=recipe.rollout.max_new_tokens, window=recipe.dataflow.max_staleness,
                   reward=recipe.reward if uses_reward else None)

    @property
    def max_prompt_chars(self) -> int:
        return MAX_CHARS_PER_TOKEN * min(self.contexts.values())


def check_task(task: Task, rules: TaskRules) -> TaskProblem | None:
    """The checks that need nothing but the task and the run (the first that fails)."""
    if task.workflow != rules.workflow:
        return TaskProblem("workflow", f"workflow {task.workflow[:64]!r}, this run plays {rules.workflow!r}")
    if task.policy != rules.primary:
        return TaskProblem("policy", f"policy {task.policy[:64]!r}, this run's tasks are for {rules.primary!r}")
    unknown = sorted(p for p in task.min_versions if p not in rules.policies)
    if unknown:
        return TaskProblem("policy", f"min_versions names {unknown[:3]}, not policies of this run ({sorted(rules.policies)})")
    if task.group_size != rules.group_size:
        return TaskProblem("group_size", f"group_size {task.group_size}, this run's tasks have {rules.group_size}")
    return _times(task) or check_content(task.prompt, task.meta, rules)


def check_content(prompt: str, meta: dict[str, Any], rules: TaskRules) -> TaskProblem | None:
    """A prompt not absurdly long, and a ``meta`` the reward can score (also what the evaluator asks of held-out problems)."""
    if len(prompt) > rules.max_prompt_chars:
        return TaskProblem("prompt", f"a prompt of {len(prompt)} characters; the smallest context is {min(rules.contexts.values())}")
    if rules.reward is not None:
        why = meta_problem(rules.reward, meta)
        if why is not None:
            return TaskProblem("meta", f"reward {rules.reward}: {why[:300]}")
    return None


def _times(task: Task) -> TaskProblem | None:
    if not math.isfinite(task.created_at):
        return TaskProblem("time", f"created_at {task.created_at}")
    d = task.deadline
    if d is not None and not (math.isfinite(d) and 0 <= d - task.created_at <= MAX_DEADLINE_S):
        return TaskProblem("time", f"deadline {d} for a task created at {task.created_at} (at most {MAX_DEADLINE_S:g} s later)")
    return None


def check_prompt(prompt: str, rules: TaskRules, count_tokens: Callable[[str, str], int]) -> TaskProblem | None:
    """The encoded prompt leaves every policy's model room for ``max_new_tokens``; ``count_tokens(policy, text)``.
    A prompt whose UTF-8 bytes (+1) fit is not encoded: no tokenizer makes more tokens than that of a text."""
    if len(prompt.encode()) + 1 + rules.max_new_tokens <= min(rules.contexts.values()):
        return None
    for p in sorted(rules.policies):
        n = count_tokens(p, prompt)
        if n + rules.max_new_tokens > rules.contexts[p]:
            return TaskProblem("prompt", f"{n} prompt tokens + {rules.max_new_tokens} new ones, the context of {p}'s model is "
                                         f"{rules.contexts[p]}")
    return None


def check_versions(task: Task, newest: Mapping[str, int], window: int) -> TaskProblem | None:
    """No ``min_versions`` floor more than ``window`` above the newest version of its policy (``newest``)."""
    for p, floor in sorted(task.min_versions.items()):
        if floor > newest.get(p, -1) + window:
            return TaskProblem("version", f"needs {p} v{floor} or newer; the newest announced is v{newest.get(p, -1)}")
    return None
