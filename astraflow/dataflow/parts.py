"""A trajectory group's or bundle's delivery, taken trajectory by trajectory.

A node publishes the samples of one task for one policy as one :class:`TrajectoryGroup` message,
and the groups of the tasks it finished together as one :class:`TrajectoryBundle`. The dataflow
admits, holds, acks and dead-letters trajectories, one at a time (``ingest.py``, ``durability.py``),
so such a delivery is cut into one :class:`Part` per trajectory, each a delivery of its own to
everything downstream:

- the message is acked once every part is settled: acked, or dead-lettered (the part's own
  trajectory, encoded alone, goes to ``dlq.traj`` with its reason, so it decodes there as any
  rejected trajectory does);
- a part given back (``nak``) gives the whole message back at once; the parts settled after that
  ack nothing (the message comes again, and each of its trajectories is admitted again: a copy of
  one held is refreshed, of one settled acked and ignored);
- ``in_progress`` on several parts tells the server once per second at most.

A bundle is first cut by group (:func:`by_group`): a group is refused whole, as one dead-letter
entry, through its :class:`GroupParts` (its parts settled together, the other groups untouched).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import cast

from astraflow.streams.codec import encode
from astraflow.streams.messages import Trajectory, TrajectoryBundle, TrajectoryGroup
from astraflow.streams.plane import Delivery

KEEP_ALIVE_EVERY_S = 1.0


@dataclass
class _Shared:
    delivery: Delivery[TrajectoryGroup] | Delivery[TrajectoryBundle]
    position: int  # where the trajectory log keeps the message
    open: int  # parts not settled yet
    given_back: bool = False
    told_at: float = field(default=-1e9)  # when the server was last told the message is still being worked on


class Part:
    """One trajectory of a group's delivery: what ``ingest`` takes for a delivery of that trajectory alone."""

    def __init__(self, msg: Trajectory, shared: _Shared) -> None:
        self.msg = msg
        self._shared = shared
        self._settled = False

    @property
    def position(self) -> int:
        return self._shared.position

    @property
    def subject(self) -> str:
        return self._shared.delivery.subject

    async def ack(self) -> None:
        if self._settle():
            await self._shared.delivery.ack()

    async def reject(self, reason: str, code: str = "") -> None:
        await self._shared.delivery.dead_letter(encode(self.msg), reason, code)
        if self._settle():
            await self._shared.delivery.ack()

    async def nak(self, delay: float | None = None) -> None:
        if not self._shared.given_back:
            self._shared.given_back = True
            await self._shared.delivery.nak(delay)

    async def in_progress(self) -> None:
        now = time.monotonic()
        if now - self._shared.told_at >= KEEP_ALIVE_EVERY_S:
            self._shared.told_at = now
            await self._shared.delivery.in_progress()

    def _settle(self) -> bool:
        """Count this part settled (once); whether that settles the message (the last part, none given back)."""
        if self._settled:
            return False
        self._settled = True
        self._shared.open -= 1
        return self._shared.open == 0 and not self._shared.given_back


class GroupParts:
    """One task's group within a bundle's delivery, refused whole: dead-lettered as one :class:`TrajectoryGroup`
    entry, its parts settled (the message acked once the bundle's other groups are settled too)."""

    def __init__(self, group: TrajectoryGroup, parts: list[Part], shared: _Shared) -> None:
        self.group, self.parts, self._shared = group, parts, shared

    async def reject(self, reason: str, code: str = "") -> None:
        await self._shared.delivery.dead_letter(encode(self.group), reason, code)
        if any([p._settle() for p in self.parts]):  # the last of the message's parts: it is settled
            await self._shared.delivery.ack()


def taken(d: Delivery[Trajectory | TrajectoryGroup | TrajectoryBundle]) -> list[Part | Delivery[Trajectory]]:
    """A TRAJ stream delivery as deliveries of one trajectory each: itself, or one :class:`Part` per trajectory."""
    return [p for _, _, parts in by_group(d) for p in parts]


Refusable = Delivery[TrajectoryGroup] | GroupParts  # what refuses a group whole: its message, or its parts of a bundle


def by_group(d: Delivery[Trajectory | TrajectoryGroup | TrajectoryBundle]
             ) -> list[tuple[TrajectoryGroup | None, Refusable | None, list[Part | Delivery[Trajectory]]]]:
    """A TRAJ stream delivery cut by task group: (the group, what refuses it whole, its trajectories' deliveries); a
    trajectory alone is (None, None, [itself])."""
    msg = d.msg
    if isinstance(msg, Trajectory):
        return [(None, None, [cast(Delivery[Trajectory], d)])]
    shared = _Shared(cast(Delivery[TrajectoryBundle], d), d.position, open=len(msg.trajectories))
    if isinstance(msg, TrajectoryGroup):
        return [(msg, cast(Delivery[TrajectoryGroup], d), [Part(t, shared) for t in msg.trajectories])]
    out: list[tuple[TrajectoryGroup | None, Refusable | None, list[Part | Delivery[Trajectory]]]] = []
    for g in msg.groups:
        parts = [Part(t, shared) for t in g.trajectories]
        out.append((g, GroupParts(g, parts, shared), list(parts)))
    return out
