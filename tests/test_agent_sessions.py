"""External agents: a node with ``openai_agent`` ``agent: external`` serves sessions; the agent pulls tasks itself.

The node runs in-process on a real nats-server with a scripted engine; weights travel through the
plane. The "agent" here is Python speaking only what a foreign runtime would: it pulls the raw task
bytes from the pool's durable consumer, posts the task's fields to ``/v1/sessions``, generates with
the official ``openai`` client, reports outcomes to ``/finish`` and acks.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

import msgpack
import openai
import pytest
import torch
from factories import a_task

from astraflow.config import parse_recipe
from astraflow.models import encode_prompt, load_tokenizer
from astraflow.rollout.engines.base import SamplingParams
from astraflow.rollout.engines.testing import ScriptEngine
from astraflow.rollout.node import RolloutNode
from astraflow.rollout.rewards import get_reward
from astraflow.rollout.workflows.base import PolicyHandle
from astraflow.rollout.workflows.registry import get_workflow
from astraflow.streams.messages import Heartbeat, RolloutStats, Task, Trajectory
from astraflow.streams.plane import Plane
from astraflow.streams.trajectories import carried
from astraflow.streams.trajectory_log import TrajectoryLog
from astraflow.weights.publish import WeightPublisher

TOK = load_tokenizer("byt5")
STATE = {"w": torch.zeros(2, 2)}
WORKFLOW = {"type": "openai_agent", "agent": "external"}


def http(method: str, url: str, body: Any = None, key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, json.dumps(body).encode() if body is not None else None, headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def task(i: int, group: int = 2, **kw: Any) -> Task:
    fields = {"workflow": "openai_agent", "prompt_id": f"p{i}", "prompt": f"{i}+1=", **kw}
    return a_task(f"t{i}", answer=str(i + 1), group_size=group, **fields)


class Node:
    """A node serving agent sessions, run on the test's event loop."""

    def __init__(self, plane: Plane, reply, key: str | None = None, **rollout: Any) -> None:
        recipe = parse_recipe({"name": "ext", "workflow": WORKFLOW, "reward": "arithmetic", "rollout": rollout})
        handles = {"solver": PolicyHandle(ScriptEngine(TOK, reply, version=-1), TOK, SamplingParams(max_new_tokens=16), name="solver")}
        self.node = RolloutNode(recipe, plane, "agent-host", handles=handles, agent_key=key,
                                workflow=get_workflow(recipe.workflow_options, get_reward("arithmetic")))
        self.stop = asyncio.Event()

    async def __aenter__(self) -> RolloutNode:
        self.run = asyncio.create_task(self.node.run(self.stop))
        while not self.node.endpoint:
            assert not self.run.done(), self.run.exception()
            await asyncio.sleep(0.05)
        return self.node

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        await asyncio.wait_for(self.run, 60)
        self.node.workflow.close()  # type: ignore[attr-defined]


async def pull_raw(plane: Plane, n: int = 1):
    """The pool's durable consumer, as a foreign agent binds it: raw bytes, decoded by hand."""
    sub = plane.consumer(plane.names.task_stream, plane.names.pool_consumer(), Task)
    got = []
    for _ in range(20):
        got += await sub.pull(batch=n - len(got), timeout=1.0)
        if len(got) == n:
            return got
    raise AssertionError("no task to pull")


def fields(delivery) -> dict:
    return msgpack.unpackb(delivery.data[1:], raw=False)["d"]


async def stored(plane: Plane, n: int) -> list[Trajectory]:
    sub = TrajectoryLog(plane).reader()
    got: list[Trajectory] = []
    for _ in range(20):
        for d in await sub.pull(batch=64, timeout=0.5):
            got += carried(d.msg)
            await d.ack()
        if len(got) >= n:
            break
    return sorted(got, key=lambda t: t.traj_id)


@pytest.fixture
async def weights(plane: Plane) -> WeightPublisher:
    pub = WeightPublisher(plane, "solver")
    await pub.publish(STATE, 0, force_keyframe=True)
    return pub


async def test_an_agent_pulls_a_task_opens_a_session_generates_and_the_node_publishes(plane: Plane, weights):
    beats: list[Heartbeat] = []
    sub = await plane.on_heartbeats(beats.append)
    await plane.publish_many([(plane.names.task("openai_agent"), t, t.task_id) for t in (task(1), task(2))])
    async with Node(plane, lambda p: f"{int(p.split('+')[0]) + 1}") as node:
        (d,) = await pull_raw(plane)
        status, opened = await asyncio.to_thread(http, "POST", f"{node.endpoint}/v1/sessions", {"task": fields(d), "agent": "py-1"})
        assert status == 200 and opened["task_id"] == "t1" and [s["index"] for s in opened["samples"]] == [0, 1]

        def play(base_url: str) -> str:
            c = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
            return c.completions.create(model="solver", prompt="1+1=").choices[0].text

        answers = [await asyncio.to_thread(play, s["base_url"]) for s in opened["samples"]]
        assert answers == ["2", "2"]
        report = {"samples": [{"index": 0, "reward": 0.25, "meta": {"tries": 1}}, {"index": 1, "answer": answers[1]}]}
        status, done = await asyncio.to_thread(http, "POST", f"{node.endpoint}/v1/sessions/{opened['session']}/finish", report)
        assert status == 200 and done == {"published": ["t1.solver.0", "t1.solver.1"], "rewards": [0.25, 1.0]}
        await d.ack()  # only now: the trajectories are stored
        while not any(isinstance(b.stats, RolloutStats) and b.stats.tasks == 1 for b in beats):
            await asyncio.sleep(0.1)
    await sub.stop()
    trajs = await stored(plane, 2)
    assert [t.traj_id for t in trajs] == ["t1.solver.0", "t1.solver.1"]
    for t in trajs:  # the node's tokens, logprobs and versions, not the agent's word
        assert t.prompt_tokens().tolist() == encode_prompt(TOK, "1+1=")
        assert TOK.decode(t.completion().tolist(), skip_special_tokens=True) == "2"
        assert t.behaviour_logprobs().tolist() == [-0.25] * 2 and t.token_versions().tolist() == [0, 0] and t.mask().all()
        assert t.meta["agent"] == "py-1" and t.node_id == "agent-host"
    assert trajs[0].meta["tries"] == 1 and trajs[1].reward == 1.0  # the agent's reward as is; an answer scored by the recipe's
    hb = next(b.stats for b in beats if isinstance(b.stats, RolloutStats) and b.stats.tasks == 1)
    assert hb.endpoint == node.endpoint and hb.trajectories == 2 and hb.counters["sessions_finished"] == 1
    lag = await plane.stored.lag(plane.names.task_stream, plane.names.pool_consumer())
    assert lag.pending == 1  # the node pulls no task itself: t2 waits for an agent


