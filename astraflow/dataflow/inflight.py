"""Tasks out on the plane: issued, their primary group not complete yet. Pure bookkeeping (no I/O).

The issuer adds a task when it writes it ahead; ingest lands it when its primary group
completes; a failure report (DLQ, max deliveries) ends it. Deadlines are kept a while longer
than the tasks themselves: a secondary lane's group may complete after the primary's, and
every lane's late policy reads the task's deadline.
"""

from __future__ import annotations

from collections import OrderedDict

DEADLINES = 4096  # recent tasks whose deadline is remembered


class InFlight:
    def __init__(self) -> None:
        self.open: dict[str, float | None] = {}  # task -> deadline (None: no time limit)
        self.deadlines: OrderedDict[str, float] = OrderedDict()  # recent tasks' deadlines, for every lane

    def __len__(self) -> int:
        return len(self.open)

    def __contains__(self, task_id: str) -> bool:
        return task_id in self.open

    def issue(self, task_id: str, deadline: float | None) -> None:
        self.open[task_id] = deadline
        if deadline is not None:
            self.deadlines[task_id] = deadline
            while len(self.deadlines) > DEADLINES:
                self.deadlines.popitem(last=False)

    def land(self, task_id: str) -> None:
        """Its primary group is complete (or it was never ours: nothing happens)."""
        self.open.pop(task_id, None)

    def fail(self, task_id: str) -> bool:
        """It failed on the plane; False if it was not out (already back, failed before, not ours)."""
        if task_id not in self.open:
            return False
        del self.open[task_id]
        return True

    def deadline(self, task_id: str) -> float | None:
        return self.deadlines.get(task_id)

    def overdue(self, now: float) -> int:
        return sum(1 for d in self.open.values() if d is not None and d < now)

    def state(self) -> tuple[dict[str, float | None], dict[str, float]]:
        return dict(self.open), dict(self.deadlines)

    def load_state(self, open_tasks: dict[str, float | None], deadlines: dict[str, float]) -> None:
        self.open = dict(open_tasks)
        self.deadlines = OrderedDict(deadlines)
