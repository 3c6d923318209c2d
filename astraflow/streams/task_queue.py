"""The task flow as the roles see it: the dataflow issues tasks, a pool's nodes pull them, and what happened to each
is asked by the ticket its issue returned, never by stream, consumer or sequence.

A task is a message of the run's TASK work queue, pulled by the pool's durable consumer: a node acks it once its
trajectories are published, naks it back, or lets it be redelivered; the server gives up on it after the consumer's
``max_deliver`` (an advisory the DLQ stream keeps). Its ticket is where the queue holds it; an acked task leaves the
queue, so ``queued(ticket)`` turning false is "acknowledged" (whether it was ever answered is the dataflow's to know).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from astraflow.streams.consuming import Consumer, Lag, Subscription
from astraflow.streams.messages import Message, Task

if TYPE_CHECKING:
    from astraflow.streams.plane import Plane

Ticket = int  # where the queue holds a task (its TASK stream sequence); only this module does arithmetic on it


class TaskQueue:
    """The TASK work queue of one run and the pull of one pool (``rollout.pool``)."""

    def __init__(self, plane: Plane, pool: str = "raas") -> None:
        self.plane, self.pool = plane, plane.names.pool_consumer(pool)
        self._stream = plane.names.task_stream

    def item(self, task: Task) -> tuple[str, Message, str]:
        """What issuing ``task`` publishes: its subject, the task, its message id (a copy issued again is dropped by the
        server); for a caller that pipelines it with other publications (``Plane.publish_many``: the tickets)."""
        return self.plane.names.task(task.workflow), task, task.task_id

    async def issue(self, tasks: Sequence[Task]) -> list[Ticket]:
        """Publish ``tasks``; their tickets."""
        return await self.plane.publish_many([self.item(t) for t in tasks])

    def pull(self) -> Consumer[Task]:
        """The pool's pull: what a node takes tasks from (ack, nak, in-progress on each delivery)."""
        return self.plane.consumer(self._stream, self.pool, Task)

    async def backlog(self) -> Lag:
        """Tasks waiting for a node (``pending``) and out with one, unacked (``ack_pending``), as the server counts now."""
        return await self.plane.stored.lag(self._stream, self.pool)

    async def redelivery_wait(self) -> float:
        """Seconds a task out with a node may go unacked before the server hands it to another."""
        return (await self.plane.stored.consumer_settings(self._stream, self.pool)).ack_wait

    async def queued(self, ticket: Ticket) -> bool:
        """Whether the task is still in the queue (waiting, out unacked, or given up on): False once a node acked it."""
        return await self.plane.stored.holds(self._stream, ticket)

    async def read(self, ticket: Ticket) -> Task:
        """The task at ``ticket`` (NotFoundError when it left the queue)."""
        return await self.plane.stored.get(self._stream, ticket, Task)

    async def remove(self, ticket: Ticket) -> bool:
        """Take a task out of the queue for good (one the server gave up on); False when it was gone already."""
        return await self.plane.stored.delete(self._stream, ticket)

    async def queued_tasks(self) -> list[tuple[Ticket, Task]]:
        """Every task the queue still holds, with its ticket, oldest first (after a restart: where each task out is)."""
        return await self.plane.stored.held(self._stream, self.plane.names.all("task"), Task)

    async def on_given_up(self, cb: Callable[[Ticket], Awaitable[None]]) -> Subscription:
        """Call ``cb(ticket)`` for every task the server gave up on (out of deliveries), from the first: idempotent."""
        return await self.plane.on_max_deliveries(self._stream, self.pool, cb)
