"""The dataflow service against a real nats-server, with scripted rollout nodes and trainers in-process.

Regulation (task budget, trainer backlog, staleness, deadlines), per-policy routing,
accounting, synchronous mode, autoscale publication and restart. Nothing waits on wall time:
helpers step the service loop until a condition holds, with a bound on the number of turns.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from factories import a_keyframe_announcement, honest

from astraflow.config import parse_recipe
from astraflow.dataflow import issuing
from astraflow.dataflow.autoscale import Meter
from astraflow.dataflow.ingest import BUSY_PULL_WAIT_S, PULL_WAIT_S
from astraflow.dataflow.service import Dataflow
from astraflow.streams.dataflow_state import Accounting, DataflowState
from astraflow.streams.messages import (
    Batch,
    DataflowStats,
    Heartbeat,
    RolloutStats,
    Suspect,
    Task,
    TrainerStats,
    Trajectory,
)
from astraflow.streams.plane import NatsOptions, Plane, Topology
from astraflow.streams.state import AutoscaleRecord, FateRecord, VersionRecord
from astraflow.streams.trajectories import TrainingBatch, fetch_batch
from astraflow.streams.trajectory_log import TrajectoryLog

Reward = Callable[[Task, str, int], float]


def recipe(policies: tuple[str, ...] = ("solver",), **dataflow: Any):
    df = {"group_size": 2, "groups_per_batch": 2, "max_tasks_in_flight": 8, "max_staleness": 2, "max_batch_backlog": 2, **dataflow}
    return parse_recipe({"name": "t", "policies": list(policies), "data": {"n_train": 60, "n_eval": 10}, "dataflow": df})


def varied(task: Task, policy: str, i: int) -> float:
    return float(i % 2)  # rewards differ within every group


async def closed(what: str, closing: Awaitable[None], within: float = 30.0) -> None:
    """Wait for ``closing`` up to ``within`` seconds (not ``wait_for``: its cancellation would wait on what hangs)."""
    task = asyncio.ensure_future(closing)
    done, _ = await asyncio.wait({task}, timeout=within)
    assert done, f"{what} did not close within {within:.0f}s"
    task.result()


class Harness:
    """One dataflow plus scripted nodes and trainers, each its own connection to the plane."""

    def __init__(self, url: str, run: str, r: Any, max_deliver: int = 20) -> None:
        self.url, self.run, self.recipe, self.max_deliver = url, run, r, max_deliver
        self.versions = {p: 0 for p in r.policy_names}
        self.batches: dict[str, list[TrainingBatch]] = {p: [] for p in r.policy_names}

    async def start(self) -> Harness:
        self.node = await Plane.connect(NatsOptions(url=self.url), self.run, "node")
        await self.node.ensure_topology(Topology(policies=self.recipe.policy_names, task_ack_wait=2.0, traj_ack_wait=2.0,
                                                 max_deliver=self.max_deliver))
        self.task_sub = self.node.consumer(self.node.names.task_stream, "raas", Task)
        self.trainer = await Plane.connect(NatsOptions(url=self.url), self.run, "trainer")
        self.batch_subs = {p: self.trainer.consumer(self.trainer.names.batch_stream, self.trainer.names.trainer_consumer(p), Batch)
                           for p in self.recipe.policy_names}
        await self.open_dataflow()
        return self

    async def open_dataflow(self) -> None:
        self.plane = await Plane.connect(NatsOptions(url=self.url), self.run, "dataflow")
        self.df = Dataflow(self.recipe, self.plane)
        await self.df.start()
        self.sub = TrajectoryLog(self.plane).reader()

    async def kill_dataflow(self) -> None:
        """Gone without a word: nothing flushed, nothing acked (like SIGKILL)."""
        await self.df.watch.stop()
        await self.plane._nc.close()

    async def close(self) -> None:
        """Every part stopped and closed; one that hangs fails the test at once, named, not at the suite's timeout."""
        await closed("the dataflow's subscriptions", self.df.watch.stop())
        for name, p in (("dataflow", self.plane), ("node", self.node), ("trainer", self.trainer)):
            await closed(f"the {name}'s connection", p.close())

    async def turn(self, n: int = 1) -> None:
        for _ in range(n):
            await self.df.step(self.sub)

    async def until(self, cond: Callable[[], bool], turns: int = 60) -> None:
        for _ in range(turns):
            if cond():
                return
            await self.turn()
        assert cond(), "condition not reached"

    async def rollout(self, reward: Reward = varied, policies: tuple[str, ...] | None = None, version: int | None = None,
                      limit: int = 64) -> list[Task]:
        """Serve the tasks on the pool: one group per policy, tokens of ``version`` (default: the node is current)."""
        got = await self.task_sub.pull(batch=limit, timeout=0.3)
        out = []
        for d in got:
            t = d.msg
            for p in policies or self.recipe.policy_names:
                v = self.versions[p] if version is None else version
                out += [(self.node.names.traj(p), Trajectory(
                    traj_id=f"{t.task_id}.{p}.{i}", task_id=t.task_id, prompt_id=t.prompt_id, policy=p, index=i, group_size=t.group_size,
                    **honest(t, reward(t, p, i)), logprobs=np.full(4, -0.5, np.float32),
                    versions=np.full(4, v, np.int32), loss_mask=np.ones(4, np.uint8), reward=reward(t, p, i)), None)
                    for i in range(t.group_size)]
        await self.node.publish_many(out)
        for d in got:
            await d.ack()
        return [d.msg for d in got]

    async def fail(self, reason: str = "workflow failed 20x: boom") -> list[Task]:
        """A node gives up on the tasks it pulls: DLQ with the reason, then term."""
        got = await self.task_sub.pull(batch=64, timeout=0.3)
        for d in got:
            await d.reject(reason)
        return [d.msg for d in got]

    async def train(self, policy: str, limit: int = 64,
                    suspects: Callable[[TrainingBatch], list[Suspect]] | None = None) -> list[TrainingBatch]:
        """Take what is queued for ``policy``, fetch the trajectories each manifest names (as a trainer does, every
        one checked to be the one named), announce a version per batch (last), with what ``suspects`` says its token
        check left out."""
        got = await self.batch_subs[policy].pull(batch=limit, timeout=0.3)
        out = []
        for d in got:
            batch = await fetch_batch(self.trainer, d.msg)
            assert [(t.traj_id, t.task_id, t.policy) for t in batch.trajectories] == [(r.traj_id, r.task_id, policy) for r in d.msg.refs]
            self.versions[policy] += 1
            self.batches[policy].append(batch)
            out.append(batch)
            await self.announce(policy, self.versions[policy], [d.msg.batch_id], suspects(batch) if suspects else [])
            await d.ack()
        return out

    async def announce(self, policy: str, version: int, batch_ids: list[str], suspects: list[Suspect] | None = None) -> None:
        """A keyframe announcement as a trainer makes it (well formed: the dataflow follows only possible ones)."""
        ann = a_keyframe_announcement(version, policy).model_copy(update={"batch_ids": batch_ids, "suspects": suspects or []})
        await self.trainer.publish(self.trainer.names.weights(policy), ann, msg_id=f"{policy}-w{version}")
        await self.trainer.state.put(VersionRecord(policy=policy, version=version))
        self.versions[policy] = version

    async def heard(self, policy: str, version: int, timeout: float = 5.0) -> None:
        """Wait, without a turn, until the dataflow has received ``policy``'s announcement of ``version`` (a turn taken
        before it would still issue tasks with the older floors)."""
        deadline = time.monotonic() + timeout
        while (ann := self.df.watch.newest.get(policy)) is None or ann.version < version:
            assert time.monotonic() < deadline, f"the dataflow never heard {policy} v{version}"
            await asyncio.sleep(0.05)

    async def pending_tasks(self) -> int:
        return (await self.node.stored.lag(self.node.names.task_stream, "raas")).pending

    def acc(self, policy: str = "solver") -> Accounting:
        return self.df.accounting()[policy]


