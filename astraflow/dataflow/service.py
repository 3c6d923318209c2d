"""The dataflow worker: feed tasks, ingest trajectories, apply data algorithms, serve batches.

One loop, plain and explicit (STYLE 6):

1. read each policy's current trainer version (run-state KV, written by trainers);
2. top up tasks while the number in flight stays under the staleness budget and the task
   stream's measured lag stays under its bound;
3. pull trajectories, assemble groups, run curator feedback and filters;
4. serve batches while the trainer's measured backlog is under its bound; ack the
   trajectories of a group only once the batch holding it is stored;
5. keep held deliveries alive (``in_progress``), heartbeat, persist counters.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from astraflow.algorithms import Context, PromptItem, build_pipeline
from astraflow.config import Recipe
from astraflow.dataflow.groups import Assembler, HeldGroup, Ledger
from astraflow.runtime import every, stop_event
from astraflow.streams.messages import Batch, Heartbeat, Task, Trajectory
from astraflow.streams.plane import NatsOptions, Plane
from astraflow.tasks import Problem, load_split

log = logging.getLogger(__name__)


class Dataflow:
    def __init__(self, recipe: Recipe, plane: Plane) -> None:
        self.recipe = recipe
        self.cfg = recipe.dataflow
        self.plane = plane
        self.policy = recipe.policy
        self.pipeline = build_pipeline(self.cfg.algorithms)
        self.train, _ = load_split(recipe.data)
        self.rng = random.Random(recipe.data.seed)
        self.assembler = Assembler()
        self.ledger = Ledger()
        self.buffer: list[HeldGroup] = []
        self.recent: OrderedDict[str, HeldGroup] = OrderedDict()  # trained groups, for replay
        self.version = 0
        self.task_seq = 0
        self.batch_seq = 0
        self.cursor = 0
        self.in_flight: set[str] = set()
        self.stats: dict[str, float] = {}

    # ------------------------------------------------------------ state
    def _state(self) -> dict[str, Any]:
        return {"task_seq": self.task_seq, "batch_seq": self.batch_seq, "cursor": self.cursor, "ledger": self.ledger.state(),
                "pipeline": self.pipeline.state(), "in_flight": sorted(self.in_flight)}

    async def restore(self) -> None:
        s = await self.plane.state_get(f"dataflow.{self.policy}")
        if not s:
            return
        self.task_seq, self.batch_seq, self.cursor = s["task_seq"], s["batch_seq"], s["cursor"]
        self.ledger.load_state(s["ledger"])
        self.in_flight = set(s.get("in_flight", []))
        self.pipeline.load_state(s["pipeline"])
        log.info("dataflow restored: %d tasks issued, %d batches served", self.ledger.issued, self.batch_seq)

    async def persist(self) -> None:
        await self.plane.state_put(f"dataflow.{self.policy}", self._state())

    def ctx(self) -> Context:
        return Context(now=time.time(), versions={self.policy: self.version}, max_staleness=self.cfg.max_staleness)

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
        return cap - len(self.in_flight) - len(self.buffer)

    async def top_up(self) -> None:
        budget = self.task_budget()
        if budget <= 0:
            return
        lag = await self.plane.lag(self.plane.names.task_stream, self.plane.names.pool_consumer(self.recipe.rollout.pool))
        budget = min(budget, self.cfg.max_tasks_in_flight - lag.pending)
        items = []
        tries = 0
        while len(items) < budget and tries < len(self.train):
            tries += 1
            p = self._next_problem()
            d = self.pipeline.select(PromptItem(p.prompt_id, self.policy, meta=p.meta), self.ctx(), self.rng)
            if not d.keep:
                self.ledger.skipped[d.reason or "skipped"] += 1
                continue
            self.task_seq += 1
            task = Task(task_id=f"{self.policy}-{self.task_seq:08d}", workflow=self.recipe.workflow, policy=self.policy,
                        prompt_id=p.prompt_id, prompt=p.prompt, group_size=self.cfg.group_size, meta=p.meta,
                        min_version=max(0, self.version - self.cfg.max_staleness))
            items.append((self.plane.names.task(task.workflow), task, task.task_id))
        if items:
            await self.plane.publish_many(items)
            self.in_flight.update(t.task_id for _, t, _ in items)
            self.ledger.issued += len(items)
            await self.persist()

    # ------------------------------------------------------------ trajectories
    async def ingest(self, sub: Any) -> int:
        deliveries = await self.plane.pull(sub, Trajectory, batch=256, timeout=0.2)
        for d in deliveries:
            held = self.assembler.add(d.msg, d)
            if held is False:
                await d.ack()  # a duplicate of something we already hold or settled
            elif held is not None:
                await self._complete(held)
        return len(deliveries)

    async def _complete(self, held: HeldGroup) -> None:
        self.in_flight.discard(held.group.task_id)
        ctx = self.ctx()
        self.pipeline.observe(held.group, ctx)
        d = self.pipeline.keep(held.group, ctx)
        if d.keep:
            self.buffer.append(held)
            return
        self.ledger.record(f"filtered:{d.reason}")
        await asyncio.gather(*(x.ack() for x in held.deliveries))

    # ------------------------------------------------------------ batches
    async def serve(self) -> None:
        n = self.cfg.groups_per_batch
        names = self.plane.names
        while len(self.buffer) >= n:
            lag = await self.plane.lag(names.batch_stream, names.trainer_consumer(self.policy))
            if lag.pending >= self.cfg.max_batch_backlog:
                self.stats["backpressure"] = self.stats.get("backpressure", 0) + 1
                return
            by_id = {h.group.task_id: h for h in self.buffer}
            result = self.pipeline.serve([h.group for h in self.buffer], n, self.ctx(), self.rng)
            for task_id, reason in result.dropped:
                held = by_id.pop(task_id)
                self.ledger.record(f"dropped:{reason}")
                await asyncio.gather(*(x.ack() for x in held.deliveries))
            gone = {t for t, _ in result.dropped} | set(result.taken)
            self.buffer = [h for h in self.buffer if h.group.task_id not in gone]
            if not result.batch:
                continue
            chosen = [by_id.get(g.task_id) or self.recent[g.task_id] for g in result.batch]
            advantages = [a for h in chosen for a in self.pipeline.advantages(h.group)]
            self.batch_seq += 1
            batch = Batch(batch_id=f"{self.policy}-b{self.batch_seq:06d}", policy=self.policy,
                          trajectories=[t for h in chosen for t in h.trajectories],
                          advantages=np.asarray(advantages, np.float32), task_ids=[h.group.task_id for h in chosen])
            await self.plane.publish(names.batch(self.policy), batch, msg_id=batch.batch_id)
            for task_id in result.taken:
                held = by_id[task_id]
                await asyncio.gather(*(x.ack() for x in held.deliveries))
                self.recent[task_id] = held
                self.ledger.record("trained")
            while len(self.recent) > 512:
                self.recent.popitem(last=False)
            rewards = [t.reward or 0.0 for h in chosen for t in h.trajectories]
            self.stats["batch_reward"] = float(np.mean(rewards))
            await self.persist()

    # ------------------------------------------------------------ liveness
    async def keep_alive(self) -> None:
        held = self.assembler.held_deliveries() + [d for h in self.buffer for d in h.deliveries]
        await asyncio.gather(*(d.in_progress() for d in held))

    async def refresh_version(self) -> None:
        self.version = int(await self.plane.state_get(f"version.{self.policy}", 0))

    async def beat(self) -> None:
        lag = await self.plane.lag(self.plane.names.task_stream, self.plane.names.pool_consumer(self.recipe.rollout.pool))
        stats = {"issued": self.ledger.issued, "in_flight": len(self.in_flight), "buffered": len(self.buffer),
                 "batches": self.batch_seq, "task_pending": lag.pending, "task_ack_pending": lag.ack_pending,
                 **{f"fate.{k}": v for k, v in self.ledger.fates.items()}, **self.stats}
        await self.plane.beat(Heartbeat(role="dataflow", worker_id=self.plane.worker_id, policy=self.policy, version=self.version, stats=stats), "dataflow")


async def serve(recipe: Recipe, nats: NatsOptions, run: str, worker_id: str = "dataflow") -> None:
    plane = await Plane.connect(nats, run, worker_id)
    await plane.ensure_topology(recipe.topology())
    df = Dataflow(recipe, plane)
    await df.restore()
    stop = stop_event()
    sub = await plane.subscribe(plane.names.traj_stream, plane.names.DATAFLOW_CONSUMER)
    side = [asyncio.create_task(every(2.0, df.beat, stop)), asyncio.create_task(every(plane_ack_third(recipe), df.keep_alive, stop))]
    log.info("dataflow up for run %s, policy %s", run, df.policy)
    try:
        while not stop.is_set():
            await df.refresh_version()
            await df.top_up()
            await df.ingest(sub)
            await df.serve()
    finally:
        stop.set()
        await asyncio.gather(*side, return_exceptions=True)
        await df.persist()
        await plane.close()  # held trajectories stay unacked: the next dataflow gets them again


def plane_ack_third(recipe: Recipe) -> float:
    return recipe.topology().traj_ack_wait / 3
