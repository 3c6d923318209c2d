"""The dataflow worker: feed tasks, ingest trajectories, apply data algorithms, serve batches.

One loop, plain and explicit (STYLE 6):

1. read each policy's current trainer version (run-state KV, written by trainers);
2. top up tasks while the number in flight stays under the staleness budget and the task
   stream's measured lag stays under its bound;
3. pull trajectories, route them by policy, assemble groups, run curator feedback and filters;
4. per policy, serve batches while that trainer's measured backlog is under its bound; ack the
   trajectories of a group only once the batch holding it is stored;
5. keep held deliveries alive (``in_progress``), heartbeat, persist counters.

Policies progress independently: each has its own buffer, plug-in pipeline, batch subject
and backlog; one slow trainer never holds back another's batches.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from astraflow.algorithms import Context, Pipeline, PromptItem, build_pipeline
from astraflow.config import Recipe
from astraflow.dataflow.groups import Assembler, HeldGroup, Ledger
from astraflow.runtime import every, stop_event
from astraflow.streams.messages import Batch, Heartbeat, Task, Trajectory
from astraflow.streams.plane import NatsOptions, Plane
from astraflow.tasks import Problem, load_split

log = logging.getLogger(__name__)


class PolicyLane:
    """Everything the dataflow keeps for one policy."""

    def __init__(self, name: str, pipeline: Pipeline) -> None:
        self.name = name
        self.pipeline = pipeline
        self.buffer: list[HeldGroup] = []
        self.recent: OrderedDict[str, HeldGroup] = OrderedDict()  # trained groups, for replay
        self.ledger = Ledger()
        self.version = 0
        self.batch_seq = 0
        self.stats: dict[str, float] = {}

    def state(self) -> dict[str, Any]:
        return {"batch_seq": self.batch_seq, "ledger": self.ledger.state(), "pipeline": self.pipeline.state()}

    def load_state(self, s: dict[str, Any]) -> None:
        self.batch_seq = s["batch_seq"]
        self.ledger.load_state(s["ledger"])
        self.pipeline.load_state(s["pipeline"])


class Dataflow:
    def __init__(self, recipe: Recipe, plane: Plane) -> None:
        self.recipe = recipe
        self.cfg = recipe.dataflow
        self.plane = plane
        self.primary = recipe.primary
        self.lanes = {p: PolicyLane(p, build_pipeline(self.cfg.algorithms)) for p in recipe.policy_names}
        self.train, _ = load_split(recipe.data)
        self.rng = random.Random(recipe.data.seed)
        self.assembler = Assembler()
        self.task_seq = 0
        self.cursor = 0
        self.in_flight: set[str] = set()

    @property
    def ledger(self) -> Ledger:
        """Task accounting of the primary policy (the one tasks are issued for)."""
        return self.lanes[self.primary].ledger

    # ------------------------------------------------------------ state
    def _state(self) -> dict[str, Any]:
        return {"task_seq": self.task_seq, "cursor": self.cursor, "in_flight": sorted(self.in_flight),
                "lanes": {p: lane.state() for p, lane in self.lanes.items()}, "ledger": self.ledger.state()}

    async def restore(self) -> None:
        s = await self.plane.state_get("dataflow")
        if not s:
            return
        self.task_seq, self.cursor, self.in_flight = s["task_seq"], s["cursor"], set(s["in_flight"])
        for p, lane_state in s["lanes"].items():
            if p in self.lanes:
                self.lanes[p].load_state(lane_state)
        log.info("dataflow restored: %d tasks issued", self.ledger.issued)

    async def persist(self) -> None:
        await self.plane.state_put("dataflow", self._state())

    def ctx(self) -> Context:
        return Context(now=time.time(), versions={p: lane.version for p, lane in self.lanes.items()}, max_staleness=self.cfg.max_staleness)

    # ------------------------------------------------------------ tasks
    def _next_problem(self) -> Problem:
        epoch, i = divmod(self.cursor, len(self.train))
        order = list(range(len(self.train)))
        random.Random(self.recipe.data.seed + epoch).shuffle(order)
        self.cursor += 1
        return self.train[order[i]]

    def task_budget(self) -> int:
        """Tasks we may still issue: (max_staleness + 1) batches' worth in flight or buffered, at most the cap."""
        staleness_cap = (self.cfg.max_staleness + 1) * self.cfg.groups_per_batch
        cap = min(self.cfg.max_tasks_in_flight, staleness_cap)
        return cap - len(self.in_flight) - len(self.lanes[self.primary].buffer)

    async def top_up(self) -> None:
        budget = self.task_budget()
        if budget <= 0:
            return
        lag = await self.plane.lag(self.plane.names.task_stream, self.plane.names.pool_consumer(self.recipe.rollout.pool))
        budget = min(budget, self.cfg.max_tasks_in_flight - lag.pending)
        lane, ctx = self.lanes[self.primary], self.ctx()
        min_versions = {p: max(0, v - self.cfg.max_staleness) for p, v in ctx.versions.items()}
        items = []
        tries = 0
        while len(items) < budget and tries < len(self.train):
            tries += 1
            p = self._next_problem()
            d = lane.pipeline.select(PromptItem(p.prompt_id, self.primary, meta=p.meta), ctx, self.rng)
            if not d.keep:
                lane.ledger.skipped[d.reason or "skipped"] += 1
                continue
            self.task_seq += 1
            task = Task(task_id=f"t{self.task_seq:08d}", workflow=self.recipe.workflow, policy=self.primary,
                        prompt_id=p.prompt_id, prompt=p.prompt, group_size=self.cfg.group_size, meta=p.meta, min_versions=min_versions)
            items.append((self.plane.names.task(task.workflow), task, task.task_id))
        if items:
            await self.plane.publish_many(items)
            self.in_flight.update(t.task_id for _, t, _ in items)
            lane.ledger.issued += len(items)
            await self.persist()

    # ------------------------------------------------------------ trajectories
    async def ingest(self, sub: Any) -> int:
        deliveries = await self.plane.pull(sub, Trajectory, batch=256, timeout=0.2)
        for d in deliveries:
            if d.msg.policy not in self.lanes:
                await self.plane.reject(d.raw.subject, d.raw.data, f"unknown policy {d.msg.policy!r}; run has {list(self.lanes)}")
                await d.term()
                continue
            held = self.assembler.add(d.msg, d)
            if held is False:
                await d.ack()  # a duplicate of something we already hold or settled
            elif held is not None:
                await self._complete(held)
        return len(deliveries)

    async def _complete(self, held: HeldGroup) -> None:
        lane = self.lanes[held.group.policy]
        if held.group.policy == self.primary:
            self.in_flight.discard(held.group.task_id)
        ctx = self.ctx()
        lane.pipeline.observe(held.group, ctx)
        d = lane.pipeline.keep(held.group, ctx)
        if d.keep:
            lane.buffer.append(held)
            return
        lane.ledger.record(f"filtered:{d.reason}")
        await asyncio.gather(*(x.ack() for x in held.deliveries))

    # ------------------------------------------------------------ batches
    async def serve(self) -> None:
        for lane in self.lanes.values():
            await self._serve_lane(lane)

    async def _serve_lane(self, lane: PolicyLane) -> None:
        n = self.cfg.groups_per_batch
        names = self.plane.names
        while len(lane.buffer) >= n:
            lag = await self.plane.lag(names.batch_stream, names.trainer_consumer(lane.name))
            if lag.pending >= self.cfg.max_batch_backlog:
                lane.stats["backpressure"] = lane.stats.get("backpressure", 0) + 1
                return
            by_id = {h.group.task_id: h for h in lane.buffer}
            result = lane.pipeline.serve([h.group for h in lane.buffer], n, self.ctx(), self.rng)
            for task_id, reason in result.dropped:
                held = by_id.pop(task_id)
                lane.ledger.record(f"dropped:{reason}")
                await asyncio.gather(*(x.ack() for x in held.deliveries))
            gone = {t for t, _ in result.dropped} | set(result.taken)
            lane.buffer = [h for h in lane.buffer if h.group.task_id not in gone]
            if not result.batch:
                continue
            chosen = [by_id.get(g.task_id) or lane.recent[g.task_id] for g in result.batch]
            advantages = [a for h in chosen for a in lane.pipeline.advantages(h.group)]
            lane.batch_seq += 1
            batch = Batch(batch_id=f"{lane.name}-b{lane.batch_seq:06d}", policy=lane.name,
                          trajectories=[t for h in chosen for t in h.trajectories],
                          advantages=np.asarray(advantages, np.float32), task_ids=[h.group.task_id for h in chosen])
            await self.plane.publish(names.batch(lane.name), batch, msg_id=batch.batch_id)
            for task_id in result.taken:
                held = by_id[task_id]
                await asyncio.gather(*(x.ack() for x in held.deliveries))
                lane.recent[task_id] = held
                lane.ledger.record("trained")
            while len(lane.recent) > 512:
                lane.recent.popitem(last=False)
            lane.stats["batch_reward"] = float(np.mean([t.reward or 0.0 for h in chosen for t in h.trajectories]))
            await self.persist()

    # ------------------------------------------------------------ liveness
    async def keep_alive(self) -> None:
        held = self.assembler.held_deliveries() + [d for lane in self.lanes.values() for h in lane.buffer for d in h.deliveries]
        await asyncio.gather(*(d.in_progress() for d in held))

    async def refresh_versions(self) -> None:
        for p, lane in self.lanes.items():
            lane.version = int(await self.plane.state_get(f"version.{p}", 0))

    async def beat(self) -> None:
        lag = await self.plane.lag(self.plane.names.task_stream, self.plane.names.pool_consumer(self.recipe.rollout.pool))
        stats: dict[str, float] = {"issued": self.ledger.issued, "in_flight": len(self.in_flight), "task_pending": lag.pending,
                                   "task_ack_pending": lag.ack_pending}
        for p, lane in self.lanes.items():
            stats.update({f"{p}.buffered": len(lane.buffer), f"{p}.batches": lane.batch_seq, f"{p}.version": lane.version,
                          **{f"{p}.fate.{k}": v for k, v in lane.ledger.fates.items()}, **{f"{p}.{k}": v for k, v in lane.stats.items()}})
        await self.plane.beat(Heartbeat(role="dataflow", worker_id=self.plane.worker_id, policy=self.primary,
                                        version=self.lanes[self.primary].version, stats=stats), "dataflow")


async def serve(recipe: Recipe, nats: NatsOptions, run: str, worker_id: str = "dataflow") -> None:
    plane = await Plane.connect(nats, run, worker_id)
    topo = recipe.topology()
    await plane.ensure_topology(topo)
    df = Dataflow(recipe, plane)
    await df.restore()
    stop = stop_event()
    sub = await plane.subscribe(plane.names.traj_stream, plane.names.DATAFLOW_CONSUMER)
    side = [asyncio.create_task(every(2.0, df.beat, stop)), asyncio.create_task(every(topo.traj_ack_wait / 3, df.keep_alive, stop))]
    log.info("dataflow up for run %s, policies %s", run, list(df.lanes))
    try:
        while not stop.is_set():
            await df.refresh_versions()
            await df.top_up()
            await df.ingest(sub)
            await df.serve()
    finally:
        stop.set()
        await asyncio.gather(*side, return_exceptions=True)
        await df.persist()
        await plane.close()  # held trajectories stay unacked: the next dataflow gets them again