@pytest.fixture
async def harness(nats_server, run_id, request):
    h = await Harness(nats_server.url, run_id, request.param).start()
    yield h
    await h.close()


def with_recipe(**kw: Any):
    policies = kw.pop("policies", ("solver",))
    return pytest.mark.parametrize("harness", [recipe(policies, **kw)], indirect=True)


@with_recipe(max_staleness=1, max_tasks_in_flight=10)
async def test_tasks_in_flight_bounded_by_the_staleness_budget(harness: Harness, monkeypatch):
    monkeypatch.setattr(issuing, "LAG_READ_S", 0.0)  # no rest between lag reads: what gates them here is the budget
    # the pool's task lag is read from the server only in a turn the staleness budget lets issue
    reads = counted(harness.df.issuer.tasks, "backlog", lambda: harness.df.ledger.issued)
    await harness.turn(5)
    assert await harness.pending_tasks() == 4  # (max_staleness + 1) * groups_per_batch, below max_tasks_in_flight
    await harness.rollout(limit=1)  # one comes back and waits in the buffer: still counts against the budget
    await harness.turn(5)
    assert await harness.pending_tasks() == 3 and harness.acc().buffered == 1
    assert reads == [0]  # ten turns, one with room
    await harness.rollout(limit=1)  # a batch's worth: planned, out of the buffer, and the budget has room again
    await harness.turn()
    assert reads == [0, 4] and harness.df.ledger.issued == 6


