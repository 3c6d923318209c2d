"""Serving batches, per lane, while that policy's trainer has room.

For each lane, as long as its buffer holds a batch worth of groups:

1. the trainer consumer's backlog, read from the server at the start of the turn (every lane's
   together, with the task budget's lag: :meth:`BatchServer.read_backlogs`), with the batches
   planned this turn, may not reach ``max_batch_backlog``, else the lane waits (counted as
   ``backpressure``); one slow trainer never holds back another policy's lane;
2. let the server plug-in choose (it may drop stale or expired groups: fate ``dropped:R``);
3. plan the batch (``PolicyLane.plan``: id, groups, trajectory references — TRAJ stream
   sequence, trajectory id, task id —, advantages; its tasks move to ``planned``) and queue its plan
   record for the trainer (``BatchPlanRecord``: the manifest's digest; the trainer trains nothing
   else) in the journal (:meth:`BatchServer.plan`).

The dataflow then commits the plans with everything else of the turn (write-ahead), publishes
the manifests with ``Nats-Msg-Id`` = batch id, together with the turn's tasks, in one pipelined
publication, and calls :meth:`BatchServer.published`: the plan is cleared and the fresh groups'
trajectories are released, to be acked after the next durable write. The plan record is deleted
once the batch's fate is known.

A batch is a manifest: a few dozen bytes per trajectory, however long the trajectories are. The
trainer reads the trajectories from the TRAJ stream by sequence (Limits retention keeps them), so
nothing here reads a trajectory back. A plan found at restart is the identical manifest, published
again under its id (``republish``); the server drops it if the first publication had landed.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from astraflow.algorithms import Group
from astraflow.config import DataflowConfig
from astraflow.dataflow.durability import Journal
from astraflow.dataflow.groups import HeldGroup
from astraflow.dataflow.lane import PolicyLane, context
from astraflow.streams.batch_queue import BatchQueue
from astraflow.streams.dataflow_state import BatchPlan
from astraflow.streams.fates import Fate, Outcome
from astraflow.streams.messages import Batch, Message
from astraflow.streams.plane import Plane
from astraflow.streams.state import BatchPlanRecord

log = logging.getLogger(__name__)


def plan_record(batch: Batch) -> BatchPlanRecord:
    """What the trainer checks the batch against (written before the batch is published)."""
    return BatchPlanRecord(policy=batch.policy, batch_id=batch.batch_id, digest=batch.digest(), trajectories=len(batch.refs))


@dataclass(frozen=True)
class Planned:
    """A batch planned this turn: published after the turn's commit."""

    lane: PolicyLane
    batch: Batch
    release: list[str]  # the trajectories of its fresh groups: acked once its publication is durable


class BatchServer:
    def __init__(self, plane: Plane, lanes: Mapping[str, PolicyLane], journal: Journal, cfg: DataflowConfig, stats: Counter[str],
                 rng: random.Random) -> None:
        self.plane = plane
        self.lanes = lanes
        self.journal = journal
        self.cfg = cfg
        self.stats = stats  # the dataflow's heartbeat counters
        self.rng = rng

    async def read_backlogs(self) -> None:
        """The backlog of each trainer whose lane holds a batch worth, as the server counts it now (read before :meth:`plan`)."""
        ready = [lane for lane in self.lanes.values() if lane.ready(self.cfg.groups_per_batch)]
        lags = await asyncio.gather(*(BatchQueue(self.plane, lane.name).backlog() for lane in ready))
        for lane, lag in zip(ready, lags, strict=True):
            lane.backlog = lag.pending

    def plan(self) -> list[Planned]:
        """Every batch the lanes' buffers and their trainers' backlogs allow now, written ahead in the journal."""
        return [p for lane in self.lanes.values() for p in self.plan_lane(lane)]

    def plan_lane(self, lane: PolicyLane) -> list[Planned]:
        n = self.cfg.groups_per_batch
        out: list[Planned] = []
        while lane.ready(n):
            if lane.backlog + len(out) >= self.cfg.max_batch_backlog:
                lane.backpressured()
                break
            result = lane.choose(n, context(self.lanes, self.cfg.max_staleness), self.rng)
            for task_id, reason in result.dropped:
                self.settle(lane, task_id, Fate(Outcome.DROPPED, reason))
            if not result.batch:
                if result.dropped:
                    continue
                break
            chosen = [h for g in result.batch if (h := self.held(lane, g)) is not None]
            plan = lane.plan(chosen, list(result.taken), created_at=time.time())
            batch = plan.to_batch(lane.name)
            self.journal.write_ahead(plan_record(batch))  # its tasks get fate records once trained or refused
            fresh = set(plan.tasks)
            out.append(Planned(lane, batch, [t for h in chosen if h.task_id in fresh for t in h.traj_ids]))
        lane.backlog += len(out)  # queued for the trainer from now, until the backlog is measured again
        return out

    def published(self, planned: list[Planned]) -> None:
        """These batches are on the plane: their plans are cleared, their fresh trajectories released."""
        for p in planned:
            p.lane.published(p.batch.batch_id)
            self.journal.release(p.release)
        if planned:
            self.journal.changed()

    def settle(self, lane: PolicyLane, task_id: str, fate: Fate) -> None:
        held = lane.settle(task_id, fate)
        if held is not None:
            self.journal.release(held.traj_ids)

    def held(self, lane: PolicyLane, group: Group) -> HeldGroup | None:
        """A batch group: fresh from the buffer, or replayed (after a restart: its samples as the replay plug-in
        kept them, and the log positions the lane remembers)."""
        held = lane.find(group.task_id)
        if held is not None:
            return held
        at = lane.replay_positions(group.task_id, len(group.samples))
        if at is None:  # a replay memory larger than what the lane remembers
            log.warning("lane %s: replayed group %s is no longer remembered; left out of the batch", lane.name, group.task_id)
            self.stats["replay_missing"] += 1
            return None
        held = HeldGroup(group, at)
        lane.recent.remember(held)
        return held

    def item(self, batch: Batch) -> tuple[str, Message, str]:
        """What to publish for ``batch`` (its policy's queue says)."""
        return BatchQueue(self.plane, batch.policy).item(batch)

    async def republish(self, lane: PolicyLane, plan: BatchPlan) -> None:
        """A batch planned before a restart: its plan record written again, the manifest published again under its id."""
        batch = plan.to_batch(lane.name)
        await self.plane.state.put(plan_record(batch))
        await self.plane.publish(*self.item(batch))
        lane.published(plan.batch_id)
        self.stats["republished_batches"] += 1
        log.info("batch %s was planned before the restart: published again (the server keeps one copy)", plan.batch_id)
