"""``single_turn``: RLVR, one generation per sample scored by a verifiable reward."""

from __future__ import annotations

from collections.abc import Mapping

from astraflow.registry import WORKFLOWS
from astraflow.rollout.engines.base import GenerationRequest
from astraflow.rollout.rewards import Reward
from astraflow.rollout.workflows.base import Evaluation, PolicyHandle, by_policy, make_trajectory, min_version
from astraflow.rollout.workflows.options import SingleTurnOptions
from astraflow.streams.messages import Task, Trajectory


@WORKFLOWS.register("single_turn", SingleTurnOptions)
class SingleTurn:
    """All tasks of one policy in one batched generate call."""

    policies = ("solver",)
    evaluation: Evaluation = "workflow"

    def __init__(self, reward: Reward, options: SingleTurnOptions | None = None) -> None:
        self.reward = reward

    def run(self, tasks: list[Task], policies: Mapping[str, PolicyHandle], node_id: str) -> list[Trajectory]:
        out: list[Trajectory] = []
        for policy, group in by_policy(tasks).items():
            h = policies[policy]
            prompts = [h.encode(t.prompt) for t in group]
            reqs = [GenerationRequest(p, h.params) for p, t in zip(prompts, group) for _ in range(t.group_size)]
            comps = iter(h.generate(reqs, max(min_version(t, policy) for t in group)))
            for prompt, task in zip(prompts, group):
                for i in range(task.group_size):
                    c = next(comps)
                    out.append(make_trajectory(task, policy, i, task.group_size, prompt, c.token_ids, c.logprobs, c.versions,
                                               None, self.reward(h.decode(c.token_ids), task.meta), c.finish_reason, node_id,
                                               routing=c.routing))
        return out
