"""A rollout node on a real nats-server: version-aware refresh, safe points mid-episode, draining.

Nodes run in-process (``RolloutNode.run``) with scripted engines; weights travel through the
real plane (``WeightPublisher`` → object store + announcement → the node's ``WeightSync``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from factories import a_task

from astraflow.config import parse_recipe
from astraflow.models import load_tokenizer
from astraflow.rollout.engines.base import SamplingParams
from astraflow.rollout.engines.testing import ScriptEngine
from astraflow.rollout.node import RolloutNode
from astraflow.rollout.rewards import get_reward
from astraflow.rollout.workflows.base import PolicyHandle
from astraflow.rollout.workflows.registry import get_workflow
from astraflow.rollout.workflows.single_turn import SingleTurn
from astraflow.rollout.workflows.tools import TOOLS
from astraflow.streams.messages import Task, Trajectory
from astraflow.streams.plane import Plane
from astraflow.streams.trajectories import carried
from astraflow.streams.trajectory_log import TrajectoryLog
from astraflow.weights.publish import WeightPublisher

TOK = load_tokenizer("byt5")
STATE = {"w": torch.arange(16, dtype=torch.float32).reshape(4, 4)}


def recipe(workflow: Any = "single_turn", **rollout: Any):  # noqa: ANN201
    return parse_recipe({"name": "w", "workflow": workflow, "rollout": {"tasks_per_generate": 2, **rollout},
                         "dataflow": {"group_size": 2}})


def task(i: int, **kw: Any) -> Task:
    return a_task(f"t{i}", answer="4", **{"prompt_id": f"p{i}", "prompt": "2+2=", **kw})


async def trajectories(plane: Plane, n: int, timeout: float = 30.0) -> list[Trajectory]:
    sub = TrajectoryLog(plane).reader()
    got: list[Trajectory] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len(got) < n and loop.time() < deadline:
        for d in await sub.pull(batch=64, timeout=0.5):
            got += carried(d.msg)
            await d.ack()
    return got


async def wait_until(pred, timeout: float = 30.0) -> None:  # noqa: ANN001
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


async def stream_drops_to(plane: Plane, n: int, timeout: float = 30.0) -> None:
    """Wait until the task stream holds ``n`` tasks (an ack reaches the WorkQueue stream asynchronously)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (left := await plane.stored.stream_msgs(plane.names.task_stream)) != n:
        assert loop.time() < deadline, f"the task stream holds {left} tasks, expected {n}"
        await asyncio.sleep(0.05)


def scripted_handles(reply) -> dict[str, PolicyHandle]:  # noqa: ANN001
    return {"solver": PolicyHandle(ScriptEngine(TOK, reply, version=-1), TOK, SamplingParams(max_new_tokens=64), name="solver")}


async def test_node_refuses_tasks_newer_than_its_weights_until_they_arrive(plane: Plane):
    pub = WeightPublisher(plane, "solver")
    await pub.publish(STATE, 0, force_keyframe=True)
    node = RolloutNode(recipe(), plane, "n1", handles=scripted_handles(lambda p: "4"), workflow=SingleTurn(get_reward("arithmetic")))
    stop = asyncio.Event()
    run = asyncio.create_task(node.run(stop))
    try:
        await plane.publish(plane.names.task("single_turn"), task(0, min_versions={"solver": 1}), "t0")
        await wait_until(lambda: node.stats["stale_naks"] >= 1)  # v0 is too old for t0: back to the pool
        assert node.stats["tasks"] == 0
        await pub.publish({"w": STATE["w"] + 1}, 1)
        got = await trajectories(plane, 2)
        assert [t.traj_id for t in sorted(got, key=lambda t: t.index)] == ["t0.solver.0", "t0.solver.1"]
        assert all(set(t.token_versions().tolist()) == {1} for t in got)  # served only once v1 was applied
    finally:
        stop.set()
        await run


async def test_refresh_lands_between_turns_and_versions_stay_true(plane: Plane):
    pub = WeightPublisher(plane, "solver")
    await pub.publish(STATE, 0, force_keyframe=True)
    loop = asyncio.get_running_loop()

    @TOOLS.register("train_step")
    def train_step(args: str, meta: dict) -> str:  # a trainer publishes v1 while the episode is at its tool call
        asyncio.run_coroutine_threadsafe(pub.publish({"w": STATE["w"] * 2}, 1), loop).result(30)
        return "published"

    def reply(prompt: str) -> str:
        return "<tool>train_step()</tool>" if "<result>" not in prompt else "4"

    r = recipe({"type": "multi_turn_tools", "tools": ["train_step"], "max_turns": 3})
    node = RolloutNode(r, plane, "n2", handles=scripted_handles(reply), workflow=get_workflow(r.workflow_options, get_reward("arithmetic")))
    stop = asyncio.Event()
    run = asyncio.create_task(node.run(stop))
    try:
        await plane.publish(plane.names.task("multi_turn_tools"), task(1, workflow="multi_turn_tools"), "t1")
        got = await trajectories(plane, 2)
    finally:
        stop.set()
        await run
        TOOLS.unregister("train_step")
    assert len(got) == 2 and node.stats["refreshes"] >= 1
    for t in got:
        v, m = t.token_versions(), t.mask()
        first = len(TOK("<tool>train_step()</tool>", add_special_tokens=False)["input_ids"])
        assert set(v[:first].tolist()) == {0} and set(v[m == 0].tolist()) == {0}
        assert set(v[first:][m[first:] == 1].tolist()) == {1}  # generated after the safe point applied v1
        assert t.reward == 1.0 and t.min_version == 0


