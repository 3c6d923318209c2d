"""What the dataflow follows on the plane besides trajectories, as plain events.

- weight announcements (``weights.>``, from the start of the stream's history): a policy's
  current version, and which batches its trainer trained (``batch_ids``);
- the dead-letter stream for tasks and batches: a task a rollout node gave up on, a batch a
  trainer could not step on — their fates are ``failed:…``;
- the server's max-deliveries advisories for the pool's consumer: a task nobody could serve;
- heartbeats: live rollout nodes of the pool (and how busy they are), trainers' wait fraction.

Ordered consumers replay history from the start, so a restarted dataflow sees every
announcement and failure again; the lanes make that idempotent (a batch is counted trained once,
a task fails only while it is still in flight).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from astraflow.streams.codec import DecodeError, decode
from astraflow.streams.messages import Batch, Heartbeat, Rejected, Task, Trajectory, WeightVersion
from astraflow.streams.plane import Plane

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


class Watch:
    """Subscriptions that turn plane events into a list the service drains once per loop."""

    def __init__(self, plane: Plane, pool: str) -> None:
        self.plane = plane
        self.pool = pool
        self.events: list[Trained | TaskFailed | BatchFailed] = []
        self.beats: list[Heartbeat] = []
        self.subs: list[Any] = []

    async def start(self) -> None:
        n, js, nc = self.plane.names, self.plane.js, self.plane.nc
        self.subs.append(await js.subscribe(n.all("weights"), ordered_consumer=True, cb=self._on_weights))
        for kind in ("task", "batch"):
            self.subs.append(await js.subscribe(n.dlq(kind), ordered_consumer=True, cb=self._on_dlq))
        advisory = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{n.task_stream}.{n.pool_consumer(self.pool)}"
        self.subs.append(await nc.subscribe(advisory, cb=self._on_max_deliveries))
        self.subs.append(await nc.subscribe(f"af.{n.run}.hb.>", cb=self._on_beat))

    async def stop(self) -> None:
        for sub in self.subs:
            try:
                await sub.unsubscribe()
            except Exception:  # the connection may be gone already
                pass

    def drain(self) -> tuple[list[Trained | TaskFailed | BatchFailed], list[Heartbeat]]:
        events, beats = self.events, self.beats
        self.events, self.beats = [], []
        return events, beats

    async def _on_weights(self, msg: Any) -> None:
        try:
            ann = decode(msg.data, WeightVersion)
        except DecodeError:
            return
        self.events.append(Trained(ann.policy, ann.version, tuple(ann.batch_ids)))

    async def _on_dlq(self, msg: Any) -> None:
        try:
            rej = decode(msg.data, Rejected)
        except DecodeError:
            return
        family = rej.subject.split(".")[2] if rej.subject.count(".") >= 2 else ""
        try:
            if family == "task":
                task = decode(rej.payload, Task)
                self.events.append(TaskFailed(task.task_id, task.policy, "rollout", rej.reason[:300]))
            elif family == "batch":
                batch = decode(rej.payload, Batch)
                self.events.append(BatchFailed(batch.batch_id, batch.policy, rej.reason[:300]))
        except DecodeError:
            pass  # the original itself was malformed: never one of our tasks or batches

    async def _on_max_deliveries(self, msg: Any) -> None:
        try:
            seq = int(json.loads(msg.data)["stream_seq"])
            task = await self.plane.get(self.plane.names.task_stream, seq, Task)
        except Exception as e:  # gone already, or not one of ours
            log.debug("max-deliveries advisory not resolved: %s", e)
            return
        self.events.append(TaskFailed(task.task_id, task.policy, "max_deliver", "no node could serve it"))

    async def _on_beat(self, msg: Any) -> None:
        try:
            self.beats.append(decode(msg.data, Heartbeat))
        except DecodeError:
            pass


async def fetch_trajectories(plane: Plane, seqs: list[int]) -> list[Trajectory]:
    """Trajectories by TRAJ stream sequence (Limits retention keeps them for replay and audit)."""
    return [await plane.get(plane.names.traj_stream, seq, Trajectory) for seq in seqs]