class PullWaits:
    """The dataflow's TRAJ consumer, noting how long each of its pulls may wait."""

    def __init__(self, consumer: Any) -> None:
        self.consumer, self.waits = consumer, []

    async def pull(self, batch: int = 1, timeout: float = 1.0) -> list[Any]:
        self.waits.append(timeout)
        return await self.consumer.pull(batch, timeout)


@with_recipe(max_staleness=1, max_tasks_in_flight=4)
async def test_a_turn_waits_for_trajectories_only_after_a_turn_with_nothing_to_issue(harness: Harness):
    h = harness
    sub = PullWaits(h.sub)
    await h.df.step(sub)  # the first turn: tasks to issue at once
    assert h.df.ledger.issued == 4
    await h.df.step(sub)  # after a busy turn: takes what is there; the budget is spent
    await h.df.step(sub)  # after an idle turn: waits for trajectories
    assert sub.waits == [BUSY_PULL_WAIT_S, BUSY_PULL_WAIT_S, PULL_WAIT_S]
    await h.rollout(limit=2)  # two groups back: a batch to plan and tasks to issue
    await h.until(lambda: h.df.ledger.issued > 4)
    await h.df.step(sub)
    assert sub.waits[-1] == BUSY_PULL_WAIT_S


@with_recipe(max_staleness=50, max_tasks_in_flight=6)
async def test_tasks_bounded_by_the_measured_task_lag(harness: Harness):
    foreign = [(harness.node.names.task("single_turn"), Task(task_id=f"x{i}", workflow="single_turn", policy="solver", prompt_id="p",
                                                           prompt="1+1=", group_size=2), f"x{i}") for i in range(4)]
    await harness.node.publish_many(foreign)  # not ours, but they sit in the stream the pool reads
    reads = counted(harness.df.issuer.tasks, "backlog")
    await harness.turn(5)
    assert await harness.pending_tasks() == 6 and harness.df.ledger.issued == 2  # the lag allowed two more
    assert len(reads) == 5  # read in every turn while tasks beyond its own wait


@with_recipe(max_staleness=50, max_tasks_in_flight=6)
async def test_the_task_lag_is_read_seldom_while_every_waiting_task_is_its_own(harness: Harness, monkeypatch):
    """Each task of its own that waits is one it counts in flight: the lag cannot lower the budget below that count's,
    and is read once every ``LAG_READ_S``, not every turn."""
    monkeypatch.setattr(issuing, "LAG_READ_S", 600.0)
    reads = counted(harness.df.issuer.tasks, "backlog")
    await harness.turn(5)
    assert len(reads) == 1 and harness.df.ledger.issued == 6  # the budget the staleness bound and its own count allow


def counted(obj: Any, name: str, note: Callable[[], Any] = time.monotonic) -> list[Any]:
    """Wrap ``obj.name`` (a coroutine method) so each call is noted (``note()`` as it is called); the notes."""
    calls: list[Any] = []
    method = getattr(obj, name)

    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(note())
        return await method(*args, **kwargs)

    setattr(obj, name, wrapper)
    return calls


