"""Task accounting: every issued task ends in exactly one fate, and the counts add up.

Per policy lane, a task's group is, at any moment, in exactly one of:

    in flight   issued, its group not complete yet (primary lane only: tasks are issued for it)
    buffered    complete and kept, waiting to be served
    awaiting    in a published batch the trainer has not announced yet
    trained     in a batch the trainer trained (``WeightVersion.batch_ids``)
    filtered:R  dropped by a filter after rollout (R: the filter's reason)
    dropped:R   dropped at serving (``stale``) or past its deadline (``expired``)
    failed:R    the task itself failed (a rollout node sent it to the DLQ, or it ran out of deliveries)
    invalid:R   a trajectory of it failed a value check before its group completed (``validate.py``)

so ``issued = in_flight + buffered + awaiting + sum(fates)`` on the primary lane, and
``received = buffered + awaiting + sum(fates without failed and invalid)`` on the others (their
groups arrive as a side effect of the primary's tasks, and ``received`` counts completed groups:
a failed or invalid one never completed). ``account`` computes the table both the
heartbeat and ``astraflow status`` show. Pure bookkeeping, no I/O.
"""

from __future__ import annotations

import bisect
import functools
import re
from collections import Counter
from dataclasses import dataclass, field

from astraflow.streams.dataflow_state import Accounting, IdSetState, LedgerState
from astraflow.streams.fates import Fate

_SEQ = re.compile(r"^t(\d{1,12})$")


@functools.lru_cache(maxsize=1 << 16)  # asked several times for each trajectory of a task
def task_number(task_id: str) -> int | None:
    """The number of one of our task ids (``t%08d``); None for any other id."""
    m = _SEQ.match(task_id)
    return int(m.group(1)) if m else None


class IdSet:
    """A set of task ids, compact for ours (``t%08d``): sorted disjoint ranges; others in a plain set."""

    def __init__(self) -> None:
        self.los: list[int] = []
        self.his: list[int] = []
        self.other: set[str] = set()

    def __contains__(self, task_id: str) -> bool:
        n = task_number(task_id)
        if n is None:
            return task_id in self.other
        i = bisect.bisect_right(self.los, n) - 1
        return i >= 0 and self.his[i] >= n

    def add(self, task_id: str) -> None:
        n = task_number(task_id)
        if n is None:
            self.other.add(task_id)
            return
        i = bisect.bisect_right(self.los, n) - 1  # the range starting at or before n
        if i >= 0 and self.his[i] >= n:
            return
        joins_left = i >= 0 and self.his[i] == n - 1
        joins_right = i + 1 < len(self.los) and self.los[i + 1] == n + 1
        if joins_left and joins_right:
            self.his[i] = self.his[i + 1]
            del self.los[i + 1], self.his[i + 1]
        elif joins_left:
            self.his[i] = n
        elif joins_right:
            self.los[i + 1] = n
        else:
            self.los.insert(i + 1, n)
            self.his.insert(i + 1, n)

    def __len__(self) -> int:
        return sum(h - lo + 1 for lo, h in zip(self.los, self.his)) + len(self.other)

    def state(self) -> IdSetState:
        return IdSetState(ranges=list(zip(self.los, self.his)), other=sorted(self.other))

    def load_state(self, s: IdSetState) -> None:
        self.los = [lo for lo, _ in s.ranges]
        self.his = [h for _, h in s.ranges]
        self.other = set(s.other)


@dataclass
class Ledger:
    """Counters of one policy lane (the live states are held by the lane itself)."""

    issued: int = 0  # tasks issued for this policy (primary lane)
    received: int = 0  # groups that completed into this lane
    samples: int = 0  # their trajectories
    skipped: Counter[str] = field(default_factory=Counter)  # curator decisions: prompts never issued
    fates: Counter[str] = field(default_factory=Counter)  # trained / filtered:R / dropped:R / failed:R
    late: Counter[str] = field(default_factory=Counter)  # late groups by what the late policy did
    replayed: int = 0  # replayed groups served again (not fates: the group was trained once already)

    def receive(self, samples: int, late: str | None = None) -> None:
        """A group of ``samples`` trajectories completed into the lane; ``late``: what the late policy did with it."""
        self.received += 1
        self.samples += samples
        if late:
            self.late[late] += 1

    def record(self, fate: Fate, n: int = 1) -> None:
        self.fates[str(fate)] += n

    def state(self) -> LedgerState:
        return LedgerState(issued=self.issued, received=self.received, samples=self.samples, skipped=dict(self.skipped),
                           fates=dict(self.fates), late=dict(self.late), replayed=self.replayed)

    def load_state(self, s: LedgerState) -> None:
        self.issued, self.received, self.samples, self.replayed = s.issued, s.received, s.samples, s.replayed
        self.skipped, self.fates, self.late = Counter(s.skipped), Counter(s.fates), Counter(s.late)

    def settled(self) -> int:
        return sum(self.fates.values())


def account(ledger: Ledger, primary: bool, in_flight: int, buffered: int, awaiting: int) -> Accounting:
    """The accounting table of one lane; ``adds_up`` says whether the states sum to the total."""
    total = ledger.issued if primary else ledger.received
    fates = dict(sorted(ledger.fates.items()))
    counted = (in_flight if primary else 0) + buffered + awaiting + sum(fates.values())
    if not primary:  # a failed or invalid task never completes a group in a secondary lane
        counted -= sum(n for f, n in fates.items() if not Fate.parse(f).outcome.completes_a_group)
    return Accounting(basis="issued" if primary else "received", total=total, in_flight=in_flight if primary else 0,
                      buffered=buffered, awaiting=awaiting, fates=fates, late=dict(ledger.late), skipped=dict(ledger.skipped),
                      replayed=ledger.replayed, adds_up=counted == total)
