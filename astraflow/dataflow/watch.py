"""What the dataflow follows on the plane besides trajectories, as plain events.

- weight announcements (``weights.{policy}``, from the start of the stream's history): a policy's
  current version, which batches its trainer trained (``batch_ids``) and which of their trajectories its token
  check left out (``suspects``, counted against the nodes that sent them); only those a node would
  follow (``weights/checks.py``: possible on their face and newer than the last), so a foreign
  writer can neither move a version nor mark a batch trained with an impossible or past one;
- the dead-letter stream for tasks and batches: a task a rollout node gave up on (``failed:…``),
  a batch a trainer turned away, with its typed refusal (``Rejected.code``, ``messages.BatchRefusal``);
  and for trajectories: one the dataflow's consumer could not decode (a value outside the wire's
  range, e.g. ``index < 0``), with the ids it claims when they can be read (strings), so ingest
  can settle its task as it settles any invalid sample's (only the dataflow writes ``dlq.traj``);
- the server's max-deliveries advisories for the pool's consumer: a task nobody could serve;
- heartbeats: live rollout nodes of the pool (and how busy they are), trainers' wait fraction.

Ordered consumers replay history from the start, so a restarted dataflow sees every
announcement and failure again; the lanes make that idempotent (a batch is counted trained once,
a task fails only while it is still in flight).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from astraflow.dataflow.reputation import sender
from astraflow.streams.codec import DecodeError, decode, fields_of
from astraflow.streams.messages import (
    Batch,
    BatchRefusal,
    Heartbeat,
    Rejected,
    Suspect,
    Task,
    Trajectory,
    TrajectoryBundle,
    TrajectoryGroup,
    WeightVersion,
)
from astraflow.streams.plane import Plane, Subscription
from astraflow.streams.task_queue import TaskQueue, Ticket
from astraflow.streams.trajectories import decode_traj
from astraflow.streams.weight_channel import WeightChannel
from astraflow.weights.checks import announcement_problem, order_problem

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Trained:
    policy: str
    version: int
    batch_ids: tuple[str, ...]
    suspects: tuple[Suspect, ...] = ()  # what its step's token check left out (``WeightVersion.suspects``)


@dataclass(frozen=True)
class TaskFailed:
    task_id: str
    policy: str
    reason: str  # short, a fate suffix: "rollout", "max_deliver"
    detail: str = ""
    ticket: Ticket | None = None  # max_deliver: where the task queue holds it still (never delivered again)


@dataclass(frozen=True)
class BatchFailed:
    batch_id: str
    policy: str
    detail: str = ""
    code: BatchRefusal | None = None  # why the trainer turned it away (None: a code that is not a refusal: failed)


@dataclass(frozen=True)
class SampleUndecodable:
    """A trajectory dead-lettered because it did not decode, and the ids it claims (unchecked strings)."""

    task_id: str
    policy: str
    traj_id: str
    detail: str = ""
    node: str | None = None  # who sent it (``reputation.sender``)
    at: float = 0.0  # when it was dead-lettered (``Rejected.ts``)


Event = Trained | TaskFailed | BatchFailed | SampleUndecodable


class Watch:
    """Subscriptions that turn plane events into a list the service drains once per loop."""

    def __init__(self, plane: Plane, tasks: TaskQueue, policies: tuple[str, ...]) -> None:
        self.plane = plane
        self.tasks = tasks
        self.policies = policies
        self.newest: dict[str, WeightVersion] = {}  # per policy: the newest announcement followed
        self.ignored = 0  # announcements turned away (impossible, or not newer than the newest)
        self.events: list[Event] = []
        self.beats: list[Heartbeat] = []
        self.subs: list[Subscription] = []

    async def start(self) -> None:
        n, plane = self.plane.names, self.plane
        for policy in self.policies:
            self.subs.append(await plane.follow(n.weights(policy), WeightVersion, self._on_weights_of(policy)))
        for kind in ("task", "batch", "traj"):
            self.subs.append(await plane.follow(n.dlq(kind), Rejected, self._on_dlq))
        self.subs.append(await self.tasks.on_given_up(self._on_given_up))
        self.subs.append(await plane.on_heartbeats(self._on_beat))

    async def stop(self) -> None:
        for sub in self.subs:
            await sub.stop()

    def drain(self) -> tuple[list[Event], list[Heartbeat]]:
        events, beats = self.events, self.beats
        self.events, self.beats = [], []
        return events, beats

    async def newest_version(self, policy: str, known: int) -> int:
        """The newest announced version of ``policy`` as the plane holds it now (ingest asks when a token claims a
        version the dataflow has not heard of yet); ``known`` when the plane has none, or when its last announcement is
        one no trainer could have made (``weights/checks.py``)."""
        try:
            ann = await WeightChannel(self.plane, policy).newest()
        except DecodeError:
            ann = None
        if ann is not None and announcement_problem(ann, policy) is not None:
            ann = None
        return max(known, ann.version if ann is not None else 0)

    def _on_beat(self, hb: Heartbeat) -> None:
        self.beats.append(hb)  # not ``self.beats.append`` bound once: ``drain`` swaps the list

    def _on_weights_of(self, policy: str) -> Callable[[WeightVersion], Awaitable[None]]:
        async def on_weights(ann: WeightVersion) -> None:
            newest = self.newest.get(policy)
            problem = announcement_problem(ann, policy) or order_problem(ann, newest)
            if problem is not None or (newest is not None and ann.version <= newest.version):  # impossible, past, or a repeat
                self.ignored += problem is not None
                if problem is not None:
                    log.warning("announcement on %s ignored: %s", policy, problem)
                return
            self.newest[policy] = ann
            self.events.append(Trained(policy, ann.version, tuple(ann.batch_ids), tuple(ann.suspects)))

        return on_weights

    async def _on_dlq(self, rej: Rejected) -> None:
        family = rej.subject.split(".")[2] if rej.subject.count(".") >= 2 else ""
        try:
            if family == "task":
                task = decode(rej.payload, Task)
                self.events.append(TaskFailed(task.task_id, task.policy, "rollout", rej.reason[:300]))
            elif family == "batch":
                batch = decode(rej.payload, Batch)
                self.events.append(BatchFailed(batch.batch_id, batch.policy, rej.reason[:300], BatchRefusal.of(rej.code)))
            elif family == "traj":  # it decodes: ingest's own checks turned it away, and settled its task then
                decode_traj(rej.payload)
        except DecodeError:
            if family == "traj":  # the consumer turned it away undecoded: ingest never saw the tasks it claims
                claimed = fields_of(rej.payload, Trajectory, TrajectoryGroup, TrajectoryBundle)
                groups = claimed.get("groups")
                for fields in groups if isinstance(groups, list) else [claimed]:  # a bundle: each of its groups
                    if isinstance(fields, dict):
                        self._undecodable(fields, rej)
            # otherwise the original itself was malformed: never one of our tasks or batches

    def _undecodable(self, claimed: dict[str, Any], rej: Rejected) -> None:
        """The sample (or group) whose fields are ``claimed`` never reached ingest: its task is settled for it."""
        task_id, policy, traj_id = (claimed.get(k) for k in ("task_id", "policy", "traj_id"))
        if "trajectories" in claimed and isinstance(task_id, str) and isinstance(policy, str):  # a whole group
            traj_id = f"{task_id}.{policy}.group"  # none of its samples can be held: it never reached ingest
        if isinstance(task_id, str) and isinstance(policy, str) and isinstance(traj_id, str):
            self.events.append(SampleUndecodable(task_id, policy, traj_id, rej.reason[:300], sender(rej.subject), rej.ts))

    async def _on_given_up(self, ticket: Ticket) -> None:
        try:
            task = await self.tasks.read(ticket)
        except Exception as e:  # gone already, or not one of ours
            log.debug("max-deliveries advisory for task %d not resolved: %s", ticket, e)
            return
        self.events.append(TaskFailed(task.task_id, task.policy, "max_deliver", "no node could serve it", ticket))