@with_recipe(policies=("solver", "verifier"), max_batch_backlog=1, max_tasks_in_flight=8, max_staleness=3)
async def test_policies_route_to_their_own_lanes_and_progress_independently(harness: Harness):
    for _ in range(8):  # the verifier's trainer is away; the solver's trains
        await harness.turn(2)
        await harness.rollout()
        await harness.turn(2)
        await harness.train("solver")
    df = harness.df
    assert len(harness.batches["solver"]) >= 3  # the solver kept going
    assert df.lanes["verifier"].batch_seq == 1  # one verifier batch waits: its backlog bound held serving back
    assert df.lanes["verifier"].stats["backpressure"] > 0
    for p, batches in harness.batches.items():
        assert all(t.policy == p for b in batches for t in b.trajectories) and all(b.policy == p for b in batches)
    await harness.until(lambda: len(df.lanes["verifier"].buffer()) >= 2)
    trained = await harness.train("verifier")  # the verifier's trainer comes back: its lane moves on
    assert [b.batch_id for b in trained] == ["verifier-b000001"]
    await harness.until(lambda: df.lanes["verifier"].batch_seq >= 2)
    solver_tasks = {t for b in harness.batches["solver"] for t in b.task_ids}
    assert len(solver_tasks) == 2 * len(harness.batches["solver"])  # no group trained twice
    await harness.until(lambda: df.accounting()["verifier"].fates.get("trained", 0) == 2)
    assert df.accounting()["solver"].adds_up and df.accounting()["verifier"].adds_up


@with_recipe(max_staleness=1, max_tasks_in_flight=4)
async def test_stale_groups_are_dropped_at_serving_and_counted(harness: Harness):
    await harness.turn(2)
    await harness.rollout(limit=1, version=0)  # one group of v0 tokens waits (a batch needs two)
    await harness.until(lambda: harness.acc().buffered == 1)
    await harness.announce("solver", 2, [])  # the trainer moved on (another dataflow's batches, say)
    await harness.until(lambda: harness.df.lanes["solver"].version == 2)
    await harness.rollout(limit=2, version=2)
    await harness.until(lambda: harness.acc().fates.get("dropped:stale") == 1)
    acc = harness.acc()
    assert acc.adds_up and acc.fates["dropped:stale"] == 1
    record = await harness.plane.state.get(FateRecord, "solver", "t00000001")
    assert record is not None and record.fate == "dropped:stale"


@pytest.mark.parametrize("policy", ["keep", "downweight", "drop"])
async def test_late_results_follow_the_late_policy(nats_server, run_id, policy: str):
    # every task's deadline is 1 ms after it is issued: a round trip through the server is always late
    h = await Harness(nats_server.url, run_id, recipe(task_timeout_s=0.001, late_policy=policy, late_weight=0.25,
                                                     max_tasks_in_flight=2, max_staleness=0)).start()
    try:
        await h.turn(2)
        assert all(t.deadline and t.deadline > t.created_at for t in await h.rollout())
        await h.until(lambda: sum(h.acc().late.values()) == 2)  # both groups back, each judged late
        late = h.acc().late
        if policy == "drop":
            assert late == {"dropped": 2} and h.acc().fates == {"dropped:expired": 2}
            return
        await h.until(lambda: h.df.lanes["solver"].batch_seq == 1)
        (batch,) = await h.train("solver")
        adv = batch.advantage_array()
        grpo = 1 / np.sqrt(2)  # rewards 0, 1: (r - mean) / std with the sample std
        assert np.allclose(np.abs(adv), grpo * (0.25 if policy == "downweight" else 1.0), atol=1e-3)
        assert late == {"kept" if policy == "keep" else "downweighted": 2}
    finally:
        await h.close()


