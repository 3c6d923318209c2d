"""Ingesting trajectories: admit, assemble into groups, land complete groups in their lane.

Each delivery of the TRAJ stream goes through, in order:

1. ``admit`` — the one place a trajectory is accepted or turned away. Turned away: a policy the
   run does not have (to the DLQ with the reason). Acked and ignored: a copy of a task already
   settled or batched (a redelivery after a restart), another sample for a group already
   complete. A redelivery of a trajectory held now replaces the held delivery. Semantic checks
   of a trajectory's values belong here too, as further rejections.
2. assembly per ``(task, policy)`` (``groups.Assembler``); the delivery stays held, unacked,
   until its group's fate is decided.
3. ``land`` (pure) for a group that completes: curator feedback on every completed group, then
   the late policy for one past its task's deadline, then the filters. A group kept before a
   restart goes straight back into the buffer, with its weight, without the hooks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from astraflow.algorithms import Context, Group, Pipeline
from astraflow.config import DataflowConfig
from astraflow.dataflow.durability import Ackable, Journal
from astraflow.dataflow.groups import Assembler, HeldGroup
from astraflow.dataflow.inflight import InFlight
from astraflow.dataflow.lane import PolicyLane, context
from astraflow.streams.messages import Trajectory
from astraflow.streams.plane import Consumer


class Incoming(Ackable, Protocol):
    """A delivery of the TRAJ stream (``Delivery[Trajectory]``)."""

    msg: Trajectory

    @property
    def stream_seq(self) -> int: ...

    async def reject(self, reason: str) -> None: ...


@dataclass(frozen=True)
class Admission:
    action: Literal["reject", "ack", "refresh", "assemble"]
    reason: str = ""  # the DLQ reason (reject), the counter to bump (ack, refresh)


ASSEMBLE = Admission("assemble")


@dataclass(frozen=True)
class Landing:
    """What becomes of a group that completed."""

    fate: str | None = None  # a terminal fate (``filtered:R``, ``dropped:expired``); None: kept
    weight: float = 1.0  # factor on its advantages when kept
    late: str | None = None  # what the late policy did with it (kept / downweighted / dropped); None: on time


def land(group: Group, pipeline: Pipeline, ctx: Context, deadline: float | None, cfg: DataflowConfig) -> Landing:
    """Curators observe every completed group; a group completing after its deadline is dropped
    under ``late_policy: drop``; then the filters; a late group that passes is kept as is or
    down-weighted by ``late_weight``."""
    pipeline.observe(group, ctx)
    late = deadline is not None and ctx.now > deadline
    if late and cfg.late_policy == "drop":
        return Landing(fate="dropped:expired", late="dropped")
    decision = pipeline.keep(group, ctx)
    if not decision.keep:
        return Landing(fate=f"filtered:{decision.reason}")
    if not late:
        return Landing()
    if cfg.late_policy == "downweight":
        return Landing(weight=cfg.late_weight, late="downweighted")
    return Landing(late="kept")


class TrajectoryIngest:
    def __init__(self, lanes: Mapping[str, PolicyLane], in_flight: InFlight, journal: Journal, cfg: DataflowConfig,
                 stats: Counter[str]) -> None:
        self.lanes = lanes
        self.in_flight = in_flight
        self.journal = journal
        self.cfg = cfg
        self.stats = stats  # the dataflow's heartbeat counters
        self.assembler = Assembler()

    @property
    def assembling(self) -> bool:
        return self.assembler.assembling

    async def pull(self, trajectories: Consumer[Trajectory], timeout: float = 0.1) -> int:
        deliveries = await trajectories.pull(batch=256, timeout=timeout)
        for d in deliveries:
            await self.take(d)
        return len(deliveries)

    def admit(self, t: Trajectory) -> Admission:
        """The one place a trajectory is accepted or turned away (see the module's docstring)."""
        lane = self.lanes.get(t.policy)
        if lane is None:
            return Admission("reject", f"unknown policy {t.policy!r}; run has {list(self.lanes)}")
        if lane.is_closed(t.task_id):  # settled or batched before (a redelivery after a restart, a late copy)
            return Admission("ack", "redelivered_settled")
        if self.journal.holds(t.traj_id):  # redelivered while we hold it: the newer delivery is the live one
            return Admission("refresh", "redelivered_held")
        if lane.is_buffered(t.task_id):  # another sample for a complete group
            return Admission("ack", "duplicates")
        return ASSEMBLE

    async def take(self, d: Incoming) -> None:
        t = d.msg
        admission = self.admit(t)
        if admission.action == "reject":
            await d.reject(admission.reason)
            return
        if admission.action != "assemble":
            if admission.action == "refresh":
                self.journal.hold(t.traj_id, d)
            else:
                self.journal.ack_later(d)
            self.stats[admission.reason] += 1
            return
        deadline = self.in_flight.deadline(t.task_id) if self.cfg.late_policy == "drop" else None  # samples carry it for EDF
        held = self.assembler.add(t, d.stream_seq, deadline)
        if held is False:  # a second sample at an index, or a copy of a group completed here
            self.journal.ack_later(d)
            self.stats["duplicates"] += 1
            return
        self.journal.hold(t.traj_id, d)
        if held is not None:
            self.complete(self.lanes[t.policy], held)

    def complete(self, lane: PolicyLane, held: HeldGroup) -> None:
        self.journal.changed()
        if lane.primary:
            self.in_flight.land(held.task_id)
        weight = lane.kept_weight(held.task_id)
        if weight is not None:  # kept before a restart: straight back into the buffer, counted and hooked already
            held.weight = weight
            lane.keep(held)
            return
        landing = land(held.group, lane.pipeline, context(self.lanes, self.cfg.max_staleness), self.in_flight.deadline(held.task_id),
                       self.cfg)
        lane.receive(landing.late)
        if landing.fate is None:
            held.weight = landing.weight
            lane.keep(held)
            return
        lane.settle(held.task_id, landing.fate)
        self.journal.release(held.traj_ids)
        self.journal.record(lane.name, held.task_id, landing.fate)

    def abandon(self, task_id: str) -> None:
        """The task failed: forget what came back of it and ack that once the failure is durable."""
        self.journal.release(self.assembler.drop(task_id))
