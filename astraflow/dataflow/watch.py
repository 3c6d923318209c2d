"""What the dataflow follows on the plane besides trajectories, as plain events.

- weight announcements (``weights.>``, from the start of the stream's history): a policy's
  current version, and which batches its trainer trained (``batch_ids``);
- the dead-letter stream for tasks and batches: a task a rollout node gave up on (``failed:…``),
  a batch a trainer turned away, with the code its reason starts with (``messages.reason_code``);
- the server's max-deliveries advisories for the pool's consumer: a task nobody could serve;
- heartbeats: live rollout nodes of the pool (and how busy they are), trainers' wait fraction.

Ordered consumers replay history from the start, so a restarted dataflow sees every
announcement and failure again; the lanes make that idempotent (a batch is counted trained once,
a task fails only while it is still in flight).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from astraflow.streams.codec import DecodeError, decode
from astraflow.streams.messages import Batch, Heartbeat, Rejected, Task, WeightVersion, reason_code
from astraflow.streams.plane import Plane, Subscription

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Trained:
    policy: str
    version: int
    batch_ids: tuple[str, ...]


@dataclass(frozen=True)
class TaskFailed:
    task_id: str
    policy: str
    reason: str  # short, a fate suffix: "rollout", "max_deliver"
    detail: str = ""


@dataclass(frozen=True)
class BatchFailed:
    batch_id: str
    policy: str
    detail: str = ""
    code: str = ""  # why the trainer turned it away (``messages.BATCH_*``)


Event = Trained | TaskFailed | BatchFailed


class Watch:
    """Subscriptions that turn plane events into a list the service drains once per loop."""

    def __init__(self, plane: Plane, pool: str) -> None:
        self.plane = plane
        self.pool = pool
        self.events: list[Event] = []
        self.beats: list[Heartbeat] = []
        self.subs: list[Subscription] = []

    async def start(self) -> None:
        n, plane = self.plane.names, self.plane
        self.subs.append(await plane.follow(n.all("weights"), WeightVersion, self._on_weights))
        for kind in ("task", "batch"):
            self.subs.append(await plane.follow(n.dlq(kind), Rejected, self._on_dlq))
        self.subs.append(await plane.on_max_deliveries(n.task_stream, n.pool_consumer(self.pool), self._on_max_deliveries))
        self.subs.append(await plane.on_heartbeats(self._on_beat))

    async def stop(self) -> None:
        for sub in self.subs:
            await sub.stop()

    def drain(self) -> tuple[list[Event], list[Heartbeat]]:
        events, beats = self.events, self.beats
        self.events, self.beats = [], []
        return events, beats

    def _on_beat(self, hb: Heartbeat) -> None:
        self.beats.append(hb)  # not ``self.beats.append`` bound once: ``drain`` swaps the list

    async def _on_weights(self, ann: WeightVersion) -> None:
        self.events.append(Trained(ann.policy, ann.version, tuple(ann.batch_ids)))

    async def _on_dlq(self, rej: Rejected) -> None:
        family = rej.subject.split(".")[2] if rej.subject.count(".") >= 2 else ""
        try:
            if family == "task":
                task = decode(rej.payload, Task)
                self.events.append(TaskFailed(task.task_id, task.policy, "rollout", rej.reason[:300]))
            elif family == "batch":
                batch = decode(rej.payload, Batch)
                self.events.append(BatchFailed(batch.batch_id, batch.policy, rej.reason[:300], reason_code(rej.reason)))
        except DecodeError:
            pass  # the original itself was malformed: never one of our tasks or batches

    async def _on_max_deliveries(self, seq: int) -> None:
        try:
            task = await self.plane.get(self.plane.names.task_stream, seq, Task)
        except Exception as e:  # gone already, or not one of ours
            log.debug("max-deliveries advisory for seq %d not resolved: %s", seq, e)
            return
        self.events.append(TaskFailed(task.task_id, task.policy, "max_deliver", "no node could serve it"))