@with_recipe(max_tasks_in_flight=8, max_staleness=1, algorithms={"filters": [{"type": "dynamic_sampling"}]})
async def test_every_task_has_a_fate_and_the_counts_add_up(harness: Harness):
    await harness.turn(2)
    await harness.fail()  # the first four fail on the node
    await harness.turn(2)
    solved_all: Reward = lambda t, p, i: 1.0  # noqa: E731  zero variance -> filtered
    await harness.rollout(reward=solved_all, limit=2)
    await harness.until(lambda: harness.acc().fates.get("failed:rollout") == 4)
    for _ in range(6):
        await harness.turn(2)
        await harness.rollout()
        await harness.turn(2)
        await harness.train("solver")
    await harness.until(lambda: harness.acc().fates.get("trained", 0) >= 4)
    acc = harness.acc()
    assert acc.fates["failed:rollout"] == 4 and acc.fates["filtered:zero_variance"] == 2
    assert acc.adds_up, acc
    in_states = acc.in_flight + acc.buffered + acc.awaiting + sum(acc.fates.values())
    assert in_states == acc.total == harness.df.ledger.issued
    failed = await harness.plane.state.get(FateRecord, "solver", "t00000001")
    assert failed is not None and failed.fate == "failed:rollout" and failed.error and "boom" in failed.error
    batch = harness.batches["solver"][0]
    trained = await harness.plane.state.get(FateRecord, "solver", batch.task_ids[0])
    assert trained is not None and (trained.fate, trained.batch, trained.version) == ("trained", batch.batch_id, 1)
    await harness.df.journal.commit()
    state = await harness.plane.state.get(DataflowState)
    assert state is not None and state.accounting["solver"] == acc  # what `astraflow status` shows


@with_recipe(mode="sync", max_tasks_in_flight=8, max_staleness=3)
async def test_sync_mode_releases_one_batch_per_version(harness: Harness):
    await harness.turn(4)
    first = await harness.rollout()
    assert len(first) == 2 and all(t.min_versions == {"solver": 0} for t in first)  # one batch worth, on-policy
    await harness.until(lambda: harness.df.lanes["solver"].batch_seq == 1)
    await harness.turn(4)
    assert await harness.pending_tasks() == 0  # nothing new until the batch is trained
    await harness.train("solver")
    await harness.until(lambda: harness.df.ledger.issued == 4)
    second = await harness.rollout()
    assert [t.min_versions for t in second] == [{"solver": 1}] * 2


@with_recipe(autoscale={"hi": 0.3, "lo": 0.05, "max_step": 1, "window_s": 60})
async def test_autoscale_advice_is_published(harness: Harness):
    for i in range(2):  # two live nodes of the pool
        await harness.node.beat(Heartbeat(worker_id=f"n{i}", pool="raas", stats=RolloutStats(gen_s=0.0)))
    await harness.until(lambda: len(harness.df.pool.nodes.live_ids(time.time())) == 2)
    for _ in range(3):  # no trainer has had a batch: it waits all the time
        await harness.df.measure(every_s=0)
    got: list[Heartbeat] = []

    sub = await harness.node.on_heartbeats(lambda hb: got.append(hb) if hb.role == "dataflow" else None)
    await harness.df.beat()
    advice = await harness.plane.state.get(AutoscaleRecord, "raas")
    assert advice is not None
    assert (advice.nodes, advice.target, advice.action, advice.wait_frac) == (2, 3, "up", 1.0)
    await harness.until(lambda: bool(got))
    stats = got[0].stats
    assert isinstance(stats, DataflowStats) and stats.autoscale_target == 3 and stats.autoscale_nodes == 2
    await sub.stop()
    # once the trainer reports its own waiting (cumulative wait_s), its slope is the wait fraction
    for ts, wait_s in [(1000.0, 0.0), (1010.0, 0.2)]:
        await harness.trainer.beat(Heartbeat(worker_id="trainer-solver", policy="solver", ts=ts, stats=TrainerStats(wait_s=wait_s)))
    await harness.until(lambda: len(harness.df.pool.trainer_wait.get("solver", Meter(1)).samples) == 2)
    assert harness.df.pool.wait_frac("solver") == pytest.approx(0.02)
    await harness.df.beat()
    advice = await harness.plane.state.get(AutoscaleRecord, "raas")
    assert advice is not None and (advice.action, advice.target) == ("hold", 2), (
        advice
    )  # below lo, but nothing measured says the pool is too big