async def test_agent_failures_are_scored_never_lost(plane: Plane, weights):
    await plane.publish(plane.names.task("openai_agent"), task(3, group=3), "t3")
    async with Node(plane, lambda p: "4") as node:
        (d,) = await pull_raw(plane)
        status, opened = await asyncio.to_thread(http, "POST", f"{node.endpoint}/v1/sessions", {"task": fields(d)})
        base = opened["samples"][0]["base_url"]
        await asyncio.to_thread(lambda: openai.OpenAI(base_url=base, api_key="x").completions.create(model="m", prompt="3+1="))
        finish = f"{node.endpoint}/v1/sessions/{opened['session']}/finish"
        status, _ = await asyncio.to_thread(http, "POST", finish, {"samples": [{"index": 0, "reward": "1"}]})
        assert status == 400  # a malformed report is refused and the session stays open for a correct one
        status, done = await asyncio.to_thread(http, "POST", finish, {"samples": [{"index": 0, "error": "TypeError: boom"}]})
        assert status == 200 and done["rewards"] == [0.0, 0.0, 0.0]
        await d.ack()
        status, _ = await asyncio.to_thread(http, "POST", finish, {"samples": []})
        assert status == 404  # finished once
    trajs = await stored(plane, 3)
    assert [t.finish_reason for t in trajs] == ["error"] * 3
    assert [t.meta["agent_error"] for t in trajs] == ["TypeError: boom", "not reported by the agent", "not reported by the agent"]
    assert len(trajs[0].completion()) == 2 and len(trajs[1].completion()) == 0  # what was generated is kept; nothing is invented


async def test_a_node_with_older_weights_says_so_and_serves_once_they_arrive(plane: Plane, weights):
    async with Node(plane, lambda p: "4") as node:
        body = {"task": task(4, min_versions={"solver": 1}).model_dump(mode="json")}
        status, err = await asyncio.to_thread(http, "POST", f"{node.endpoint}/v1/sessions", body)
        assert status == 409 and err["error"]["type"] == "stale_weights" and (err["error"]["holds"], err["error"]["needs"]) == (0, 1)
        await weights.publish({"w": STATE["w"] + 1}, 1)
        status, opened = await asyncio.to_thread(http, "POST", f"{node.endpoint}/v1/sessions", body)  # the open refreshes first
        assert status == 200 and opened["version"] == 1
        status, _ = await asyncio.to_thread(http, "DELETE", f"{node.endpoint}/v1/sessions/{opened['session']}")
        assert status == 200  # given up: the agent naks the task
        bad_task = {"task": {**body["task"], "group_size": "2"}}
        status, err = await asyncio.to_thread(http, "POST", f"{node.endpoint}/v1/sessions", bad_task)
        assert status == 400 and "group_size" in err["error"]["message"]  # strict, as on the wire: dead-letter it
    assert node.stats["sessions_abandoned"] == 1 and node.stats["stale_refusals"] == 1


async def test_sessions_need_the_nodes_secret(plane: Plane, weights):
    async with Node(plane, lambda p: "4", key="s3cret") as node:
        body = {"task": task(5).model_dump(mode="json")}
        status, err = await asyncio.to_thread(http, "POST", f"{node.endpoint}/v1/sessions", body)
        assert status == 401 and "node's credential" in err["error"]["message"]
        status, _ = await asyncio.to_thread(http, "POST", f"{node.endpoint}/v1/sessions", body, "s3cret")
        assert status == 200


async def test_a_leaving_node_finishes_open_sessions_and_opens_no_new_one(plane: Plane, weights):
    ctx = Node(plane, lambda p: "4", drain_timeout=30.0)
    node = await ctx.__aenter__()
    try:
        body = {"task": task(6, group=1).model_dump(mode="json")}
        status, opened = await asyncio.to_thread(http, "POST", f"{node.endpoint}/v1/sessions", body)
        ctx.stop.set()  # SIGTERM while an agent holds a session
        while not node.draining:
            await asyncio.sleep(0.05)
        status, _ = await asyncio.to_thread(http, "POST", f"{node.endpoint}/v1/sessions", {"task": task(7).model_dump(mode="json")})
        assert status == 503  # the agent naks that task
        finish = f"{node.endpoint}/v1/sessions/{opened['session']}/finish"
        status, done = await asyncio.to_thread(http, "POST", finish, {"samples": [{"index": 0, "answer": "7"}]})
        assert status == 200 and done["published"] == ["t6.solver.0"]
    finally:
        await ctx.__aexit__()
    assert ctx.run.done() and node.stats["tasks"] == 1
