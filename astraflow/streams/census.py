"""What the run's flows hold right now, for the operator's eyes (``astraflow status``, the launcher's live view):
messages per stream, and the backlog of every pull (tasks to the pool, trajectories to the dataflow, batches to each
trainer). Read-only; a pull that does not exist yet is None.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from nats.js.errors import NotFoundError

from astraflow.streams.batch_queue import BatchQueue
from astraflow.streams.consuming import Lag
from astraflow.streams.subjects import FAMILIES
from astraflow.streams.task_queue import TaskQueue
from astraflow.streams.trajectory_log import TrajectoryLog

if TYPE_CHECKING:
    from astraflow.streams.plane import Plane


async def stream_sizes(plane: Plane) -> dict[str, int | None]:
    """Messages each of the run's streams holds, by stream name (None: the stream does not exist)."""
    return {s: await plane.stored.stream_msgs(s) for s in (plane.names.stream(f) for f in FAMILIES)}


async def backlogs(plane: Plane, pool: str, policies: Iterable[str]) -> dict[str, Lag | None]:
    """The backlog of each pull, labelled ``task``, ``traj`` and ``batch.{policy}``; a plane that does not answer
    raises (the launcher counts that toward its patience)."""
    pulls = {"task": TaskQueue(plane, pool).backlog, "traj": TrajectoryLog(plane).backlog,
             **{f"batch.{p}": BatchQueue(plane, p).backlog for p in policies}}
    out: dict[str, Lag | None] = {}
    for label, backlog in pulls.items():
        try:
            out[label] = await backlog()
        except NotFoundError:  # the consumer (or its stream) does not exist yet
            out[label] = None
    return out
