"""What every workflow shares: ``run(tasks, policies, node_id) -> trajectories``, the handle it
holds of each policy, and the episode it builds turn by turn.

A workflow receives the tasks a node pulled and a handle per policy (engine + tokenizer +
sampling + the node's safe-point hook), and returns finished trajectories, each tagged with
the policy whose tokens it holds; the node publishes each on ``traj.{policy}``. Workflows are
blocking code; the node runs them off its event loop. A workflow class also declares the roles
it calls (``policies``) and how the evaluator scores it (``evaluation``).

Per-token arrays of a multi-turn episode (:class:`Episode`): generated tokens carry their
behaviour logprob, the version of the weights that produced them and ``loss_mask`` 1; tokens
the workflow inserts (tool output, environment observations) carry logprob 0, ``loss_mask`` 0
and the version of the turn before them, so a trajectory's oldest version is always the
oldest version that generated any of its tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import numpy as np

from astraflow.models import decode_text, encode_prompt
from astraflow.moe_routing import Routes
from astraflow.rollout.engines.base import Completion, Engine, GenerationRequest, SamplingParams, StaleWeights
from astraflow.streams.messages import RoutingLayout, Task, Trajectory
from astraflow.tasks import Problem


@dataclass
class PolicyHandle:
    """What a workflow holds of one policy: its engine, tokenizer, sampling and the node's safe point."""

    engine: Engine
    tokenizer: Any
    params: SamplingParams
    name: str = ""
    safe_point_fn: Callable[[], bool] | None = None  # set by the node: refresh weights now if any arrived
    context: int | None = None  # prompt + completion tokens the model takes (None: no bound)

    def requests(self, contexts: list[list[int]], params: SamplingParams) -> list[GenerationRequest]:
        """One request per context, each allowed no more new tokens than the model's context leaves."""
        if self.context is None:
            return [GenerationRequest(c, params) for c in contexts]
        return [GenerationRequest(c, replace(params, max_new_tokens=max(1, min(params.max_new_tokens, self.context - len(c)))))
                for c in contexts]

    def generate(self, requests: list[GenerationRequest], min_version: int = 0) -> list[Completion]:
        """Generate, refusing when the engine holds weights older than ``min_version`` (the task's bound)."""
        if self.engine.version < min_version:
            raise StaleWeights(f"{self.name or 'policy'} holds v{self.engine.version}, task needs >= v{min_version}")
        return self.engine.generate(requests)

    def safe_point(self) -> bool:
        """Between turns of an episode: let the node apply newly announced weights. True if they changed."""
        return bool(self.safe_point_fn()) if self.safe_point_fn else False

    def encode(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, text)

    def decode(self, ids: list[int]) -> str:
        return decode_text(self.tokenizer, ids)


def min_version(task: Task, policy: str) -> int:
    return int(task.min_versions.get(policy, 0))


