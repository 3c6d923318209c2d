"""Workflows, registered by name: ``run(tasks, policies) -> trajectories``.

A workflow receives the tasks a node pulled and a handle per policy (engine + tokenizer +
sampling), and returns finished trajectories, each tagged with the policy whose tokens it
holds. Workflows are blocking code; the worker runs them off its event loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from astraflow.models import encode_prompt
from astraflow.rollout.engine import Engine, GenerationRequest, SamplingParams
from astraflow.rollout.rewards import Reward
from astraflow.streams.messages import Task, Trajectory


@dataclass
class PolicyHandle:
    engine: Engine
    tokenizer: Any
    params: SamplingParams


class Workflow(Protocol):
    def run(self, tasks: list[Task], policies: Mapping[str, PolicyHandle], node_id: str) -> list[Trajectory]: ...


WORKFLOWS: dict[str, Callable[[Reward], Workflow]] = {}


def register(name: str) -> Callable[[Callable[[Reward], Workflow]], Callable[[Reward], Workflow]]:
    def deco(factory: Callable[[Reward], Workflow]) -> Callable[[Reward], Workflow]:
        WORKFLOWS[name] = factory
        return factory

    return deco


def get_workflow(name: str, reward: Reward) -> Workflow:
    try:
        return WORKFLOWS[name](reward)
    except KeyError:
        raise ValueError(f"unknown workflow {name!r}; registered: {sorted(WORKFLOWS)}") from None


@register("single_turn")
class SingleTurn:
    """RLVR: one generation per sample, scored by a verifiable reward. All tasks in one batch."""

    def __init__(self, reward: Reward) -> None:
        self.reward = reward

    def run(self, tasks: list[Task], policies: Mapping[str, PolicyHandle], node_id: str) -> list[Trajectory]:
        by_policy: dict[str, list[Task]] = {}
        for t in tasks:
            by_policy.setdefault(t.policy, []).append(t)
        out: list[Trajectory] = []
        for policy, group in by_policy.items():
            h = policies[policy]
            prompts = [encode_prompt(h.tokenizer, t.prompt) for t in group]
            reqs = [GenerationRequest(p, h.params) for p, t in zip(prompts, group) for _ in range(t.group_size)]
            comps = iter(h.engine.generate(reqs))
            for prompt, task in zip(prompts, group):
                for i in range(task.group_size):
                    c = next(comps)
                    text = h.tokenizer.decode(c.token_ids, skip_special_tokens=True)
                    out.append(
                        Trajectory(
                            traj_id=f"{task.task_id}.{policy}.{i}", task_id=task.task_id, prompt_id=task.prompt_id,
                            policy=policy, index=i, group_size=task.group_size, prompt_ids=np.asarray(prompt, np.int32),
                            completion_ids=np.asarray(c.token_ids, np.int32), logprobs=np.asarray(c.logprobs, np.float32),
                            versions=np.asarray(c.versions, np.int32), loss_mask=np.ones(len(c.token_ids), np.uint8),
                            reward=self.reward(text, task.meta), finish_reason=c.finish_reason, node_id=node_id,
                            created_at=time.time(),
                        )
                    )
        return out
