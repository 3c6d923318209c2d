"""Tasks out on the plane, and what is remembered of recent tasks once they are back. Pure bookkeeping (no I/O).

The tasks out are the primary lane's records at ``issued`` and ``assembling``
(``lifecycle.TaskBook``): the issuer issues them there, and the lane moves them on when their group
completes or they fail. This adds what outlives a task's time out: its deadline (kept a while
longer than the task itself: a secondary lane's group may complete after the primary's, and every
lane's late policy reads the task's deadline), its prompt, and what ingest needs to judge a
trajectory's claim on a task: was the task issued recently (the last ``RECENT`` task numbers; a
secondary lane's group may arrive after the primary's landed), and which version floors
(``Task.min_versions``) was it issued with. Floors only rise with the task number (versions only
rise), so they are kept as change points: back to the last ``RECENT`` task numbers, or, in a run
with one policy, to the oldest task the primary lane still waits on (the state keeps them).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Mapping

from astraflow.dataflow.ledger import task_number
from astraflow.dataflow.lifecycle import OUT, Stage, TaskBook
from astraflow.streams.task_queue import Ticket

DEADLINES = 4096  # recent tasks whose deadline is remembered
RECENT = 4096  # task numbers back from the newest that still count as recently issued


class Floors:
    """``Task.min_versions`` by task number, stored as change points ``(first task number, floors)``."""

    def __init__(self) -> None:
        self.points: list[tuple[int, dict[str, int]]] = []

    def note(self, number: int, floors: Mapping[str, int], oldest: int | None = None) -> None:
        """Task ``number`` was issued with ``floors``; ``oldest``: the oldest task number still asked about (default:
        ``RECENT`` back), whose floors are the oldest kept."""
        if not self.points or self.points[-1][1] != floors:
            self.points.append((number, dict(floors)))
        horizon = number - RECENT if oldest is None else oldest
        while len(self.points) > 1 and self.points[1][0] <= horizon:  # nothing older is asked about
            del self.points[0]

    def at(self, number: int) -> dict[str, int] | None:
        i = bisect.bisect_right(self.points, number, key=lambda p: p[0]) - 1
        return self.points[i][1] if i >= 0 else None


class InFlight:
    def __init__(self, tasks: TaskBook | None = None, other_lanes: bool = True) -> None:
        self.tasks = tasks or TaskBook("primary", primary=True)  # the primary lane's: those at issued and assembling are out
        self.other_lanes = other_lanes  # other policies' groups may come after the primary's (floors kept RECENT back)
        self.deadlines: OrderedDict[str, float] = OrderedDict()  # recent tasks' deadlines, for every lane
        self.floors = Floors()
        self.newest = 0  # the highest task number issued
        self.prompts: OrderedDict[str, str] = OrderedDict()  # the last RECENT tasks issued -> the prompt_id each was issued with

    def __len__(self) -> int:
        return self.tasks.count(*OUT)

    def __contains__(self, task_id: object) -> bool:
        return isinstance(task_id, str) and self.tasks.stage(task_id) in OUT

    def out(self) -> list[str]:
        return [r.task_id for r in self.tasks.at_stage(*OUT)]

    def issued(self, task_id: str, deadline: float | None, floors: Mapping[str, int] | None = None, prompt_id: str | None = None) -> None:
        """The lane issued ``task_id`` (:meth:`PolicyLane.issue`): its deadline, floors and prompt remembered."""
        if prompt_id is not None:
            self.note_prompt(task_id, prompt_id)
        if deadline is not None:
            self.deadlines[task_id] = deadline
            while len(self.deadlines) > DEADLINES:
                self.deadlines.popitem(last=False)
        n = task_number(task_id)
        if n is not None:
            self.newest = max(self.newest, n)
            if floors is not None:
                self.floors.note(n, floors, None if self.other_lanes else self.oldest_waited_on(n))

    def published(self, task_id: str, ticket: Ticket | None, now: float) -> None:
        """It is on the plane (at ``ticket`` of the task queue; None: not found there), since ``now``."""
        rec = self.tasks.get(task_id)
        if rec is not None and rec.stage in OUT:
            if ticket is not None:
                rec.ticket = ticket
            if rec.since is None:
                rec.since = now

    def ticket(self, task_id: str) -> Ticket | None:
        rec = self.tasks.get(task_id)
        return rec.ticket if rec is not None and rec.stage in OUT else None

    def out_since(self) -> dict[str, float]:
        """Each task out, known on the plane -> since when (the audit's clock)."""
        return {r.task_id: r.since for r in self.tasks.at_stage(*OUT) if r.since is not None}

    def oldest_waited_on(self, newest: int) -> int:
        """The oldest task number the primary lane waits on (out, or kept): with no other lane, no older task's floors
        are asked about (the state keeps a change point per version otherwise: thousands)."""
        numbers = [task_number(r.task_id) for r in self.tasks.at_stage(*OUT, Stage.KEPT)]
        return min((n for n in numbers if n is not None), default=newest)

    def note_prompt(self, task_id: str, prompt_id: str) -> None:
        """``task_id`` was issued with ``prompt_id`` (kept in memory for the last ``RECENT`` tasks; a restart reads it back
        from the task messages the TASK stream still holds)."""
        self.prompts[task_id] = prompt_id
        while len(self.prompts) > RECENT:
            self.prompts.popitem(last=False)

    def prompt_of(self, task_id: str) -> str | None:
        """The prompt_id ``task_id`` was issued with, when known."""
        return self.prompts.get(task_id)

    def deadline(self, task_id: str) -> float | None:
        return self.deadlines.get(task_id)

    def recent(self, task_id: str) -> bool:
        """One of the last ``RECENT`` tasks issued (out or back)."""
        n = task_number(task_id)
        return n is not None and self.newest - RECENT < n <= self.newest

    def floor(self, task_id: str, policy: str) -> int:
        """The oldest version ``policy``'s tokens of this task may come from (0 when not known)."""
        n = task_number(task_id)
        floors = self.floors.at(n) if n is not None else None
        return (floors or {}).get(policy, 0)

    def overdue(self, now: float) -> int:
        return sum(1 for r in self.tasks.at_stage(*OUT) if r.deadline is not None and r.deadline < now)

    def state(self) -> tuple[dict[str, float | None], dict[str, float], list[tuple[int, dict[str, int]]]]:
        out = {r.task_id: r.deadline for r in self.tasks.at_stage(*OUT)}
        return out, dict(self.deadlines), [(n, dict(f)) for n, f in self.floors.points]

    def load_state(self, open_tasks: dict[str, float | None], deadlines: dict[str, float], floors: list[tuple[int, dict[str, int]]],
                   newest: int) -> None:
        for task_id, deadline in open_tasks.items():  # saved as issued: what came back of them comes again
            self.tasks.restore(task_id, Stage.ISSUED, deadline=deadline)
        self.deadlines = OrderedDict(deadlines)
        self.floors.points = [(n, dict(f)) for n, f in floors]
        self.newest = newest
