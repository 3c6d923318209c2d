"""Group commit: each version announced in the background, a checkpoint every K versions written in the background,
batch acks held until a durable checkpoint covers them.

Per version the trainer hands the bf16 image of its weights to :meth:`GroupCommit.publish`: a private copy taken right
after the step (``state_dict_bf16``, a few ms) and checked finite, so the next step cannot change what is announced and
the publisher need not copy it again (it still checks it finite). The image is stored
and announced (``WeightPublisher.store``, ``announce``) in a task while the loop pulls, fetches and steps the next batch;
the digest, the encoding and the chunk hashing run in threads, which release the GIL, so the publish of v runs beside the
step of v+1 (it saves time where the step leaves a core idle). ``behind=False`` (``trainer.publish: inline``, the
default on CPU) waits for the publish before the loop goes on, since there the two share the cores and overlapping
them slows the step by more than it hides. Once v's announcement (the version's commit point)
has landed, v's batch is *held*: unacked, kept alive with ``in_progress()`` so the server does not redeliver it.
Every ``trainer.checkpoint_every`` versions the trainer takes an in-memory snapshot (weights, optimizer, RNG, meta:
``Checkpointer.snapshot``) on the loop and writes it from a background thread (temp directory, fsync, atomic rename)
while training goes on: the trainer's ``writer``, on the cores it does not train on, at the trainer's priority
(``train/threads.background_executor``). When checkpoint c is durable, every held batch of a version <= c is acked.
So after a crash every batch no durable checkpoint covers is still in the BATCH stream, and the restart retrains
exactly those, in their announced order (``train/replay.py``).

Order kept:

* a batch is held only once its version's announcement has landed, and acked only once a checkpoint at or past that
  version is durable too; a publish that failed holds nothing: its batch stays unacked, for the restarted trainer;
* one publish in flight: the next waits for it (the image it announces is the base of the next delta);
* a snapshot waits for the publish in flight, so a durable checkpoint of v+1 never precedes v's announcement (its
  restart would announce v+1 with v missing);
* a failed publish (``PublishConflict``, ``NonFiniteWeights``, the server gone) raises from the next ``settle``,
  ``publish``, ``checkpoint`` or ``finish``, before anything after it is stored: the trainer stops, as it did when it
  published in line, and no version is announced twice or skipped;
* at most one write in flight: a snapshot due while the previous write runs waits for it (a write takes a fraction of
  K steps, so this is rare; skipping one would leave more to hold and to replay);
* ``finish`` and ``abandon`` (the trainer stopping) await the publish in flight.

Without a checkpoint directory nothing is held: a batch is acked once announced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from astraflow.runtime import crash_point
from astraflow.streams.messages import Batch, Suspect, WeightVersion
from astraflow.streams.plane import Delivery, PublishConflict
from astraflow.train.checkpoint import Checkpointer, CheckpointMeta, Snapshot
from astraflow.train.distributed import Collective
from astraflow.weights.publish import NonFiniteWeights, WeightPublisher

log = logging.getLogger(__name__)


@dataclass
class Held:
    version: int
    delivery: Delivery[Batch]
    keep_alive: asyncio.Task[None]


class GroupCommit:
    def __init__(self, run_op: Collective, ckpt: Checkpointer | None, publisher: WeightPublisher, durable: int,
                 behind: bool = True, writer: Executor | None = None) -> None:
        self.run_op, self.ckpt, self.publisher = run_op, ckpt, publisher
        self.writer = writer  # the thread checkpoints are written on (None: asyncio's default threads)
        self.behind = behind  # False: publish() returns once the version has landed (``trainer.publish: inline``)
        self.durable = durable  # the newest version a durable checkpoint holds
        self._held: list[Held] = []  # announced, not yet covered by a durable checkpoint; oldest first
        self._publishing: tuple[Held, asyncio.Task[WeightVersion]] | None = None  # the version in flight, with its batch
        self._writing: asyncio.Future[int] | None = None

    @property
    def held(self) -> int:
        return len(self._held)

    async def publish(self, image: dict[str, torch.Tensor], version: int, batch_ids: list[str], metrics: dict[str, float],
                      delivery: Delivery[Batch], keep_alive: asyncio.Task[None], suspects: list[Suspect] | None = None) -> None:
        """Announce ``image`` (a copy nothing changes any more) as ``version`` in the background, once the publish in flight
        has landed; its batch (``delivery``, kept alive by ``keep_alive``) is held once this one has landed too. Not
        ``behind``: return once it has landed (its batch held), so that its work does not share the cores with the
        next step."""
        await self.landed()
        self._publishing = Held(version, delivery, keep_alive), asyncio.create_task(self._publish(image, version, batch_ids, metrics,
                                                                                                suspects or []))
        if not self.behind:
            await self.landed()

    async def landed(self) -> WeightVersion | None:
        """Wait for the publish in flight and hold its batch; its announcement (None: none in flight). A failed publish
        raises here and holds nothing."""
        if self._publishing is None:
            return None
        (batch, task), self._publishing = self._publishing, None
        try:
            ann = await task
        except BaseException:
            batch.keep_alive.cancel()  # unacked: the restarted trainer gets the batch again
            raise
        self._held.append(batch)
        return ann

    async def _publish(self, image: dict[str, torch.Tensor], version: int, batch_ids: list[str],
                       metrics: dict[str, float], suspects: list[Suspect]) -> WeightVersion:
        stored = await self.publisher.store(image, version, batch_ids, metrics, copy=False, suspects=suspects)
        crash_point("before_announce", version)
        ann = await self.publisher.announce(stored)
        crash_point("after_publish", version)
        return ann

    async def answer_keyframe_request(self) -> WeightVersion | None:
        """While the trainer waits for batches: a pending keyframe request answered with the current version announced
        again as a keyframe (``WeightPublisher.answer_keyframe_request``), once the publish in flight has landed (a failed
        one raises, as from :meth:`settle`). Failing to answer is logged, not raised (the next check tries again), unless
        the publish says the trainer must stop (another trainer's announcement, weights not finite)."""
        await self.landed()
        try:
            return await self.publisher.answer_keyframe_request()
        except (PublishConflict, NonFiniteWeights):
            raise
        except Exception as e:
            log.warning("weights %s: answering a keyframe request failed (%s: %s); tried again later", self.publisher.policy,
                        type(e).__name__, e)
            return None

    def redelivered(self, delivery: Delivery[Batch], keep_alive: asyncio.Task[None]) -> bool:
        """A held batch (or the one being published) came again (its keep-alive fell behind): hold the new delivery
        instead. False if not held."""
        for h in [*self._held, *([self._publishing[0]] if self._publishing else [])]:
            if h.delivery.msg.batch_id == delivery.msg.batch_id:
                h.keep_alive.cancel()
                h.delivery, h.keep_alive = delivery, keep_alive
                return True
        return False

    async def checkpoint(self, meta: CheckpointMeta) -> None:
        """Snapshot the trainer at ``meta.version`` now and write it in the background (after the write in flight)."""
        assert self.ckpt is not None
        await self.landed()  # a durable checkpoint of v+1 must not come before the announcement of v
        await self._wait_write()
        await self._release()  # what that write made durable is acked now, not after the next one
        snap: Snapshot | None = await asyncio.to_thread(self.run_op.snapshot, meta)
        crash_point("after_snapshot", meta.version)
        if snap is None:  # the backend saved it synchronously (DeepSpeed)
            crash_point("after_checkpoint", meta.version)
            self.durable = meta.version
            return
        self._writing = asyncio.get_running_loop().run_in_executor(self.writer, self._write, self.ckpt, snap)

    async def settle(self) -> None:
        """Take the outcome of a publish that ended (a failure raises); if the write in flight is done, note it durable;
        ack the held batches a durable checkpoint covers."""
        if self._publishing is not None and self._publishing[1].done():
            await self.landed()
        if self._writing is not None and self._writing.done():
            await self._wait_write()
        await self._release()

    async def finish(self, meta: CheckpointMeta | None) -> None:
        """Make every trained version durable and ack its batch: the write in flight, then a checkpoint of ``meta``
        (the trainer's current version) unless one holds it already; the publish in flight first."""
        await self.landed()
        await self._wait_write()
        if self.ckpt is not None and meta is not None and meta.version > self.durable:
            await self.checkpoint(meta)
            await self._wait_write()
        await self._release()

    async def abandon(self) -> None:
        """The trainer is stopping on an error: let the publish in flight end (announced, or not at all) and the write in
        flight (a valid checkpoint), ack nothing more."""
        with contextlib.suppress(Exception):
            await self.landed()
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