class Gated:
    """A workflow that holds its tasks until the test opens the gate."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()

    def run(self, tasks: list[Task], policies: Mapping[str, PolicyHandle], node_id: str) -> list[Trajectory]:
        self.entered.set()
        self.gate.wait(60)
        return SingleTurn(get_reward("arithmetic")).run(tasks, policies, node_id)


@pytest.mark.parametrize("finishes", [True, False], ids=["finishes-in-time", "naks-after-drain-timeout"])
async def test_stopping_node_finishes_or_naks_what_it_holds(plane: Plane, finishes: bool):
    await WeightPublisher(plane, "solver").publish(STATE, 0, force_keyframe=True)
    wf = Gated()
    node = RolloutNode(recipe(drain_timeout=30.0 if finishes else 0.2), plane, "n3", handles=scripted_handles(lambda p: "4"), workflow=wf)
    stop = asyncio.Event()
    run = asyncio.create_task(node.run(stop))
    try:
        await plane.publish(plane.names.task("single_turn"), task(2), "t2")
        assert await asyncio.to_thread(wf.entered.wait, 30)
        stop.set()  # SIGTERM while holding t2
        if finishes:
            await wait_until(lambda: node.draining)
            wf.gate.set()
        await asyncio.wait_for(run, 60)
    finally:
        wf.gate.set()
        stop.set()
    names = plane.names
    if finishes:
        assert node.stats["tasks"] == 1 and len(await trajectories(plane, 2)) == 2
        assert await plane.stored.stream_msgs(names.task_stream) == 0  # acked after its trajectories were stored
    else:
        assert node.stats["drained_naks"] == 1 and node.stats["tasks"] == 0
        lag = await plane.stored.lag(names.task_stream, names.pool_consumer())
        assert lag.pending + lag.ack_pending == 1 and await plane.stored.stream_msgs(names.task_stream) == 1  # back in the pool
        assert await plane.stored.stream_msgs(names.traj_stream) == 0


class SlowOne:
    """A workflow whose task ``slow`` holds its slot until the test opens the gate; every other task is served at once."""

    def __init__(self) -> None:
        self.slow_entered = threading.Event()
        self.gate = threading.Event()

    def run(self, tasks: list[Task], policies: Mapping[str, PolicyHandle], node_id: str) -> list[Trajectory]:
        if any(t.task_id == "slow" for t in tasks):
            self.slow_entered.set()
            assert self.gate.wait(60), "the test never opened the gate"
        return SingleTurn(get_reward("arithmetic")).run(tasks, policies, node_id)


async def test_a_free_slot_is_refilled_while_a_slow_task_generates_and_draining_still_finishes_it(plane: Plane):
    await WeightPublisher(plane, "solver").publish(STATE, 0, force_keyframe=True)
    wf = SlowOne()
    node = RolloutNode(recipe(), plane, "n4", handles=scripted_handles(lambda p: "4"), workflow=wf)  # 2 slots
    names = plane.names
    stop = asyncio.Event()
    run = asyncio.create_task(node.run(stop))
    try:
        await plane.publish(names.task("single_turn"), task(0, task_id="slow"), "slow")
        assert await asyncio.to_thread(wf.slow_entered.wait, 30)
        for i in range(1, 6):  # five tasks through the one free slot while the slow one still generates
            await plane.publish(names.task("single_turn"), task(i), f"t{i}")
        got = await trajectories(plane, 10)
        assert sorted({t.task_id for t in got}) == ["t1", "t2", "t3", "t4", "t5"] and len(got) == 10
        await wait_until(lambda: node.stats["tasks"] == 5)  # each acked on its own, after its trajectories
        await stream_drops_to(plane, 1)  # only the slow one is left, held
        assert not wf.gate.is_set()
        stop.set()  # SIGTERM while the slow task is held: no new admissions, the slow one gets drain_timeout
        await wait_until(lambda: node.draining)
        await plane.publish(names.task("single_turn"), task(6), "t6")
        wf.gate.set()
        await asyncio.wait_for(run, 60)
    finally:
        wf.gate.set()
        stop.set()
    assert node.stats["tasks"] == 6 and node.stats["drained_naks"] <= 1  # t6 never served (at most fetched and given back)
    late = await trajectories(plane, 2)
    assert sorted(t.traj_id for t in late) == ["slow.solver.0", "slow.solver.1"]
    await stream_drops_to(plane, 1)  # slow acked; t6 still in the pool for another node
    lag = await plane.stored.lag(names.task_stream, names.pool_consumer())
    assert lag.pending + lag.ack_pending == 1


async def test_a_version_is_fetched_while_every_slot_generates_and_no_safe_point_reads_the_run_state(plane: Plane, monkeypatch):
    """The node's watch fetches and checks a version as it is announced, while its slots generate (before the next safe
    point); it learns of versions from its follower, never from ``version.{policy}`` in the run state."""
    reads: list[str] = []
    real_get = plane.state.get

    async def counted_get(model, *keys):  # noqa: ANN001, ANN202
        reads.append(model.__name__)
        return await real_get(model, *keys)

    monkeypatch.setattr(plane.state, "get", counted_get)
    pub = WeightPublisher(plane, "solver")
    await pub.publish(STATE, 0, force_keyframe=True)
    gate, entered = threading.Event(), threading.Event()

    def reply(prompt: str) -> str:
        entered.set()
        assert gate.wait(60), "the test never opened the gate"
        return "4"

    handles = scripted_handles(reply)
    node = RolloutNode(recipe(), plane, "n5", handles=handles, workflow=SingleTurn(get_reward("arithmetic")))  # 2 slots
    sync = node.weights.syncs["solver"]
    stop = asyncio.Event()
    run = asyncio.create_task(node.run(stop))
    try:
        for i in range(2):  # both slots taken, both generating (the second waits for the engine)
            await plane.publish(plane.names.task("single_turn"), task(i), f"t{i}")
        assert await asyncio.to_thread(entered.wait, 30)
        await wait_until(lambda: node.slots is not None and node.slots.free == 0)
        await pub.publish({"w": STATE["w"] + 1}, 1)
        await wait_until(lambda: sync.held.version == 1, timeout=10)  # fetched and checked while the slots generate
        assert handles["solver"].engine.version == 0  # installed only once the engine is free
        gate.set()
        first = await trajectories(plane, 4)
        assert {v for t in first for v in t.token_versions().tolist()} == {0}
        await wait_until(lambda: handles["solver"].engine.version == 1)
        for i in range(2, 4):
            await plane.publish(plane.names.task("single_turn"), task(i), f"t{i}")
        later = await trajectories(plane, 4)
        assert {v for t in later for v in t.token_versions().tolist()} == {1}
    finally:
        gate.set()
        stop.set()
        await run
    assert "VersionRecord" not in reads, f"the node read the run state for versions: {reads}"


async def test_a_generated_task_gives_its_slot_back_while_it_is_published(plane: Plane, monkeypatch):
    """One slot: the next task generates while the last one's trajectories are still being published; the last one is
    held (kept alive, drained) until it is settled, and acked only after its trajectories are stored."""
    await WeightPublisher(plane, "solver").publish(STATE, 0, force_keyframe=True)
    handles = scripted_handles(lambda p: "4")
    node = RolloutNode(recipe(tasks_per_generate=1), plane, "n6", handles=handles, workflow=SingleTurn(get_reward("arithmetic")))
    published = asyncio.Event()
    real_settle = node.outbox.settle

    async def slow_settle(d, trajs):  # noqa: ANN001, ANN202
        if d.msg.task_id == "t0":
            await published.wait()  # t0's publication takes as long as the test likes
        await real_settle(d, trajs)

    monkeypatch.setattr(node.outbox, "settle", slow_settle)
    stop = asyncio.Event()
    run = asyncio.create_task(node.run(stop))
    engine = handles["solver"].engine
    try:
        for i in range(2):
            await plane.publish(plane.names.task("single_turn"), task(i), f"t{i}")
        await wait_until(lambda: len(engine.calls) == 2)  # t1 generated in the slot t0 gave back
        assert node.slots is not None and node.slots.free == 1 and {d.msg.task_id for d in node.slots.held} == {"t0"}
        await stream_drops_to(plane, 1)  # t1 acked; t0 not, its trajectories not stored yet
        published.set()
        got = await trajectories(plane, 4)
        assert sorted({t.task_id for t in got}) == ["t0", "t1"]
        await stream_drops_to(plane, 0)
    finally:
        published.set()
        stop.set()
        await run
    assert node.stats["tasks"] == 2
