"""Group commit: a checkpoint every K versions off the critical path, batch acks held until one covers them.

Per version the trainer announces its weights (the version's commit point) and *holds* the batch's
delivery: unacked, kept alive with ``in_progress()`` so the server does not redeliver it. Every
``trainer.checkpoint_every`` versions it takes an in-memory snapshot (weights, optimizer, RNG, meta:
``Checkpointer.snapshot``) on the loop and writes it from a background thread (temp directory, fsync,
atomic rename) while training goes on. When checkpoint c is durable, every held batch of a version
<= c is acked. So after a crash every batch no durable checkpoint covers is still in the BATCH stream,
and the restart retrains exactly those, in their announced order (``train/replay.py``).

Order kept: a batch is acked after its version is announced *and* after a checkpoint at or past that
version is durable. At most one write is in flight: a snapshot due while the previous write runs waits
for it (a write takes a fraction of K steps, so this is rare; skipping one would leave more to hold
and to replay). Without a checkpoint directory nothing is held: a batch is acked once announced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from astraflow.streams.messages import Batch
from astraflow.streams.plane import Delivery
from astraflow.train.checkpoint import Checkpointer, CheckpointMeta, Snapshot
from astraflow.train.crash_points import crash_point
from astraflow.train.distributed import Collective

log = logging.getLogger(__name__)


@dataclass
class Held:
    version: int
    delivery: Delivery[Batch]
    keep_alive: asyncio.Task[None]


class GroupCommit:
    def __init__(self, run_op: Collective, ckpt: Checkpointer | None, durable: int) -> None:
        self.run_op, self.ckpt = run_op, ckpt
        self.durable = durable  # the newest version a durable checkpoint holds
        self._held: list[Held] = []  # announced, not yet covered by a durable checkpoint; oldest first
        self._writing: asyncio.Task[int] | None = None

    @property
    def held(self) -> int:
        return len(self._held)

    def hold(self, version: int, delivery: Delivery[Batch], keep_alive: asyncio.Task[None]) -> None:
        """Keep the batch of announced ``version`` unacked (``keep_alive`` tells the server so) until it is durable."""
        self._held.append(Held(version, delivery, keep_alive))

    def redelivered(self, delivery: Delivery[Batch], keep_alive: asyncio.Task[None]) -> bool:
        """A held batch came again (its keep-alive fell behind): hold the new delivery instead. False if not held."""
        for h in self._held:
            if h.delivery.msg.batch_id == delivery.msg.batch_id:
                h.keep_alive.cancel()
                h.delivery, h.keep_alive = delivery, keep_alive
                return True
        return False

    async def checkpoint(self, meta: CheckpointMeta) -> None:
        """Snapshot the trainer at ``meta.version`` now and write it in the background (after the write in flight)."""
        assert self.ckpt is not None
        await self._wait_write()
        snap: Snapshot | None = await asyncio.to_thread(self.run_op, "snapshot", meta)
        crash_point("after_snapshot", meta.version)
        if snap is None:  # the backend saved it synchronously (DeepSpeed)
            crash_point("after_checkpoint", meta.version)
            self.durable = meta.version
            return
        self._writing = asyncio.create_task(asyncio.to_thread(self._write, self.ckpt, snap))

    async def settle(self) -> None:
        """If the write in flight is done, note it durable; ack the held batches a durable checkpoint covers."""
        if self._writing is not None and self._writing.done():
            await self._wait_write()
        await self._release()

    async def finish(self, meta: CheckpointMeta | None) -> None:
        """Make every trained version durable and ack its batch: the write in flight, then a checkpoint of ``meta``
        (the trainer's current version) unless one holds it already."""
        await self._wait_write()
        if self.ckpt is not None and meta is not None and meta.version > self.durable:
            await self.checkpoint(meta)
            await self._wait_write()
        await self._release()

    async def abandon(self) -> None:
        """The trainer is stopping on an error: let the write in flight end (a valid checkpoint), ack nothing more."""
        with contextlib.suppress(Exception):
            await self._wait_write()
        for h in self._held:
            h.keep_alive.cancel()

    @staticmethod
    def _write(ckpt: Checkpointer, snap: Snapshot) -> int:
        ckpt.write(snap)
        crash_point("after_checkpoint", snap.meta.version)
        return snap.meta.version

    async def _wait_write(self) -> None:
        if self._writing is None:
            return
        task, self._writing = self._writing, None
        self.durable = max(self.durable, await task)  # a failed write raises: the trainer stops, what it holds stays unacked

    async def _release(self) -> None:
        while self._held and (self.ckpt is None or self._held[0].version <= self.durable):
            h = self._held.pop(0)
            h.keep_alive.cancel()
            await h.delivery.ack(confirm=True)  # the server has it before the next: acks land in version order
            crash_point("after_ack", h.version)
            if self._held and (self.ckpt is None or self._held[0].version <= self.durable):
                crash_point("between_acks", h.version)
