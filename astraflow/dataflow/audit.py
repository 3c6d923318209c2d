"""The in-flight audit: tasks out that will never come back, found and settled ``failed:lost``.

A task is out until its primary group completes, a node dead-letters it, or the server gives up on it (max
deliveries, kept in the DLQ stream). One more end needs looking for: a node acked the task (its message left the TASK
work queue) but its group never completes (a node that published part of a group, trajectories lost). Such a task
would hold its place in flight for good, and enough of them stop the run: the issuing budget counts them.

So every ``AUDIT_S`` the dataflow looks up, by the TASK stream sequence each was published at, the oldest tasks out
for longer than the task ack wait (at most ``AUDIT_MAX`` a pass). A node publishes a task's trajectories before it
acks it, so when the task's message is first seen gone, its trajectories are at or below the TRAJ stream's last
sequence then. The task is lost once the dataflow's consumer has delivered past that sequence and ``grace`` (two
trajectory ack waits: a delivered trajectory not yet taken comes back within one) has passed with its group still
incomplete (:func:`lost_tasks`).

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
from astraflow.streams.plane import Plane

AUDIT_S = 5.0  # how often the audit runs
AUDIT_MAX = 64  # tasks looked up per pass, oldest first


@dataclass
class Auditor:
    """What the audit reads off the plane, and its bookkeeping from one pass to the next; the service settles what it
    finds."""

    plane: Plane
    pool: str  # whose consumer's ack wait bounds a task's time out
    in_flight: InFlight
    gone: dict[str, tuple[float, int]] = field(default_factory=dict)  # tasks whose message left: (since, TRAJ's last seq then)
    kept_missing: dict[str, dict[str, tuple[float, int]]] = field(default_factory=dict)  # per lane: kept groups not back
    waits: tuple[float, float] | None = None  # the server's ack waits: (task, trajectory)

    async def lost_tasks(self, now: float) -> list[str]:
        """Tasks out that will never come back: acked on the plane, their group never complete (:func:`lost_tasks`)."""
        names = self.plane.names
        if self.waits is None:
            task_wait = (await self.plane.consumer_settings(names.task_stream, names.pool_consumer(self.pool))).ack_wait
            self.waits = task_wait, (await self.plane.consumer_settings(names.traj_stream, names.DATAFLOW_CONSUMER)).ack_wait
        task_wait, traj_wait = self.waits
        looked = {t: (seq := self.in_flight.seqs.get(t)) is not None and await self.plane.holds(names.task_stream, seq)
                  for t in due(self.in_flight.since, now, task_wait)}
        if not (looked or self.gone):
            return []
        stored = await self.plane.stream_last(names.traj_stream)  # read after the lookups: their trajectories are in
        delivered = (await self.plane.lag(names.traj_stream, names.DATAFLOW_CONSUMER)).delivered
        return lost_tasks(self.gone, self.in_flight, looked, now, 2 * traj_wait, stored, delivered)

    def lost_groups(self, lane: PolicyLane, now: float) -> list[str]:
        """Groups ``lane`` kept before a restart whose trajectories do not come back (:func:`lost_groups`); after
        :meth:`lost_tasks` (which reads the ack waits)."""
        back = {t: lane.is_buffered(t) for t in lane.kept}
        grace = 2 * self.waits[1] if self.waits is not None else float("inf")
        return lost_groups(self.kept_missing.setdefault(lane.name, {}), back, now, grace)


def due(out_since: Mapping[str, float], now: float, older_than: float, limit: int = AUDIT_MAX) -> list[str]:
    """The tasks to look up: out for longer than ``older_than`` seconds, oldest first, at most ``limit``."""
    old = sorted((t for t, since in out_since.items() if now - since > older_than), key=lambda t: out_since[t])
    return old[:limit]


def lost_tasks(gone: dict[str, tuple[float, int]], out: Container[str], looked_up: Mapping[str, bool], now: float, grace: float,
               stored: int, delivered: int) -> list[str]:
    """``looked_up``: task -> its message is still in the TASK stream. A task first seen gone is noted with the time and
    ``stored`` (the TRAJ stream's last sequence now); one seen there again, or no longer ``out``, is forgotten. Lost (and
    forgotten): gone for longer than ``grace`` with the consumer ``delivered`` up to the sequence noted."""
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
