"""The dataflow worker: feed tasks, ingest trajectories, apply data algorithms, serve batches.

One loop, plain and explicit (STYLE 6); each turn (``Dataflow.step``):

1. apply what the plane reported: weight announcements (versions, trained batches), failed
   tasks and batches (DLQ, max deliveries), heartbeats (live nodes, trainer wait);
2. pull trajectories (``ingest.TrajectoryIngest``): read back the arrays of those too large for
   one message, check each one's values and its claim on a task (``validate.py``; an invalid one
   goes to the DLQ and may settle its task ``invalid:R``),
   route it by policy to its lane, assemble groups, apply curator feedback, the deadline's late
   policy and filters; every ``audit.AUDIT_S``, settle ``failed:lost`` the tasks a node acked whose group never
   completes, and the kept groups a restart does not get back (``audit.py``);
3. per lane, plan batches while that trainer's measured backlog is under its bound
   (``serving.BatchServer``): each batch's plan, its plan record for the trainer and its tasks'
   fates are queued to be written ahead;
4. issue tasks (``issuing.TaskIssuer``) — ``async``: while tasks in flight or buffered stay
   under the staleness budget and the task stream's measured lag under its bound; ``sync``: one
   batch worth per version, only once every task of the last one is back and its batch is
   trained; they are queued to be written ahead too;
5. write fate records and the state (the plans and the tasks in it), and only then ack what was
   settled (``durability.Journal``, the only place that orders these): a commit in every turn that publishes, and
   otherwise once the last is ``durability.COMMIT_EVERY_S`` old (the acks wait for it);
6. publish the planned batch manifests (``Nats-Msg-Id`` = batch id; trajectory references, not
   trajectories) and the tasks (``Nats-Msg-Id`` = task id) in one pipelined publication, then let
   the batches' trajectories go (acked after the next turn's commit).

Acks always follow the durable write of the state that explains them, so a dataflow killed at
any point loses nothing and batches nothing twice: its successor restores the state, publishes again
a batch or a task it finds planned or issuing (the server drops the copy if the first publication
landed), acks and ignores redelivered trajectories of tasks already settled, and reassembles the rest.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from dataclasses import dataclass

from astraflow.algorithms import Context, build_pipeline
from astraflow.config import Recipe
from astraflow.dataflow.audit import AUDIT_S, Auditor
from astraflow.dataflow.claims import ClaimCheck
from astraflow.dataflow.durability import Journal
from astraflow.dataflow.inflight import InFlight
from astraflow.dataflow.ingest import BUSY_PULL_WAIT_S, PULL_WAIT_S, TrajectoryIngest
from astraflow.dataflow.issuing import TaskIssuer
from astraflow.dataflow.lane import PolicyLane, context
from astraflow.dataflow.ledger import Ledger
from astraflow.dataflow.pool import PoolAdvisor
from astraflow.dataflow.reputation import Reputation
from astraflow.dataflow.serving import BatchServer, Planned
from astraflow.dataflow.validate import Limits
from astraflow.dataflow.watch import BatchFailed, SampleUndecodable, TaskFailed, Trained, Watch
from astraflow.metrics import Metrics, serving
from astraflow.role import Role, RoleOptions
from astraflow.runtime import crash_point
from astraflow.streams.dataflow_state import Accounting, DataflowState
from astraflow.streams.fates import DROPPED_STALE, FAILED_LOST, FAILED_TRAIN, Fate, Outcome
from astraflow.streams.messages import (
    HEARTBEAT_PERIOD_S,
    BatchRefusal,
    DataflowStats,
    Heartbeat,
    Task,
)
from astraflow.streams.plane import Consumer, Plane
from astraflow.streams.state import AdmitRecord
from astraflow.streams.task_queue import TaskQueue, Ticket
from astraflow.streams.trajectories import TrajMessage, resolve_all
from astraflow.streams.trajectory_log import TrajectoryLog
from astraflow.tasks import load_split

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaskRemoval:
    """A task the server gave up on (max deliveries) stays in the task queue, never delivered again, and every
    restart's scan reads it: the journal "acks" it, by deleting it, once its ``failed:max_deliver`` is durable. A
    removal that fails is retried when the next dataflow replays the advisory (DLQ keeps them)."""

    tasks: TaskQueue
    ticket: Ticket

    async def ack(self) -> None:
        try:
            await self.tasks.remove(self.ticket)
        except Exception as e:  # housekeeping: never worth stopping a flush for
            log.warning("could not remove task %d, given up on, from the task queue: %s", self.ticket, e)

    async def in_progress(self) -> None:
        return None


class Dataflow:
    def __init__(self, recipe: Recipe, plane: Plane, metrics: Metrics | None = None) -> None:
        self.recipe = recipe
        self.plane = plane
        self.metrics = metrics  # Prometheus export, when serve() was given a port
        self.journal = Journal(plane.state, self.snapshot)
        self.lanes = {p: PolicyLane(p, build_pipeline(recipe.dataflow.algorithms), p == recipe.primary, self.journal)
                      for p in recipe.policy_names}
        self.stats: Counter[str] = Counter()  # heartbeat counters
        self.in_flight = InFlight(self.lanes[recipe.primary].tasks, other_lanes=len(self.lanes) > 1)
        rng = random.Random(recipe.data.seed)  # prompt selection and batch serving draw from one seeded stream
        train, _ = load_split(recipe.data)
        self.issuer = TaskIssuer(recipe, plane, self.lanes, train, self.in_flight, self.journal, rng)
        trajectory_objects = plane.trajectory_objects()
        claims = None if recipe.dataflow.trust_claims else ClaimCheck(recipe, train)
        self.reputation = Reputation(recipe.dataflow.quarantine_after, on_quarantine=lambda q: self.journal.changed())
        self.restored_at = 0.0  # when the state it restored was written (0: a new run), to compare with its own dead letters
        self.watch = Watch(plane, self.issuer.tasks, recipe.policy_names)
        self.ingest = TrajectoryIngest(self.lanes, self.in_flight, self.journal, recipe.dataflow, self.stats, Limits.of(recipe),
                                       lambda p: self.watch.newest_version(p, self.lanes[p].version),
                                       lambda trajs: resolve_all(trajectory_objects, trajs), claims, self.reputation)
        self.server = BatchServer(plane, self.lanes, self.journal, recipe.dataflow, self.stats, rng)
        self.pool = PoolAdvisor(plane, recipe.rollout.pool, recipe.policy_names, recipe.dataflow.autoscale)
        self.auditor = Auditor(self.issuer.tasks, TrajectoryLog(plane), self.in_flight)
        self._audited = 0.0
        self._busy = True  # the last turn issued tasks or planned batches: the next one does not wait for trajectories

    # ------------------------------------------------------------ the loop
    async def step(self, trajectories: Consumer[TrajMessage]) -> None:
        """One turn. Its pull waits up to ``PULL_WAIT_S`` for trajectories only after a turn that had nothing to
        issue or plan; after one that had (the first, or one after groups landed) it may have more to do at once, so
        its pull takes what is there (``BUSY_PULL_WAIT_S``)."""
        self.apply_events()
        await self.ingest.pull(trajectories, timeout=BUSY_PULL_WAIT_S if self._busy else PULL_WAIT_S)
        await self.audit()
        await self.measure()
        await self.server.read_backlogs()
        planned = self.server.plan()
        await self.issuer.read_pending()  # after the plan: a planned batch leaves the buffer and may open the budget
        tasks = self.issuer.issue(self.context(), drained=self.drained())
        self._busy = bool(planned or tasks)
        await self.journal.flush(publishing=self._busy)  # write-ahead: the plans and tasks are durable before they exist on the plane
        if self._busy:
            await self.publish(planned, tasks)

    async def publish(self, planned: list[Planned], tasks: list[Task]) -> None:
        """The turn's batches and tasks, pipelined: one wait for the server's acks of them all."""
        for _ in planned:
            crash_point("batch_planned")
        at = await self.plane.publish_many([self.server.item(p.batch) for p in planned] + [self.issuer.tasks.item(t) for t in tasks])
        for _ in planned:
            crash_point("batch_published")
        self.server.published(planned)
        self.issuer.published()
        now = time.time()
        for t, ticket in zip(tasks, at[len(planned):], strict=True):
            self.in_flight.published(t.task_id, ticket, now)

    def apply_events(self) -> None:
        """Fold in what the plane reported since the last turn."""
        events, beats = self.watch.drain()
        for e in events:
            lane = self.lanes.get(e.policy)
            if lane is None:
                continue
            if isinstance(e, Trained):
                if e.version > lane.followed:  # each announcement's suspects counted once, whatever restarted
                    lane.followed = e.version
                    for suspect in e.suspects:
                        self.reputation.suspected(suspect, e.version)
                lane.advance(e.version)
                for batch_id in e.batch_ids:
                    if lane.awaits(batch_id):
                        self.journal.forget_plan(lane.name, batch_id)
                        trained = lane.trained(batch_id, e.version)
                        if lane.primary:
                            self.stats["groups_trained"] += len(trained)
            elif isinstance(e, TaskFailed):
                self.fail_task(lane, e.task_id, e.reason, e.detail)
                if e.ticket is not None:  # the server gave up on it: out of the work queue once its failure is durable
                    self.journal.ack_later(TaskRemoval(self.issuer.tasks, e.ticket))
            elif isinstance(e, SampleUndecodable):
                self.ingest.undecodable(lane, e.task_id, e.traj_id, e.detail, e.node if e.at > self.restored_at else None)
            elif isinstance(e, BatchFailed):
                if e.code is BatchRefusal.FORGED:  # another content under a planned id: the planned batch is still to come
                    self.stats["forged_batches"] += 1
                    continue
                fate = DROPPED_STALE if e.code is BatchRefusal.STALE else FAILED_TRAIN
                if lane.awaits(e.batch_id):
                    self.journal.forget_plan(lane.name, e.batch_id)
                lane.failed(e.batch_id, fate, e.detail)
        now = time.time()
        for hb in beats:
            self.pool.seen(hb, now)
        if self.watch.ignored:
            self.stats["ignored_announcements"] = self.watch.ignored

    def fail_task(self, lane: PolicyLane, task_id: str, reason: str, detail: str = "") -> None:
        """The task ended on the plane without its group (``failed:{reason}``); nothing if it was not out."""
        if lane.is_out(task_id):
            self.ingest.abandon(task_id)
            lane.settle(task_id, Fate(Outcome.FAILED, reason), error=detail)

    async def audit(self) -> None:
        """Every ``AUDIT_S``: the tasks out, and the kept groups of a restored state, that will never come back settled
        ``failed:lost`` (``dataflow/audit.py``); quarantined nodes an operator let back in."""
        now = time.time()
        if now - self._audited < AUDIT_S:
            return
        self._audited = now
        for _ in await self.reputation.readmit(lambda node: self.plane.state.get(AdmitRecord, node)):
            self.stats["readmitted"] += 1
            self.journal.changed()
        lane = self.lanes[self.recipe.primary]
        for task in await self.auditor.lost_tasks(now):
            self.stats["lost_tasks"] += 1
            log.warning("task %s is lost: acked on the plane, its group never complete", task)
            self.fail_task(lane, task, "lost", "acked by a node, its group never complete (a partial group, or trajectories lost)")
        for lane in self.lanes.values():  # a group kept before a restart whose trajectories do not come back
            for task in self.auditor.lost_groups(lane, now):
                self.stats["lost_groups"] += 1
                log.warning("lane %s: kept group %s is lost: its trajectories did not come back after the restart", lane.name, task)
                lane.settle(task, FAILED_LOST, error="kept before a restart, its trajectories never came back")

    def context(self) -> Context:
        return context(self.lanes, self.recipe.dataflow.max_staleness)

    def drained(self) -> bool:
        """No group partly back, every batch published and trained (sync mode releases tasks only then)."""
        return not self.ingest.assembling and all(lane.drained() for lane in self.lanes.values())

    # ------------------------------------------------------------ state
    @property
    def ledger(self) -> Ledger:
        """Task accounting of the primary policy (the one tasks are issued for)."""
        return self.lanes[self.recipe.primary].ledger

    def accounting(self) -> dict[str, Accounting]:
        return {p: lane.accounting() for p, lane in self.lanes.items()}

    def snapshot(self) -> DataflowState:
        return DataflowState(tasks=self.issuer.state(), lanes={p: lane.state() for p, lane in self.lanes.items()},
                             accounting=self.accounting(), pool=self.recipe.rollout.pool, mode=self.recipe.dataflow.mode,
                             quarantined=dict(self.reputation.quarantined))

    async def start(self) -> None:
        """Follow the plane, restore the last state, finish what the last dataflow left half done."""
        await self.watch.start()
        s = await self.plane.state.get(DataflowState)  # a failed read raises: never mistaken for a new run
        if s is None:
            return
        self.restored_at = s.ts
        self.reputation.quarantined.update(s.quarantined)
        for p, lane_state in s.lanes.items():
            if p in self.lanes and (fresh := self.lanes[p].load_state(lane_state)):
                log.warning("lane %s: plug-ins without saved state start fresh: %s", p, fresh)
        await self.issuer.restore(s.tasks)  # the tasks out found, those written ahead published again
        for lane in self.lanes.values():
            for plan in lane.planned():
                await self.server.republish(lane, plan)
        await self.journal.commit()
        log.info("dataflow restored: %d tasks issued, %d in flight, %s", self.ledger.issued, len(self.in_flight),
                 {p: lane.batch_seq for p, lane in self.lanes.items()})

    # ------------------------------------------------------------ advice and heartbeats
    async def measure(self, every_s: float = 0.25) -> None:
        await self.pool.measure(self.lanes, self.ledger.received, self.stats["groups_trained"], every_s)

    async def beat(self) -> None:
        advice, obs = await self.pool.publish()
        acc = self.accounting()
        per_policy = {p: {"buffered": acc[p].buffered, "awaiting": acc[p].awaiting, **lane.gauges(), "wait_frac": self.pool.wait_frac(p),
                          **{f"fate.{k}": v for k, v in acc[p].fates.items()}, **{f"late.{k}": v for k, v in acc[p].late.items()}}
                      for p, lane in self.lanes.items()}
        primary = self.lanes[self.recipe.primary]
        stats = DataflowStats(issued=self.ledger.issued, samples=sum(lane.ledger.samples for lane in self.lanes.values()),
                              in_flight=len(self.in_flight), buffered=acc[primary.name].buffered,
                              batches=primary.batch_seq, overdue=self.in_flight.overdue(time.time()),
                              wait_frac=obs.wait_frac, produce_rate=obs.produce_rate, consume_rate=obs.consume_rate,
                              autoscale_target=advice.target, autoscale_nodes=obs.nodes,
                              counters={**{k: float(v) for k, v in self.stats.items()}, "quarantined": len(self.reputation.quarantined)},
                              policies=per_policy)
        if self.metrics is not None:  # Prometheus: node-wide gauges, and per-policy ones labelled with the policy
            self.metrics.set({**stats.summary(), **stats.counters})
            for p, values in per_policy.items():
                self.metrics.child(p).set(values)
        await self.plane.beat(Heartbeat(worker_id=self.plane.worker_id, policy=primary.name, version=primary.version, stats=stats,
                                        metrics=serving()))


async def serve(recipe: Recipe, options: RoleOptions) -> None:
    async with Role("dataflow", options, recipe.plane.server_gone_timeout) as role:
        plane = role.plane
        await plane.ensure_topology(recipe.topology())
        df = Dataflow(recipe, plane, role.metrics)
        await df.start()
        role.on_exit(df.watch.stop)
        trajectories = TrajectoryLog(plane).reader()
        ack_wait = (await trajectories.settings()).ack_wait
        role.every(HEARTBEAT_PERIOD_S, df.beat)
        role.every(ack_wait / 3, df.journal.keep_alive)
        log.info("dataflow up for run %s (%s), policies %s", options.run, recipe.dataflow.mode, list(df.lanes))
        role.started()
        try:
            while not role.stop.is_set():
                await df.step(trajectories)
        finally:
            await role.leave()
            if not role.stop.urgent:  # without a server there is nothing to flush to; the next dataflow redoes it
                await df.journal.flush()
        # held trajectories stay unacked when the plane closes: the next dataflow gets them again
