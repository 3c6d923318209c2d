"""Durability: the one place that orders fate records, then the state, then the acks they explain.

The dataflow's effects are of three kinds, and a ``kill -9`` between any two of them must lose
nothing and repeat nothing:

- **publications a successor must be able to repeat** (tasks, batches): the state that
  describes them (``issuing``, a lane's ``plans``) is committed first (``commit``), and they
  are published with ``Nats-Msg-Id`` = their id, so a repetition is dropped by the server;
- **fates and state changes** (a group filtered, batched, trained, failed): queued as fate
  records and a "changed" mark, written by ``flush`` — the records before the state, so the
  state never counts a fate whose record is missing;
- **acks**: a trajectory's delivery is held unacked (kept alive with ``in_progress``) until its
  fate is decided, then ``release``d, and acked only after the next durable write of the state
  that explains it. A delivery that is a copy of something settled is acked the same way, and an
  invalid one is dead-lettered (``reject_later``) the same way: after the fate it caused is durable.

Nothing else in the dataflow writes the state or acks a trajectory.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from astraflow.streams.dataflow_state import DataflowState
from astraflow.streams.fates import Fate
from astraflow.streams.state import BatchPlanRecord, FateRecord, Record

COMMIT_EVERY_S = 0.1  # a turn that publishes nothing writes its changes only once the last write is this old


class StateWriter(Protocol):
    """Where the journal writes (``Plane.state``)."""

    async def put(self, record: Record) -> None: ...

    async def put_many(self, records: list[Record]) -> None: ...

    async def delete(self, cls: type[Record], *parts: str | int) -> None: ...


class Ackable(Protocol):
    """A held delivery (``Delivery[Trajectory]``)."""

    async def ack(self) -> None: ...

    async def in_progress(self) -> None: ...


class Rejectable(Protocol):
    """A delivery that can be dead-lettered with a reason (``Delivery[Trajectory]``)."""

    async def reject(self, reason: str, code: str = "") -> None: ...


class Journal:
    """Queues fates, state changes and acks; makes them durable in the one safe order."""

    def __init__(self, store: StateWriter, snapshot: Callable[[], DataflowState]) -> None:
        self.store = store
        self.snapshot = snapshot  # the whole state as it stands now
        self.records: list[Record] = []  # per-task fates and batch plan records, written before the state
        self.held: dict[str, Ackable] = {}  # traj_id -> its latest delivery, unacked while the fate is open
        self.to_ack: list[Ackable] = []  # settled; acked after the next durable write
        self.to_reject: list[tuple[Rejectable, str, str]] = []  # invalid; dead-lettered after the next durable write
        self.plans_done: list[tuple[str, str]] = []  # (policy, batch id) whose plan record goes after the next durable write
        self.dirty = False  # the state changed since it was last written
        self.committed_at = 0.0  # monotonic time of the last durable write

    # ------------------------------------------------------------ queueing
    def record(self, policy: str, task_id: str, fate: Fate, **extra: Any) -> None:
        self.records.append(FateRecord(policy=policy, task_id=task_id, fate=str(fate), **extra))
        self.dirty = True

    def write_ahead(self, record: BatchPlanRecord) -> None:
        """A batch's plan record: written with the fate records, before the state (and so before the batch)."""
        self.records.append(record)
        self.dirty = True

    def changed(self) -> None:
        self.dirty = True

    def hold(self, traj_id: str, delivery: Ackable) -> bool:
        """Hold the delivery unacked until the trajectory's fate is decided; True if it was held already
        (a redelivery while held: the newer delivery is the live one)."""
        again = traj_id in self.held
        self.held[traj_id] = delivery
        return again

    def is_held(self, traj_id: str) -> bool:
        return traj_id in self.held

    def release(self, traj_ids: Iterable[str]) -> None:
        """These trajectories' fate is decided: ack them once it is durable."""
        self.to_ack.extend(self.held.pop(t) for t in traj_ids if t in self.held)

    def ack_later(self, delivery: Ackable) -> None:
        """A copy of something settled or complete already: nothing to hold; ack it after the next durable write."""
        self.to_ack.append(delivery)

    def reject_later(self, delivery: Rejectable, reason: str, code: str = "") -> None:
        """An invalid trajectory: dead-letter it (with ``reason`` and the ``code`` of the check it failed) after the next
        durable write of the fate it caused."""
        self.to_reject.append((delivery, reason, code))

    def forget_plan(self, policy: str, batch_id: str) -> None:
        """The batch's fate is known: delete its plan record (``BatchPlanRecord``) after the next durable write."""
        self.plans_done.append((policy, batch_id))
        self.dirty = True

    # ------------------------------------------------------------ durable writes
    async def commit(self) -> None:
        """Fate records, then the state, now. Before a publication a successor must be able to repeat."""
        if self.records:
            records, self.records = self.records, []
            await self.store.put_many(records)
        await self.store.put(self.snapshot())
        self.dirty = False
        self.committed_at = time.monotonic()

    async def flush(self, publishing: bool = True) -> None:
        """Make what changed durable, then ack what it explains. A turn that publishes nothing (``publishing`` False)
        writes only once the last write is ``COMMIT_EVERY_S`` old, unless it has trajectories to dead-letter (rare, and
        watched): until then its changes, and the acks and deletes they explain, wait for a later write (a turn's state
        is written ahead of its publications, nearly every turn changes it, and most turns publish nothing)."""
        if self.records or self.dirty:
            if not (publishing or self.to_reject) and time.monotonic() - self.committed_at < COMMIT_EVERY_S:
                return
            await self.commit()
        if self.to_ack:
            acks, self.to_ack = self.to_ack, []
            for d in acks:  # an ack is one message written to the connection, no round trip: no task each
                await d.ack()
        if self.to_reject:
            rejects, self.to_reject = self.to_reject, []
            await asyncio.gather(*(d.reject(reason, code) for d, reason, code in rejects))
        if self.plans_done:
            done, self.plans_done = self.plans_done, []
            await asyncio.gather(*(self.store.delete(BatchPlanRecord, p, b) for p, b in done))

    async def keep_alive(self) -> None:
        """``in_progress`` on every held delivery, so the server does not redeliver it while its group fills."""
        await asyncio.gather(*(d.in_progress() for d in list(self.held.values())), return_exceptions=True)
