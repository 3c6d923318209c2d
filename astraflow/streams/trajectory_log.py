"""The trajectory flow as the dataflow sees it: nodes publish trajectories (alone, in a task's group, or in a bundle of
groups), the dataflow reads them through its durable consumer and acks each once its fate is durable; batches name them
by where the log keeps them, and trainers read them from there.

What the audit needs to know (has every trajectory stored by a moment been handed to the dataflow since?) is asked
in marks: how far the log is written, how far its reader got; the two compare, and mean nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from astraflow.streams.consuming import Consumer, Lag
from astraflow.streams.trajectories import TrajMessage, decode_traj

if TYPE_CHECKING:
    from astraflow.streams.plane import Plane

READ_WINDOW = 256  # messages the dataflow's reader may be handed ahead of its pulls


class TrajectoryLog:
    """The run's TRAJ stream and the dataflow's reader of it."""

    def __init__(self, plane: Plane) -> None:
        self.plane = plane
        self._stream, self._reader = plane.names.traj_stream, plane.names.DATAFLOW_CONSUMER

    def reader(self) -> Consumer[TrajMessage]:
        """The dataflow's pull of every policy's trajectories, groups and bundles of groups (the log carries all three):
        one reader that takes everything, so a standing request (``pull.py``) of ``READ_WINDOW`` messages."""
        return Consumer(self.plane, self._stream, self._reader, decode_traj, standing=READ_WINDOW)

    async def backlog(self) -> Lag:
        """Trajectories waiting for the dataflow and in its hands, unacked."""
        return await self.plane.stored.lag(self._stream, self._reader)

    async def redelivery_wait(self) -> float:
        """Seconds a trajectory the dataflow took may go unacked before it is delivered again."""
        return (await self.plane.stored.consumer_settings(self._stream, self._reader)).ack_wait

    async def mark(self) -> int:
        """How far the log is written now: a trajectory published before this call is at or below the mark."""
        return await self.plane.stored.stream_last(self._stream)

    async def handed_over(self) -> int:
        """How far the dataflow's reader has been handed the log: everything at or below this mark (a :meth:`mark`)."""
        return (await self.backlog()).delivered
