"""Settling finished tasks together: their trajectories published in one go, then their acks.

A node's slots finish tasks independently, and often together (an engine answers a batch of
requests at once). Each finished task hands its delivery and trajectories to :meth:`Outbox.settle`;
what arrives while a settlement is under way waits for the next one, so every settlement takes
all the tasks that finished meanwhile:

1. the trajectories of all of them are published together (``publish_trajectories``: each policy's
   task groups in one message when they fit, else a message per group or per trajectory, one too
   large for a message by reference), and the server's acks are awaited together: one wait for the
   lot instead of one per task; when that fails, each task's are published again on their own,
   so each task learns its own error (what was stored already is deduplicated);
2. then each task whose trajectories are all stored is acked, the acks written in one go.

The guarantee is each task's own, as before: a task is acked only after its trajectories are
stored. A task whose publication failed is not acked; :meth:`Outbox.settle` raises its error to
that task's caller (which naks or dead-letters it), and the other tasks of the settlement are not
affected. A node that dies mid-settlement leaves its tasks unacked: they are redelivered after
``ack_wait``; trajectories stored twice (in a message of other tasks the second time) are taken once, by their
ids, by the dataflow.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from astraflow.streams.messages import Task, Trajectory
from astraflow.streams.plane import Delivery, Plane
from astraflow.streams.trajectories import publish_trajectories


@dataclass
class _Finished:
    delivery: Delivery[Task]
    trajectories: list[Trajectory]
    settled: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Outbox:
    """Group settlement of finished tasks on one plane. ``timed``: called with the wall time of each settlement
    (publishing and acking), counted once however many tasks it took."""

    def __init__(self, plane: Plane, timed: Callable[[float], None] | None = None) -> None:
        self.plane = plane
        self.timed = timed
        self.settlements = 0
        self._waiting: list[_Finished] = []
        self._settling: asyncio.Task[None] | None = None

    async def publish(self, trajectories: list[Trajectory]) -> None:
        """Publish trajectories of no delivery (an agent session's), by reference when too large, like any; timed."""
        t0 = time.perf_counter()
        await publish_trajectories(self.plane, trajectories)
        if self.timed is not None:
            self.timed(time.perf_counter() - t0)

    async def settle(self, delivery: Delivery[Task], trajectories: list[Trajectory]) -> None:
        """Publish ``trajectories``, then ack ``delivery``; returns once both are done. Raises what publishing them
        raised (``MessageTooLarge``, a server error): then ``delivery`` is left unsettled, for the caller to decide."""
        finished = _Finished(delivery, trajectories)
        self._waiting.append(finished)
        if self._settling is None or self._settling.done():
            self._settling = asyncio.create_task(self._settle_waiting())
        await finished.settled

    async def _settle_waiting(self) -> None:
        await asyncio.sleep(0)  # tasks whose generation ended in the same turn of the event loop join this settlement
        while self._waiting:
            batch, self._waiting = self._waiting, []
            t0 = time.perf_counter()
            try:
                await self._settle(batch)
            finally:
                for f in batch:  # a settlement cut short (cancelled): its tasks stay unacked, their callers told
                    _resolve(f.settled, RuntimeError("the settlement of this task was interrupted"))
                self.settlements += 1
                if self.timed is not None:
                    self.timed(time.perf_counter() - t0)

    async def _settle(self, batch: list[_Finished]) -> None:
        errors: list[BaseException | None] = [None] * len(batch)
        try:  # all of them at once: each policy's groups in one message when they fit
            await publish_trajectories(self.plane, [t for f in batch for t in f.trajectories])
        except Exception as e:  # task by task, so each task has its own error (what was stored is deduplicated)
            each = [e] if len(batch) == 1 else await asyncio.gather(
                *(publish_trajectories(self.plane, f.trajectories) for f in batch), return_exceptions=True)
            errors = [r if isinstance(r, BaseException) else None for r in each]
        for f, error in zip(batch, errors, strict=True):
            if isinstance(error, BaseException):
                _resolve(f.settled, error)
                continue
            try:
                await f.delivery.ack()  # only now: its trajectories are stored
            except Exception as e:  # the connection is gone: the task is redelivered, its trajectories deduplicated
                _resolve(f.settled, e)
            else:
                _resolve(f.settled, None)


def _resolve(fut: asyncio.Future[None], error: BaseException | None) -> None:
    """Settle ``fut`` unless it is settled already (or its caller gave up on it)."""
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