@pytest.mark.parametrize("restart", [False, True])
async def test_a_task_acked_with_its_group_never_complete_is_settled_lost(nats_server, run_id, restart: bool):
    """A node acks its tasks after publishing one sample of each group of two: the tasks would hold their places in flight
    for good (enough of them and nothing is issued any more). The audit finds their messages gone from the TASK stream
    and, past the grace, settles them ``failed:lost``; after a restart it finds where they are by scanning the stream."""
    h = await Harness(nats_server.url, run_id, recipe()).start()
    try:
        await h.turn()
        issued = h.df.ledger.issued
        got = await h.task_sub.pull(batch=64, timeout=0.5)
        assert len(got) == issued == 6
        half = [(h.node.names.traj("solver"), Trajectory(
            traj_id=f"{d.msg.task_id}.solver.0", task_id=d.msg.task_id, prompt_id=d.msg.prompt_id, policy="solver", index=0,
            group_size=2, **honest(d.msg, 1.0), logprobs=np.full(4, -0.5, np.float32),
            versions=np.zeros(4, np.int32), loss_mask=np.ones(4, np.uint8), reward=1.0), None) for d in got]
        await h.node.publish_many(half)
        for d in got:
            await d.ack()
        if restart:
            await h.kill_dataflow()
            await h.open_dataflow()
        await h.until(lambda: h.acc().fates.get("failed:lost") == issued, turns=400)
        assert h.df.stats["lost_tasks"] == issued and h.acc().adds_up
        await h.turn()
        assert h.df.ledger.issued == 2 * issued  # their places in flight are free again
    finally:
        await h.close()


async def test_a_kept_group_whose_trajectories_never_come_back_after_a_restart_is_settled_lost(nats_server, run_id):
    """A group kept before a restart comes back by redelivery of its unacked trajectories. If they are gone (purged
    behind the dataflow's back), the group would count as buffered for good and shrink the issuing budget: the audit
    settles it ``failed:lost``."""
    h = await Harness(nats_server.url, run_id, recipe()).start()
    try:
        await h.turn()
        await h.rollout(limit=1)
        await h.until(lambda: h.acc().buffered == 1)
        await h.turn()  # committed: the state keeps it
        await h.kill_dataflow()
        await h.node._jsm.purge_stream(h.node.names.traj_stream)
        await h.open_dataflow()
        assert h.acc().buffered == 1
        await h.until(lambda: h.acc().fates.get("failed:lost") == 1, turns=400)
        assert h.acc().buffered == 0 and h.df.stats["lost_groups"] == 1 and h.acc().adds_up
    finally:
        await h.close()


async def test_a_task_the_server_gave_up_on_while_the_dataflow_was_down_still_fails(nats_server, run_id):
    """The server gives up on a task (max deliveries) while no dataflow listens: its advisory is kept in DLQ, so the next
    dataflow settles it ``failed:max_deliver`` and the task no longer holds a place in flight (which would shrink the
    budget for good: enough of them and nothing is issued any more)."""
    h = await Harness(nats_server.url, run_id, recipe(), max_deliver=2).start()
    try:
        await h.turn()
        issued = h.df.ledger.issued
        assert issued == len(h.df.in_flight) == 6  # the staleness budget: (2 + 1) batches of 2 groups
        await h.kill_dataflow()
        for _ in range(3):  # delivered twice, nak'ed twice: the third pull finds nothing, and the server gives up on all
            for d in await h.task_sub.pull(batch=64, timeout=0.5):
                await d.nak()
        await h.open_dataflow()
        found = [t for t in h.df.in_flight.out() if h.df.in_flight.ticket(t) is not None]
        assert len(found) == issued  # found in the task queue by the restart's scan (given up on, still there)
        await h.until(lambda: h.acc().fates.get("failed:max_deliver") == issued)
        await h.turn()
        assert h.df.ledger.issued == 2 * issued  # their places in flight are free again: as many more are out
        assert len(h.df.in_flight) == issued and h.acc().adds_up
        info = await h.plane._jsm.stream_info(h.plane.names.task_stream)
        assert info.state.messages == issued  # the given-up ones were removed from the work queue: only the new ones wait
        await h.kill_dataflow()
        await h.open_dataflow()  # replays the advisories: settled and removed already, nothing changes
        assert sum(h.df.in_flight.ticket(t) is not None for t in h.df.in_flight.out()) == issued
        await h.turn(3)
        assert h.acc().fates.get("failed:max_deliver") == issued and h.acc().adds_up
    finally:
        await h.close()


