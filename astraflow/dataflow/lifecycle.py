"""One lane's tasks, each a record in one state machine. Pure bookkeeping (no I/O).

A task's group in a policy lane only moves forward:

    issued ─► assembling ─► kept ─► planned ─► awaiting ─► settled
      │            │          │         │
      └────────────┴──────────┴─────────┴───────────────────► settled

- ``issued``: out on the plane, nothing of it back (the primary lane only: tasks are issued for it);
- ``assembling``: some of its trajectories held, its group not complete;
- ``kept``: complete and past the filters, in the buffer (after a restart, its ``group`` is None
  until its trajectories come back: a kept record is moved to kept again then);
- ``planned``: in a batch written ahead, not on the plane yet;
- ``awaiting``: in a published batch the trainer has not announced;
- ``settled``: one terminal fate (``streams.fates.Fate``): trained, filtered:R, dropped:R, failed:R
  or invalid:R. A settled record leaves the book; its id stays in ``closed``, compact.

A lane other than the primary first hears of a task when a trajectory of it arrives, so its
records begin at assembling, kept or settled. A partial group there whose task failed is
forgotten, not settled: such a lane counts completed groups only (``ledger.py``).

``closed`` holds the planned, awaiting and settled tasks: anything more of one is a copy. Every
move goes through :meth:`TaskBook.move`, which refuses one the diagram does not draw.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from astraflow.dataflow.groups import HeldGroup
from astraflow.dataflow.ledger import IdSet
from astraflow.streams.task_queue import Ticket


class Stage(enum.Enum):
    ISSUED = "issued"
    ASSEMBLING = "assembling"
    KEPT = "kept"
    PLANNED = "planned"
    AWAITING = "awaiting"
    SETTLED = "settled"


OUT = (Stage.ISSUED, Stage.ASSEMBLING)  # in flight: its group not complete yet
IN_A_BATCH = (Stage.PLANNED, Stage.AWAITING)
NEXT: dict[Stage, frozenset[Stage]] = {
    Stage.ISSUED: frozenset({Stage.ASSEMBLING, Stage.KEPT, Stage.SETTLED}),
    Stage.ASSEMBLING: frozenset({Stage.KEPT, Stage.SETTLED}),
    Stage.KEPT: frozenset({Stage.KEPT, Stage.PLANNED, Stage.SETTLED}),  # kept again: a restored group came back
    Stage.PLANNED: frozenset({Stage.AWAITING, Stage.SETTLED}),
    Stage.AWAITING: frozenset({Stage.SETTLED}),
    Stage.SETTLED: frozenset(),
}
FIRST = {True: frozenset({Stage.ISSUED}), False: frozenset({Stage.ASSEMBLING, Stage.KEPT, Stage.SETTLED})}  # by primary


class IllegalTransition(RuntimeError):
    """A move the lifecycle does not allow: a bug in the dataflow, never a node's doing (admission turns those away)."""

    def __init__(self, lane: str, task_id: str, was: Stage | None, to: Stage) -> None:
        super().__init__(f"lane {lane}: task {task_id} cannot go from {was.value if was else 'nowhere'} to {to.value}")


@dataclass(slots=True)
class TaskRecord:
    """One task in one lane; which fields mean something depends on its stage."""

    task_id: str
    stage: Stage
    deadline: float | None = None  # issued: when its group is due (None: no time limit)
    ticket: Ticket | None = None  # issued: where the task queue holds it, once known (a restart asks the queue)
    since: float | None = None  # issued: when it went out (or was found out, after a restart): the audit's clock
    group: HeldGroup | None = None  # kept: its group in memory
    weight: float = 1.0  # kept: factor on its advantages
    batch: str | None = None  # planned, awaiting: its batch


class TaskBook:
    """The live records of one lane, by stage (each stage in the order its records reached it), and the closed ids."""

    def __init__(self, lane: str, primary: bool) -> None:
        self.lane = lane
        self.primary = primary
        self.records: dict[str, TaskRecord] = {}
        self.at: dict[Stage, dict[str, TaskRecord]] = {s: {} for s in Stage if s is not Stage.SETTLED}
        self.closed = IdSet()

    def get(self, task_id: str) -> TaskRecord | None:
        return self.records.get(task_id)

    def stage(self, task_id: str) -> Stage | None:
        """Where the task is; None: never seen here (or forgotten)."""
        rec = self.records.get(task_id)
        if rec is not None:
            return rec.stage
        return Stage.SETTLED if task_id in self.closed else None

    def kept(self, task_id: str) -> TaskRecord | None:
        """Its record if it is kept."""
        rec = self.records.get(task_id)
        return rec if rec is not None and rec.stage is Stage.KEPT else None

    def group(self, task_id: str) -> HeldGroup | None:
        """Its group if it is kept and in memory."""
        rec = self.kept(task_id)
        return rec.group if rec is not None else None

    def count(self, *stages: Stage) -> int:
        return sum(len(self.at[s]) for s in stages)

    def at_stage(self, *stages: Stage) -> Iterator[TaskRecord]:
        """The records at ``stages``, each stage in the order its records reached it."""
        for s in stages:
            yield from self.at[s].values()

    def in_batch(self, batch_id: str) -> list[str]:
        """The tasks of a planned or awaiting batch."""
        return [r.task_id for r in self.at_stage(*IN_A_BATCH) if r.batch == batch_id]

    def by_batch(self, batch_ids: Iterable[str]) -> dict[str, list[str]]:
        """Each of ``batch_ids`` (planned or published, not announced) -> its tasks."""
        out: dict[str, list[str]] = {b: [] for b in batch_ids}
        for rec in self.at_stage(*IN_A_BATCH):
            out[rec.batch or ""].append(rec.task_id)
        return out

    def move(self, task_id: str, to: Stage, **fields: object) -> TaskRecord:
        """Move ``task_id`` to ``to``, setting ``fields`` on its record; a move the lifecycle does not draw raises."""
        rec = self.records.get(task_id)
        was = self.stage(task_id)
        if to not in (NEXT[was] if was is not None else FIRST[self.primary]):
            raise IllegalTransition(self.lane, task_id, was, to)
        if rec is None:
            rec = self.records[task_id] = TaskRecord(task_id, to)
        else:
            del self.at[rec.stage][task_id]
        for name, value in fields.items():
            setattr(rec, name, value)
        rec.stage = to
        if to in (Stage.PLANNED, Stage.SETTLED):
            self.closed.add(task_id)
        if to is Stage.SETTLED:
            del self.records[task_id]
        else:
            self.at[to][task_id] = rec
        return rec

    def forget(self, task_id: str) -> None:
        """A partial group in a lane other than the primary whose task failed: forgotten, no fate (see the module)."""
        if self.primary or self.stage(task_id) is not Stage.ASSEMBLING:
            raise IllegalTransition(self.lane, task_id, self.stage(task_id), Stage.SETTLED)
        del self.records[task_id], self.at[Stage.ASSEMBLING][task_id]

    def restore(self, task_id: str, stage: Stage, **fields: object) -> None:
        """A record as a saved state has it (the state keeps issued, kept, planned and awaiting tasks); a task the state
        names twice is where it names it last."""
        if (old := self.records.get(task_id)) is not None:
            del self.at[old.stage][task_id]
        rec = self.records[task_id] = TaskRecord(task_id, stage)
        for name, value in fields.items():
            setattr(rec, name, value)
        self.at[stage][task_id] = rec