@dataclass
class Episode:
    """One sample being built turn by turn: a prompt, then generated and inserted segments."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    turns: int = 0
    routing: Routes | None = None  # MoE: the last turn's routes, when its prompt was this episode's context

    def add_generated(self, c: Completion) -> None:
        context = len(self.prompt_ids) + len(self.ids)
        self.routing = c.routing if c.routing is not None and c.routing.positions == context + len(c.token_ids) - 1 else None
        self.ids += c.token_ids
        self.logprobs += c.logprobs
        self.versions += c.versions
        self.mask += [1] * len(c.token_ids)
        self.finish_reason = c.finish_reason
        self.turns += 1

    def add_inserted(self, ids: list[int]) -> None:
        """Tokens the model did not generate (tool output, observations): masked out of the loss."""
        last = self.versions[-1] if self.versions else -1
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [last] * len(ids)
        self.mask += [0] * len(ids)

    def context(self) -> list[int]:
        return self.prompt_ids + self.ids

    def fit(self, context: int | None) -> bool:
        """Cut the episode at the model's context (an observation may overflow it). True when no token is left for
        another turn: the episode ends there, ``length``. A trajectory never exceeds the context it is trained in."""
        if context is None:
            return False
        room = max(0, context - len(self.prompt_ids))
        if len(self.ids) < room:
            return False
        del self.ids[room:], self.logprobs[room:], self.versions[room:], self.mask[room:]
        self.finish_reason = "length"
        return True

    def trajectory(self, task: Task, policy: str, index: int, group_size: int, reward: float | None, node_id: str,
                   meta: dict[str, Any] | None = None) -> Trajectory:
        routing = None if self.routing is None else self.routing.head(len(self.prompt_ids) + len(self.ids) - 1)  # fit() cuts
        return make_trajectory(task, policy, index, group_size, self.prompt_ids, self.ids, self.logprobs, self.versions,
                               self.mask, reward, self.finish_reason, node_id, {"turns": self.turns, **(meta or {})}, routing)


def make_trajectory(task: Task, policy: str, index: int, group_size: int, prompt_ids: list[int], ids: list[int],
                    logprobs: list[float], versions: list[int], mask: list[int] | None, reward: float | None,
                    finish_reason: str, node_id: str, meta: dict[str, Any] | None = None, routing: Routes | None = None) -> Trajectory:
    """A trajectory with the id convention ``{task_id}.{policy}.{index}`` (the plane dedups on it); ``routing``: the
    experts its positions were routed to, when the engine recorded them."""
    wire: dict[str, Any] = {}
    if routing is not None and routing.positions:
        _, layers, k = routing.ids.shape
        wire = {"routing": routing.packed(), "routing_layout": RoutingLayout(layers=layers, top_k=k, experts=routing.experts)}
    return Trajectory(
        traj_id=f"{task.task_id}.{policy}.{index}", task_id=task.task_id, prompt_id=task.prompt_id, policy=policy,
        index=index, group_size=group_size, prompt_ids=np.asarray(prompt_ids, np.int32),
        completion_ids=np.asarray(ids, np.int32), logprobs=np.asarray(logprobs, np.float32),
        versions=np.asarray(versions, np.int32),
        loss_mask=np.asarray(mask if mask is not None else [1] * len(ids), np.uint8),
        reward=reward, finish_reason=finish_reason if finish_reason in ("stop", "length", "error") else "stop", node_id=node_id,
        created_at=time.time(), meta=dict(meta or {}), **wire,
    )


Evaluation = Literal["workflow", "single_turn", "team"]
"""How the evaluator scores a workflow's policy on held-out prompts. ``workflow``: each prompt is played
through the workflow with the evaluated policy alone (a tool-using agent is scored with its tools).
``single_turn``: the policy's single-turn answers are scored with the recipe's reward (a workflow that
needs partners, or agent code, is not replayed). ``team``: the workflow scores every policy and the team
itself, with every policy at the same version (the class has an ``evaluate`` method: :class:`TeamWorkflow`)."""
TEAM = "team"
"""The subject under which a team workflow's own held-out score is recorded, beside each policy's."""


class Workflow(Protocol):
    """What a workflow class declares and does (registered with ``astraflow.registry.WORKFLOWS``)."""

    @property
    def policies(self) -> tuple[str, ...]:
        """The roles it calls, in order (a class attribute); the recipe's policies fill them in order (the first solves)."""

    @property
    def evaluation(self) -> Evaluation:
        """How the evaluator scores it (a class attribute)."""

    def run(self, tasks: list[Task], policies: Mapping[str, PolicyHandle], node_id: str) -> list[Trajectory]: ...


class TeamWorkflow(Workflow, Protocol):
    """A workflow whose held-out evaluation plays the whole team (``evaluation = "team"``)."""

    def evaluate(self, problems: list[Problem], policies: Mapping[str, PolicyHandle], k: int,
                 temperature: float) -> dict[str, dict[str, float]]:
        """Scores by subject (each policy's name, and :data:`TEAM`): ``reward``, ``avg@k``, ``pass@k``, ``k``, ``n``.
        ``policies`` are in the recipe's order (the first solves); their handles sample as the rollout does."""


def by_policy(tasks: list[Task]) -> dict[str, list[Task]]:
    out: dict[str, list[Task]] = {}
    for t in tasks:
        out.setdefault(t.policy, []).append(t)
    return out
