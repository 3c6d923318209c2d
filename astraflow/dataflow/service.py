"""The dataflow worker: feed tasks, ingest trajectories, apply data algorithms, serve batches.

One loop, plain and explicit (STYLE 6); each turn:

1. apply what the plane reported: weight announcements (versions, trained batches), failed
   tasks and batches (DLQ, max deliveries), heartbeats (live nodes, trainer wait);
2. top up tasks — ``async``: while tasks in flight or buffered stay under the staleness budget
   and the task stream's measured lag under its bound; ``sync``: one batch worth per version,
   only once every task of the last one is back and its batch is trained;
3. pull trajectories, route them by policy to their lane, assemble groups, apply the deadline's
   late policy, curator feedback and filters;
4. per lane, serve batches while that trainer's measured backlog is under its bound: write the
   batch ahead to the KV, publish it (``Nats-Msg-Id`` = batch id), then let its trajectories go;
5. write fate records and the state to the KV, and only then ack what was settled.

Acks always follow the durable write of the state that explains them, so a dataflow killed at
any point loses nothing and batches nothing twice: its successor restores the state, rebuilds a
batch it finds planned (the server drops the copy if the first publication landed), acks and
ignores redelivered trajectories of tasks already settled, and reassembles the rest.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import time
from collections import Counter, OrderedDict
from typing import Any

import numpy as np

from astraflow.algorithms import Context, PromptItem, build_pipeline
from astraflow.config import Recipe
from astraflow.dataflow.groups import Assembler, HeldGroup
from astraflow.dataflow.lane import PolicyLane
from astraflow.dataflow.ledger import Ledger
from astraflow.dataflow.pool import PoolAdvisor
from astraflow.dataflow.watch import BatchFailed, TaskFailed, Trained, Watch, fetch_trajectories
from astraflow.metrics import Metrics, start_metrics_server
from astraflow.runtime import every, stop_event
from astraflow.streams.dataflow_state import Accounting, BatchPlan, DataflowState
from astraflow.streams.messages import Batch, DataflowStats, Heartbeat, Task, Trajectory
from astraflow.streams.plane import Consumer, Delivery, NatsOptions, Plane
from astraflow.streams.state import FateRecord, VersionRecord
from astraflow.tasks import Problem, load_split

log = logging.getLogger(__name__)
_crossed: Counter[str] = Counter()


def crash_point(name: str) -> None:
    """Fault injection for durability tests: ``ASTRAFLOW_DATAFLOW_CRASH=name:n`` SIGKILLs this
    process the n-th time it passes ``name`` (``batch_planned``, ``batch_published``)."""
    point, _, nth = os.environ.get("ASTRAFLOW_DATAFLOW_CRASH", "").partition(":")
    if point == name:
        _crossed[name] += 1
        if _crossed[name] == int(nth or 1):
            os.kill(os.getpid(), signal.SIGKILL)


class Dataflow:
    def __init__(self, recipe: Recipe, plane: Plane) -> None:
        self.recipe = recipe
        self.cfg = recipe.dataflow
        self.plane = plane
        self.metrics: Metrics | None = None  # set by serve() when --metrics-port is given
        self.primary = recipe.primary
        self.lanes = {p: PolicyLane(p, build_pipeline(self.cfg.algorithms), p == recipe.primary) for p in recipe.policy_names}
        self.train, _ = load_split(recipe.data)
        self.rng = random.Random(recipe.data.seed)
        self.assembler = Assembler()
        self.task_seq = 0
        self.cursor = 0
        self.open: dict[str, float | None] = {}  # issued, primary group not complete: task -> deadline
        self.deadlines: OrderedDict[str, float] = OrderedDict()  # recent tasks' deadlines, for every lane
        self.issuing: list[Task] = []  # tasks written ahead of their publication
        self.handles: dict[str, Delivery[Trajectory]] = {}  # held trajectories: traj_id -> latest delivery
        self.to_ack: list[Delivery[Trajectory]] = []  # settled; acked after the next durable write
        self.records: list[FateRecord] = []  # per-task fate records, written before the state
        self.dirty = False
        self.stats: Counter[str] = Counter()
        self.watch = Watch(plane, recipe.rollout.pool)
        self.pool = PoolAdvisor(plane, recipe.rollout.pool, recipe.policy_names, self.cfg.autoscale)

    @property
    def ledger(self) -> Ledger:
        """Task accounting of the primary policy (the one tasks are issued for)."""
        return self.lanes[self.primary].ledger

    def accounting(self) -> dict[str, Accounting]:
        return {p: lane.accounting(len(self.open) if lane.primary else 0) for p, lane in self.lanes.items()}

    # ------------------------------------------------------------ state
    def _state(self) -> DataflowState:
        return DataflowState(task_seq=self.task_seq, cursor=self.cursor, open=dict(self.open), deadlines=dict(self.deadlines),
                             issuing=list(self.issuing), lanes={p: lane.state() for p, lane in self.lanes.items()},
                             accounting=self.accounting(), pool=self.recipe.rollout.pool, mode=self.cfg.mode)

    async def persist(self) -> None:
        await self.plane.state.put(self._state())
        self.dirty = False

    async def start(self) -> None:
        """Follow the plane, restore the last state, finish what the last dataflow left half done."""
        await self.watch.start()
        s = await self.plane.state.get(DataflowState)  # a failed read raises: never mistaken for a new run
        if s is None:
            return
        self.task_seq, self.cursor = s.task_seq, s.cursor
        self.open = dict(s.open)
        self.deadlines = OrderedDict(s.deadlines)
        for p, lane_state in s.lanes.items():
            if p in self.lanes:
                fresh = self.lanes[p].load_state(lane_state)
                if fresh:
                    log.warning("lane %s: plug-ins without saved state start fresh: %s", p, fresh)
        for task in s.issuing:  # written ahead, maybe never published: publish again (deduplicated)
            await self.plane.publish(self.plane.names.task(task.workflow), task, msg_id=task.task_id)
        for lane in self.lanes.values():
            for plan in list(lane.plans.values()):
                await self._republish(lane, plan)
        await self.persist()
        log.info("dataflow restored: %d tasks issued, %d in flight, %s", self.ledger.issued, len(self.open),
                 {p: lane.batch_seq for p, lane in self.lanes.items()})

    async def _republish(self, lane: PolicyLane, plan: BatchPlan) -> None:
        batch_id = plan.batch_id
        trajs = await fetch_trajectories(self.plane, plan.seqs)
        batch = Batch(batch_id=batch_id, policy=lane.name, trajectories=trajs, advantages=np.asarray(plan.advantages, "<f4").tobytes(),
                      task_ids=plan.groups, created_at=plan.created_at)
        await self.plane.publish(self.plane.names.batch(lane.name), batch, msg_id=batch_id)
        del lane.plans[batch_id]
        self.stats["republished_batches"] += 1
        log.info("batch %s was planned before the restart: published again (the server keeps one copy)", batch_id)

    def ctx(self, now: float | None = None) -> Context:
        return Context(now=now or time.time(), versions={p: lane.version for p, lane in self.lanes.items()}, max_staleness=self.cfg.max_staleness)

    async def refresh_versions(self) -> None:
        """Read each trainer's version from the KV (a driver that does not run ``start``'s watch)."""
        for p, lane in self.lanes.items():
            record = await self.plane.state.get(VersionRecord, p)
            lane.version = max(lane.version, record.version if record is not None else 0)

    # ------------------------------------------------------------ plane events
    def apply_events(self) -> None:
        events, beats = self.watch.drain()
        for e in events:
            if isinstance(e, Trained) and e.policy in self.lanes:
                lane = self.lanes[e.policy]
                lane.version = max(lane.version, e.version)
                for batch_id in e.batch_ids:
                    for task_id in lane.trained(batch_id):
                        self._record(lane.name, task_id, "trained", batch=batch_id, version=e.version)
                        if lane.primary:
                            self.stats["groups_trained"] += 1
            elif isinstance(e, TaskFailed) and e.policy in self.lanes and e.task_id in self.open:
                del self.open[e.task_id]
                lane = self.lanes[e.policy]
                for key in [k for k in self.assembler.partial if k[0] == e.task_id]:  # what came back of it
                    self._release([t.traj_id for t, _ in self.assembler.partial.pop(key).values()])
                lane.settle(e.task_id, f"failed:{e.reason}")
                self._record(lane.name, e.task_id, f"failed:{e.reason}", error=e.detail)
            elif isinstance(e, BatchFailed) and e.policy in self.lanes:
                tasks = self.lanes[e.policy].awaiting.pop(e.batch_id, [])
                self.lanes[e.policy].ledger.record("failed:train", len(tasks))
                for task_id in tasks:
                    self._record(e.policy, task_id, "failed:train", batch=e.batch_id, error=e.detail)
        now = time.time()
        for hb in beats:
            self.pool.seen(hb, now)

    def _record(self, policy: str, task_id: str, fate: str, **extra: Any) -> None:
        self.records.append(FateRecord(policy=policy, task_id=task_id, fate=fate, **extra))
        self.dirty = True

    def _release(self, traj_ids: list[str]) -> None:
        """These trajectories' fate is decided: ack them once it is durable."""
        self.to_ack.extend(self.handles.pop(t) for t in traj_ids if t in self.handles)

    # ------------------------------------------------------------ tasks
    def _next_problem(self) -> Problem:
        epoch, i = divmod(self.cursor, len(self.train))
        order = list(range(len(self.train)))
        random.Random(self.recipe.data.seed + epoch).shuffle(order)
        self.cursor += 1
        return self.train[order[i]]

    def task_budget(self) -> int:
        """async: tasks we may still issue: (max_staleness + 1) batches' worth in flight or buffered, at most the cap."""
        staleness_cap = (self.cfg.max_staleness + 1) * self.cfg.groups_per_batch
        cap = min(self.cfg.max_tasks_in_flight, staleness_cap)
        return cap - len(self.open) - len(self.lanes[self.primary].kept)

    def sync_release(self) -> int:
        """sync: a batch worth once everything released before is back and trained, else nothing."""
        if self.open or self.issuing or self.assembler.partial:
            return 0
        if any(lane.awaiting or lane.plans for lane in self.lanes.values()):
            return 0
        return max(0, self.cfg.groups_per_batch - len(self.lanes[self.primary].kept))

    async def top_up(self) -> None:
        if self.cfg.mode == "sync":
            budget = self.sync_release()
        else:
            budget = self.task_budget()
            if budget > 0:
                lag = await self.plane.lag(self.plane.names.task_stream, self.plane.names.pool_consumer(self.recipe.rollout.pool))
                budget = min(budget, self.cfg.max_tasks_in_flight - lag.pending)
        if budget <= 0:
            return
        lane, ctx = self.lanes[self.primary], self.ctx()
        lag_allowed = 0 if self.cfg.mode == "sync" else self.cfg.max_staleness
        min_versions = {p: max(0, v - lag_allowed) for p, v in ctx.versions.items()}
        timeout = self.cfg.task_timeout_s
        tasks: list[Task] = []
        tries = 0
        while len(tasks) < budget and tries < len(self.train):
            tries += 1
            p = self._next_problem()
            d = lane.pipeline.select(PromptItem(p.prompt_id, self.primary, meta=p.meta), ctx, self.rng)
            if not d.keep:
                lane.ledger.skipped[d.reason or "skipped"] += 1
                continue
            self.task_seq += 1
            tasks.append(Task(task_id=f"t{self.task_seq:08d}", workflow=self.recipe.workflow, policy=self.primary,
                              prompt_id=p.prompt_id, prompt=p.prompt, group_size=self.cfg.group_size, meta=p.meta,
                              min_versions=min_versions, deadline=ctx.now + timeout if timeout else None))
        if not tasks:
            return
        for t in tasks:
            self.open[t.task_id] = t.deadline
            if t.deadline is not None:
                self.deadlines[t.task_id] = t.deadline
        while len(self.deadlines) > 4096:
            self.deadlines.popitem(last=False)
        lane.ledger.issued += len(tasks)
        self.issuing = tasks
        await self.persist()  # write-ahead: a successor publishes these again under the same ids
        await self.plane.publish_many([(self.plane.names.task(t.workflow), t, t.task_id) for t in tasks])
        self.issuing = []
        self.dirty = True

    # ------------------------------------------------------------ trajectories
    async def ingest(self, trajectories: Consumer[Trajectory], timeout: float = 0.1) -> int:
        deliveries = await trajectories.pull(batch=256, timeout=timeout)
        for d in deliveries:
            t = d.msg
            lane = self.lanes.get(t.policy)
            if lane is None:
                await d.reject(f"unknown policy {t.policy!r}; run has {list(self.lanes)}")
                continue
            if t.task_id in lane.closed:  # settled or batched before (a redelivery after a restart, a late copy)
                self.to_ack.append(d)
                self.stats["redelivered_settled"] += 1
                continue
            if t.traj_id in self.handles:  # redelivered while we hold it: the newer delivery is the live one
                self.handles[t.traj_id] = d
                self.stats["redelivered_held"] += 1
                continue
            if t.task_id in lane.buffer:  # another sample for a complete group
                self.to_ack.append(d)
                self.stats["duplicates"] += 1
                continue
            deadline = self.deadlines.get(t.task_id) if self.cfg.late_policy == "drop" else None
            held = self.assembler.add(t, d.stream_seq, deadline)
            if held is False:
                self.to_ack.append(d)
                self.stats["duplicates"] += 1
                continue
            self.handles[t.traj_id] = d
            if held is not None:
                self._complete(lane, held)
        return len(deliveries)

    def _complete(self, lane: PolicyLane, held: HeldGroup) -> None:
        task_id = held.task_id
        self.dirty = True
        if lane.primary:
            self.open.pop(task_id, None)
        if task_id in lane.kept:  # kept before a restart: straight back into the buffer, counted and hooked already
            held.weight = lane.kept[task_id]
            lane.keep(held)
            return
        lane.ledger.received += 1
        now = time.time()
        ctx = self.ctx(now)
        lane.pipeline.observe(held.group, ctx)
        deadline = self.deadlines.get(task_id)
        late = deadline is not None and now > deadline
        if late and self.cfg.late_policy == "drop":
            lane.ledger.late["dropped"] += 1
            return self._settle(lane, held, "dropped:expired")
        decision = lane.pipeline.keep(held.group, ctx)
        if not decision.keep:
            return self._settle(lane, held, f"filtered:{decision.reason}")
        if late:
            if self.cfg.late_policy == "downweight":
                held.weight = self.cfg.late_weight
                lane.ledger.late["downweighted"] += 1
            else:
                lane.ledger.late["kept"] += 1
        lane.keep(held)

    def _settle(self, lane: PolicyLane, held: HeldGroup, fate: str) -> None:
        lane.settle(held.task_id, fate)
        self._release(held.traj_ids)
        self._record(lane.name, held.task_id, fate)

    # ------------------------------------------------------------ batches
    async def serve(self) -> None:
        """Serve every lane, then make the outcome durable and ack what it settled."""
        for lane in self.lanes.values():
            await self._serve_lane(lane)
        await self.flush()

    async def _held(self, lane: PolicyLane, group: Any) -> HeldGroup | None:
        """A batch group: fresh from the buffer, or replayed from memory (read back from the stream after a restart)."""
        held = lane.buffer.get(group.task_id) or lane.recent.get(group.task_id)
        if held is None:
            seqs = lane.recent_seqs.get(group.task_id)
            if seqs is None:  # a replay memory larger than what the lane remembers: serve the batch without it
                log.warning("lane %s: replayed group %s is no longer remembered; left out of the batch", lane.name, group.task_id)
                self.stats["replay_missing"] += 1
                return None
            held = HeldGroup(group, await fetch_trajectories(self.plane, seqs), seqs)
            lane.recent[group.task_id] = held
        return held

    async def _serve_lane(self, lane: PolicyLane) -> None:
        n = self.cfg.groups_per_batch
        names = self.plane.names
        while len(lane.buffer) >= n:
            lag = await self.plane.lag(names.batch_stream, names.trainer_consumer(lane.name))
            lane.backlog = lag.pending
            if lag.pending >= self.cfg.max_batch_backlog:
                lane.stats["backpressure"] = lane.stats.get("backpressure", 0) + 1
                return
            result = lane.pipeline.serve([h.group for h in lane.buffer.values()], n, self.ctx(), self.rng)
            for task_id, reason in result.dropped:
                self._settle(lane, lane.buffer[task_id], f"dropped:{reason}")
            if not result.batch:
                if result.dropped:
                    continue
                return
            chosen = [h for g in result.batch if (h := await self._held(lane, g)) is not None]
            advantages = [a * h.weight for h in chosen for a in lane.pipeline.advantages(h.group)]
            lane.batch_seq += 1
            batch = Batch(batch_id=f"{lane.name}-b{lane.batch_seq:06d}", policy=lane.name,
                          trajectories=[t for h in chosen for t in h.trajectories],
                          advantages=np.asarray(advantages, "<f4").tobytes(), task_ids=[h.task_id for h in chosen])
            taken_ids = set(result.taken)
            taken = [h for h in chosen if h.task_id in taken_ids]
            lane.plan(batch.batch_id, chosen, list(result.taken), advantages, batch.created_at)
            lane.ledger.replayed += len(chosen) - len(taken)
            for h in taken:
                self._record(lane.name, h.task_id, "batched", batch=batch.batch_id)
            await self.persist()  # write-ahead: the plan is durable before the batch exists
            crash_point("batch_planned")
            await self.plane.publish(names.batch(lane.name), batch, msg_id=batch.batch_id)
            crash_point("batch_published")
            del lane.plans[batch.batch_id]
            for h in taken:
                self._release(h.traj_ids)
            lane.stats["batch_reward"] = float(np.mean([t.reward or 0.0 for t in batch.trajectories]))
            self.dirty = True

    # ------------------------------------------------------------ durability
    async def flush(self) -> None:
        """Fate records, then the state, then the acks they explain."""
        if self.records:
            records, self.records = self.records, []
            await self.plane.state.put_many(list(records))
        if self.dirty:
            await self.persist()
        if self.to_ack:
            acks, self.to_ack = self.to_ack, []
            await asyncio.gather(*(d.ack() for d in acks))

    async def keep_alive(self) -> None:
        await asyncio.gather(*(d.in_progress() for d in list(self.handles.values())), return_exceptions=True)

    # ------------------------------------------------------------ advice and heartbeats
    async def measure(self, every_s: float = 0.25) -> None:
        await self.pool.measure(self.lanes, self.ledger.received, self.stats["groups_trained"], every_s)

    async def beat(self) -> None:
        advice, obs = await self.pool.publish()
        now = time.time()
        acc = self.accounting()
        per_policy: dict[str, dict[str, float]] = {}
        for p, lane in self.lanes.items():
            a = acc[p]
            per_policy[p] = {"buffered": a.buffered, "awaiting": a.awaiting, "batches": lane.batch_seq,
                             "version": lane.version, "backlog": lane.backlog, "wait_frac": self.pool.wait_frac(p),
                             **{f"fate.{k}": v for k, v in a.fates.items()}, **{f"late.{k}": v for k, v in a.late.items()},
                             **{k: float(v) for k, v in lane.stats.items()}}
        stats = DataflowStats(issued=self.ledger.issued, in_flight=len(self.open), buffered=acc[self.primary].buffered,
                              batches=self.lanes[self.primary].batch_seq,
                              overdue=sum(1 for d in self.open.values() if d is not None and d < now),
                              wait_frac=obs.wait_frac, produce_rate=obs.produce_rate, consume_rate=obs.consume_rate,
                              autoscale_target=advice.target, autoscale_nodes=obs.nodes,
                              counters={k: float(v) for k, v in self.stats.items()}, policies=per_policy)
        if self.metrics is not None:  # Prometheus: node-wide gauges, and per-policy ones labelled with the policy
            self.metrics.set({**stats.summary(), **stats.counters})
            for p, values in per_policy.items():
                self.metrics.child(p).set(values)
        await self.plane.beat(Heartbeat(worker_id=self.plane.worker_id, policy=self.primary,
                                        version=self.lanes[self.primary].version, stats=stats))

    # ------------------------------------------------------------ the loop
    async def step(self, trajectories: Consumer[Trajectory]) -> None:
        self.apply_events()
        await self.top_up()
        await self.ingest(trajectories)
        await self.measure()
        await self.serve()


async def serve(recipe: Recipe, nats: NatsOptions, run: str, worker_id: str = "dataflow", metrics_port: int | None = None) -> None:
    plane = await Plane.connect(nats, run, worker_id)
    await plane.ensure_topology(recipe.topology())
    df = Dataflow(recipe, plane)
    if metrics_port is not None:
        df.metrics = Metrics("dataflow", worker=worker_id)
        log.info("Prometheus metrics on :%d/metrics", start_metrics_server(metrics_port))
    await df.start()
    stop = stop_event()
    names = plane.names
    trajectories = plane.consumer(names.traj_stream, names.DATAFLOW_CONSUMER, Trajectory)
    ack_wait = (await trajectories.settings()).ack_wait
    side = [asyncio.create_task(every(2.0, df.beat, stop)), asyncio.create_task(every(ack_wait / 3, df.keep_alive, stop))]
    log.info("dataflow up for run %s (%s), policies %s", run, recipe.dataflow.mode, list(df.lanes))
    try:
        while not stop.is_set():
            await df.step(trajectories)
    finally:
        stop.set()
        await asyncio.gather(*side, return_exceptions=True)
        await df.flush()
        await df.watch.stop()
        await plane.close()  # held trajectories stay unacked: the next dataflow gets them again
