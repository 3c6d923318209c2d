"""``openai_agent``: agent code of any kind generates through the node's OpenAI-compatible endpoint and is trained.

The node serves ``openai_facade.ChatFacade`` from its engines (``host``/``port`` of the
workflow's options; the address is logged and advertised in the node's heartbeat as
``stats.endpoint``). Every call under a sample's base URL is recorded (prompt ids, completion
ids, behaviour logprobs, versions); the recorded calls become the sample's trajectory
(``agent_sessions.sample_trajectory``): calls whose prompt extends an earlier call's prompt +
completion chain, the tokens in between masked out of the loss.

Two ways to run agents:

- ``agent: module:function`` — Python agent code in the node: the node pulls tasks as usual and
  calls ``agent(base_url, prompt, meta) -> answer`` for each sample (``concurrency`` at once); the
  answer is scored with the recipe's reward.
- ``agent: external`` — agents of any runtime pull the tasks from the plane themselves and open a
  session per task on the endpoint (``agent_sessions``): the node pulls no task, serves sessions,
  assembles each task's trajectories when its agent reports the outcome, and publishes them.

Either way an agent's failure is a scored failure (reward 0, ``finish_reason`` ``error``), never a
lost or dead-lettered task.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from importlib import import_module
from pathlib import Path
from typing import Any

from astraflow.registry import WORKFLOWS, load_file
from astraflow.rollout.rewards import Reward
from astraflow.rollout.workflows.agent_sessions import NodeServices, Outcome, TaskSessions, sample_trajectory
from astraflow.rollout.workflows.base import Evaluation, PolicyHandle, by_policy, min_version
from astraflow.rollout.workflows.openai_facade import ChatFacade
from astraflow.rollout.workflows.options import OpenAIAgentOptions
from astraflow.streams.messages import Task, Trajectory

Agent = Callable[[str, str, dict[str, Any]], str]
"""``agent(base_url, prompt, meta) -> final answer``: unchanged agent code pointed at the facade."""


def load_agent(spec: str) -> Agent:
    """The agent function ``module:function`` or ``path/to/file.py:function`` names (a recipe's file path is relative to
    its folder; the options checked the shape at load)."""
    module, _, name = spec.rpartition(":")
    if module.endswith(".py"):
        file_agent: Agent = getattr(load_file(Path(module)), name)
        return file_agent
    agent: Agent = getattr(import_module(module), name)
    return agent


@WORKFLOWS.register("openai_agent", OpenAIAgentOptions)
class OpenAIAgent:
    """Agents against the node's facade, one sample per base URL; in-process (``module:function``) or ``external``."""

    policies = ("solver",)
    evaluation: Evaluation = "single_turn"  # external agents: out of the evaluator's reach (see evaluation_for)

    @staticmethod
    def evaluation_for(options: OpenAIAgentOptions) -> Evaluation:
        """Agent code in the node is evaluated as it is trained: each held-out prompt played through the agent against a
        facade over the evaluator's weights. External agents run elsewhere: their policy is scored on single-turn answers."""
        return "single_turn" if options.agent == "external" else "workflow"

    def __init__(self, reward: Reward, options: OpenAIAgentOptions) -> None:
        self.reward = reward
        self.options = options
        self.external = options.agent == "external"
        self.agent = None if self.external else load_agent(options.agent)
        self.facade: ChatFacade | None = None
        self.sessions: TaskSessions | None = None

    def start(self, node: NodeServices) -> str:
        o = self.options
        self.facade = ChatFacade(node.handles, o.host, o.port, node.api_key, o.advertise_host)
        if self.external:
            self.sessions = TaskSessions(self.facade, self.reward, node, o.session_timeout)
            self.facade.sessions = self.sessions
        return self.facade.url

    def counters(self) -> dict[str, float]:
        if self.facade is None:
            return {}
        return {"gen_s": self.facade.gen_s, **(self.sessions.stats if self.sessions is not None else {})}

    def wait_idle(self, timeout: float) -> bool:
        return self.sessions is None or self.sessions.wait_idle(timeout)

    def close(self) -> None:
        if self.facade is not None:
            self.facade.close()

    def run(self, tasks: list[Task], policies: Mapping[str, PolicyHandle], node_id: str) -> list[Trajectory]:
        if self.agent is None:
            raise RuntimeError("agent: external — agents pull the tasks themselves; the node serves sessions and runs no episode")
        agent = self.agent
        if self.facade is None:  # not started by a node (tests, benchmarks): serve the handles given
            o = self.options
            self.facade = ChatFacade(policies, o.host, o.port, None, o.advertise_host)
        facade = self.facade
        out: list[Trajectory] = []
        for policy, group in by_policy(tasks).items():
            jobs = [(t, i, facade.open_sample(policy, min_version(t, policy))) for t in group for i in range(t.group_size)]

            def play(job: tuple[Task, int, str]) -> Outcome:
                t, _, token = job
                try:
                    return Outcome(answer=str(agent(facade.base_url(token), t.prompt, dict(t.meta))))
                except Exception as e:  # the agent failed on what the model said: a scored failure
                    return Outcome(error=f"{type(e).__name__}: {e}")

            with ThreadPoolExecutor(max_workers=self.options.concurrency) as pool:
                outcomes = list(pool.map(play, jobs))
            for (t, i, token), outcome in zip(jobs, outcomes, strict=True):
                out.append(sample_trajectory(t, policy, i, facade.close_sample(token), outcome, self.reward, policies[policy], node_id))
        return out
