"""Which pulled tasks a rollout node serves now (the I/O around ``task_checks.py``).

A task the node can never serve is dead-lettered (``dlq.task``) with its reason. A task whose
``min_versions`` floor lies above the newest version the node knows is first confirmed on the
plane (the node's view may lag a trainer that just announced); if the plane cannot be read, the
task waits rather than being turned away on a guess. A task newer than the node's weights is
nak'ed back with a 1 s delay.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from astraflow.models import encode_prompt
from astraflow.rollout.node_weights import NodeWeights
from astraflow.rollout.task_checks import TaskProblem, TaskRules, check_prompt, check_task, check_versions
from astraflow.rollout.workflows.base import PolicyHandle
from astraflow.streams.messages import Task
from astraflow.streams.plane import Delivery
from astraflow.streams.state import StateReadError

log = logging.getLogger(__name__)


class TaskGate:
    """Checks pulled tasks against ``rules`` and the node's ``weights``; counts into the node's ``stats``
    (``rejected_tasks``, ``stale_naks``)."""

    def __init__(self, rules: TaskRules, weights: NodeWeights, handles: Mapping[str, PolicyHandle], stats: dict[str, float]) -> None:
        self.rules = rules
        self.weights = weights
        self.handles = handles
        self.stats = stats

    async def admit(self, got: list[Delivery[Task]]) -> list[Delivery[Task]]:
        """The deliveries to serve now: impossible ones are dead-lettered, ones newer than the weights nak'ed (1 s)."""
        got = await self.servable(got)
        ready = [d for d in got if self.weights.ready_for(d.msg)]
        stale = [d for d in got if d not in ready]
        if stale:
            await asyncio.gather(*(d.nak(delay=1.0) for d in stale))
            self.stats["stale_naks"] += len(stale)
        return ready

    async def servable(self, got: list[Delivery[Task]]) -> list[Delivery[Task]]:
        """The deliveries this node can serve; the others go to the DLQ (``dlq.task``) with their reason."""
        out = []
        for d in got:
            problem = await self.problem(d.msg)
            if problem is None:
                out.append(d)
                continue
            self.stats["rejected_tasks"] += 1
            await d.reject(problem.reason)
        return out

    async def problem(self, task: Task) -> TaskProblem | None:
        """Why this node can never serve ``task``, or None."""
        problem = check_task(task, self.rules) or check_prompt(task.prompt, self.rules, self._count_tokens)
        if problem is not None or check_versions(task, self.weights.newest(), self.rules.window) is None:
            return problem
        try:
            await self.weights.confirm_newest()
        except StateReadError as e:  # not confirmed: the task waits (nak) rather than being turned away on a guess
            log.warning("cannot confirm the newest versions (%s); task %s waits", e, task.task_id)
            return None
        return check_versions(task, self.weights.newest(), self.rules.window)

    def _count_tokens(self, policy: str, text: str) -> int:
        return len(encode_prompt(self.handles[policy].tokenizer, text))
