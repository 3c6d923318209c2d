"""The batch flow as the roles see it: the dataflow publishes a policy's batches, that policy's trainer pulls them.

One policy's batches are messages on ``batch.{policy}`` of the run's BATCH stream, pulled by its trainer's durable
consumer; the trainer acks a batch once the version it trained is durable, and a restarted trainer is handed what it
never acked. Stream, subject and consumer names stay here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from astraflow.streams.consuming import Consumer, Lag
from astraflow.streams.messages import Batch, Message

if TYPE_CHECKING:
    from astraflow.streams.plane import Plane


class BatchQueue:
    """The batches of one policy."""

    def __init__(self, plane: Plane, policy: str) -> None:
        self.plane, self.policy = plane, policy
        self._stream, self._trainer = plane.names.batch_stream, plane.names.trainer_consumer(policy)

    def item(self, batch: Batch) -> tuple[str, Message, str]:
        """What publishing ``batch`` takes: its subject, the manifest, its message id (a copy published again is dropped
        by the server); for a caller that pipelines it with other publications (``Plane.publish_many``)."""
        return self.plane.names.batch(self.policy), batch, batch.batch_id

    def pull(self) -> Consumer[Batch]:
        """The trainer's pull."""
        return self.plane.consumer(self._stream, self._trainer, Batch)

    async def backlog(self) -> Lag:
        """Batches waiting for the trainer (``pending``) and in its hands, unacked (``ack_pending``)."""
        return await self.plane.stored.lag(self._stream, self._trainer)

    async def kept(self) -> list[Batch]:
        """Every batch of the policy the stream still keeps (trained or not), oldest first."""
        return [b for _, b in await self.plane.stored.held(self._stream, self.plane.names.batch(self.policy), Batch)]
