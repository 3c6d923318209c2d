"""The in-flight audit: tasks out that will never come back, found and settled ``failed:lost``.

A task is out until its primary group completes, a node dead-letters it, or the server gives up on it (max
deliveries, kept in the DLQ stream). One more end needs looking for: a node acked the task (it left the task queue)
but its group never completes (a node that published part of a group, trajectories lost). Such a task would hold its
place in flight for good, and enough of them stop the run: the issuing budget counts them.

So every ``AUDIT_S`` the dataflow asks the task queue, by the ticket each was issued with, about the oldest tasks out
for longer than the queue's redelivery wait (at most ``AUDIT_MAX`` a pass). A node publishes a task's trajectories
before it acks it, so when the task is first seen gone from the queue, its trajectories are below the trajectory
log's mark then. The task is lost once the log has handed the dataflow everything up to that mark and ``grace`` (two
trajectory redelivery waits: a delivered trajectory not yet taken comes back within one) has passed with its group
still incomplete (:func:`lost_tasks`).

A group kept before a restart (in the state, its trajectories unacked) comes back by redelivery; one not back in
memory after ``grace`` would count as buffered for good, and is settled ``failed:lost`` too (:func:`lost_groups`).
The bookkeeping is pure (the functions below); :class:`Auditor` reads the plane for it, and the service settles what
it finds.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass, field

from astraflow.dataflow.inflight import InFlight
from astraflow.dataflow.lane import PolicyLane
from astraflow.dataflow.lifecycle import Stage
from astraflow.streams.task_queue import TaskQueue
from astraflow.streams.trajectory_log import TrajectoryLog

AUDIT_S = 5.0  # how often the audit runs
AUDIT_MAX = 64  # tasks looked up per pass, oldest first


@dataclass
class Auditor:
    """What the audit reads off the plane, and its bookkeeping from one pass to the next; the service settles what it
    finds."""

    tasks: TaskQueue  # its pool's redelivery wait bounds a task's time out
    trajectories: TrajectoryLog
    in_flight: InFlight
    gone: dict[str, tuple[float, int]] = field(default_factory=dict)  # tasks that left the queue: (since, the log's mark then)
    kept_missing: dict[str, dict[str, tuple[float, int]]] = field(default_factory=dict)  # per lane: kept groups not back
    waits: tuple[float, float] | None = None  # the server's ack waits: (task, trajectory)

    async def lost_tasks(self, now: float) -> list[str]:
        """Tasks out that will never come back: acked on the plane, their group never complete (:func:`lost_tasks`)."""
        if self.waits is None:
            self.waits = await self.tasks.redelivery_wait(), await self.trajectories.redelivery_wait()
        task_wait, traj_wait = self.waits
        looked = {t: (ticket := self.in_flight.ticket(t)) is not None and await self.tasks.queued(ticket)
                  for t in due(self.in_flight.out_since(), now, task_wait)}
        if not (looked or self.gone):
            return []
        stored = await self.trajectories.mark()  # read after the lookups: their trajectories are in
        return lost_tasks(self.gone, self.in_flight, looked, now, 2 * traj_wait, stored, await self.trajectories.handed_over())

    def lost_groups(self, lane: PolicyLane, now: float) -> list[str]:
        """Groups ``lane`` kept before a restart whose trajectories do not come back (:func:`lost_groups`); after
        :meth:`lost_tasks` (which reads the ack waits)."""
        back = {r.task_id: r.group is not None for r in lane.tasks.at_stage(Stage.KEPT)}
        grace = 2 * self.waits[1] if self.waits is not None else float("inf")
        return lost_groups(self.kept_missing.setdefault(lane.name, {}), back, now, grace)


def due(out_since: Mapping[str, float], now: float, older_than: float, limit: int = AUDIT_MAX) -> list[str]:
    """The tasks to look up: out for longer than ``older_than`` seconds, oldest first, at most ``limit``."""
    old = sorted((t for t, since in out_since.items() if now - since > older_than), key=lambda t: out_since[t])
    return old[:limit]


def lost_tasks(gone: dict[str, tuple[float, int]], out: Container[str], looked_up: Mapping[str, bool], now: float, grace: float,
               stored: int, delivered: int) -> list[str]:
    """``looked_up``: task -> it is still in the task queue. A task first seen gone is noted with the time and
    ``stored`` (how far the trajectory log is written now); one seen there again, or no longer ``out``, is forgotten.
    Lost (and forgotten): gone for longer than ``grace`` with the log ``delivered`` to the dataflow up to the mark noted."""
    return _absent_too_long(gone, out, looked_up, now, grace, stored, delivered)


def lost_groups(missing: dict[str, tuple[float, int]], back: Mapping[str, bool], now: float, grace: float) -> list[str]:
    """``back``: every kept group -> it is in memory again. One first seen missing is noted; one back, or no longer kept,
    is forgotten. Lost (and forgotten): missing for longer than ``grace``."""
    return _absent_too_long(missing, back, back, now, grace, 0, 0)


def _absent_too_long(absent: dict[str, tuple[float, int]], tracked: Container[str], present: Mapping[str, bool], now: float,
                     grace: float, mark: int, reached: int) -> list[str]:
    """``absent``: id -> (first seen absent, ``mark`` then), updated in place; the ids absent past ``grace`` whose mark
    ``reached`` has got to are returned and dropped."""
    for key in [k for k in absent if k not in tracked]:
        del absent[key]
    for key, here in present.items():
        if here:
            absent.pop(key, None)
        else:
            absent.setdefault(key, (now, mark))
    lost = [k for k, (since, at) in absent.items() if now - since > grace and reached >= at]
    for key in lost:
        del absent[key]
    return lost
