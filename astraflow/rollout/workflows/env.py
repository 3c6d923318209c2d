"""``env_http``: play episodes against an environment server over HTTP (start / step / close).

Any server with the API of ``astraflow.rollout.envs.server`` works (ALFWorld- or WebShop-like
text environments); ``url: bundled`` (``EnvHttpOptions``) starts the bundled text games on a loopback
port inside each node. Per sample: ``/start`` with the task's seed (every sample of a group
faces the same instance: ``meta["seed"]``, else a hash of the prompt id), then per turn the
model writes one action line (a turn stops at a newline), ``/step`` returns the next
observation, which is appended as inserted tokens (loss_mask 0), and the node passes a safe
point. The episode ends when the environment says done or after ``max_turns`` turns;
``/close`` always runs. The reward is the sum of the environment's step rewards (the recipe's
reward function is not used: the environment is the verifier).
"""

from __future__ import annotations

import json
import urllib.request
import zlib
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from astraflow.registry import WORKFLOWS
from astraflow.rollout.rewards import Reward
from astraflow.rollout.workflows.base import Episode, Evaluation, PolicyHandle, by_policy, min_version
from astraflow.rollout.workflows.options import EnvHttpOptions
from astraflow.streams.messages import Task, Trajectory


class EnvClient:
    """Blocking JSON client of one environment server."""

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def call(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(f"{self.url}/{route}", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            return json.loads(resp.read())

    def start(self, env: str, seed: int) -> dict[str, Any]:
        return self.call("start", {"env": env, "seed": seed})

    def step(self, episode_id: str, action: str) -> dict[str, Any]:
        return self.call("step", {"episode_id": episode_id, "action": action})

    def close(self, episode_id: str) -> None:
        self.call("close", {"episode_id": episode_id})


def task_seed(task: Task) -> int:
    return int(task.meta["seed"]) if "seed" in task.meta else zlib.crc32(task.prompt_id.encode())


@WORKFLOWS.register("env_http", EnvHttpOptions)
class EnvHttp:
    policies = ("solver",)
    evaluation: Evaluation = "workflow"  # played in the environment
    uses_reward = False  # the environment is the verifier: a node does not ask the recipe's reward about the meta

    def __init__(self, reward: Reward, options: EnvHttpOptions) -> None:
        url = options.url
        if url == "bundled":  # each node (and the evaluator) serves the bundled games on a loopback port of its own
            from astraflow.rollout.envs.server import serve_in_thread

            self.server = serve_in_thread()
            url = self.server.url
        self.client = EnvClient(url)
        self.env = options.env
        self.max_turns = options.max_turns

    def run(self, tasks: list[Task], policies: Mapping[str, PolicyHandle], node_id: str) -> list[Trajectory]:
        out: list[Trajectory] = []
        for policy, group in by_policy(tasks).items():
            out += self.run_policy(group, policies[policy], policy, node_id)
        return out

    def run_policy(self, tasks: list[Task], h: PolicyHandle, policy: str, node_id: str) -> list[Trajectory]:
        params = replace(h.params, stop=tuple(dict.fromkeys((*h.params.stop, "\n"))))
        need = max(min_version(t, policy) for t in tasks)
        episodes: list[tuple[Task, int, str, Episode, dict[str, Any]]] = []
        try:
            for t in tasks:
                for i in range(t.group_size):
                    started = self.client.start(self.env, task_seed(t))
                    prompt = f"{t.prompt}\n{started['observation']}\n> ".lstrip()
                    episodes.append((t, i, started["episode_id"], Episode(h.encode(prompt)), {"reward": 0.0, "steps": 0}))
            active = [a for a in episodes if not a[3].fit(h.context)]
            for _turn in range(self.max_turns):
                comps = h.generate(h.requests([ep.context() for _, _, _, ep, _ in active], params), need)
                still = []
                for (t, i, eid, ep, acc), c in zip(active, comps):
                    ep.add_generated(c)
                    text = h.decode(c.token_ids)
                    action = text.strip().splitlines()[0] if text.strip() else ""
                    res = self.client.step(eid, action)
                    acc["reward"] += float(res.get("reward", 0.0))
                    acc["steps"] += 1
                    if res.get("done"):
                        ep.finish_reason = "stop"
                        continue
                    sep = "" if text.endswith("\n") else "\n"
                    ep.add_inserted(h.encode(f"{sep}{res['observation']}\n> "))
                    ep.finish_reason = "length"  # until the environment says done
                    if not ep.fit(h.context):  # a full context ends the episode here
                        still.append((t, i, eid, ep, acc))
                active = still
                if not active:
                    break
                h.safe_point()
        finally:
            for _, _, eid, _, _ in episodes:
                try:
                    self.client.close(eid)
                except OSError:
                    pass
        return [ep.trajectory(t, policy, i, t.group_size, acc["reward"], node_id, {"env": self.env, "steps": acc["steps"]})
                for t, i, _, ep, acc in episodes]