@with_recipe(max_tasks_in_flight=8, max_staleness=3,
             algorithms={"curators": [{"type": "greso"}], "server": {"type": "replay", "ratio": 0.5, "base": {"type": "fifo"}}})
async def test_restart_restores_state_and_rebuilds_a_planned_batch(harness: Harness):
    await harness.turn(2)
    await harness.rollout(limit=4)
    await harness.until(lambda: harness.df.lanes["solver"].batch_seq == 2)
    await harness.train("solver")
    await harness.turn(2)
    assert harness.df.lanes["solver"].pipeline.state()["server"][0]["state"]["memory"]  # replay remembers served groups
    publish_many = harness.plane.publish_many

    async def die(*args: Any, **kw: Any) -> None:
        raise ConnectionError("killed")

    harness.plane.publish_many = die  # type: ignore[method-assign]
    await harness.rollout(limit=2)
    with pytest.raises(ConnectionError):  # the next batch is planned (written ahead), then the dataflow dies publishing it
        await harness.until(lambda: False, turns=20)
    harness.plane.publish_many = publish_many  # type: ignore[method-assign]
    state = await harness.plane.state.get(DataflowState)
    assert state is not None
    saved = state.lanes["solver"]
    planned = list(saved.plans)  # the turn planned every batch the trainer's backlog allowed (max_batch_backlog 2)
    assert planned == [f"solver-b{n:06d}" for n in range(3, saved.batch_seq + 1)]
    assert saved.pipeline["curators"][0]["state"]["window"]["solver"]["n"] > 0  # GRESO has seen groups
    await harness.kill_dataflow()
    await harness.open_dataflow()  # restores, then publishes the planned batches under their ids
    after = harness.df.lanes["solver"]
    assert after.pipeline.state() == saved.pipeline  # plug-in state restored exactly
    assert after.batch_seq == saved.batch_seq and not after.plans and set(planned) <= set(after.awaiting())
    trained = await harness.train("solver")
    assert [b.batch_id for b in trained] == planned
    assert all(len(b.trajectories) == 4 for b in trained)  # each: 1 fresh + 1 replayed group
    await harness.until(lambda: harness.df.stats["redelivered_settled"] >= 2, turns=80)  # its trajectories come back: ignored
    for _ in range(4):
        await harness.turn(2)
        await harness.rollout()
        await harness.turn(2)
        await harness.train("solver")
    ids = [b.batch_id for b in harness.batches["solver"]]
    assert len(ids) == len(set(ids))
    fresh = [t for b in harness.batches["solver"] for t in b.task_ids[:1]]  # replay appends; fresh groups come first
    assert len(fresh) == len(set(fresh))
    assert harness.acc().adds_up


@with_recipe(max_tasks_in_flight=4, max_staleness=1)
async def test_status_shows_the_accounting_and_the_advice(harness: Harness):
    from rich.console import Console

    from astraflow.status import accounting_table, collect

    for _ in range(3):
        await harness.turn(2)
        await harness.rollout()
        await harness.turn(2)
        await harness.train("solver")
    await harness.until(lambda: harness.acc().fates.get("trained", 0) >= 2)
    await harness.df.beat()
    await harness.df.journal.commit()
    info = await collect(NatsOptions(url=harness.url), harness.run, "solver", listen=0.2)
    acc = info["accounting"]["solver"]
    assert acc == harness.acc() and acc.adds_up
    assert len(info["streams"]) == 5 and all(n is not None for n in info["streams"].values())  # every stream of the run
    assert set(info["lags"]) == {"task", "traj", "batch.solver"} and all(info["lags"].values())  # every pull, as the server counts
    assert info["autoscale"].pool == "raas" and info["autoscale"].target >= 0
    console = Console(record=True, width=120)
    console.print(accounting_table("solver", acc))
    text = console.export_text()
    assert "adds up" in text and f"issued │ {acc.total}".replace(" ", "") in text.replace(" ", "")
