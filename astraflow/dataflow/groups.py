"""Assembling trajectories into groups, and accounting for every task's fate.

Pure bookkeeping (no I/O): the service feeds deliveries in and gets complete groups out.
Deliveries stay unacked while their trajectories are held, so a dataflow that dies loses
nothing: the server redelivers them to the next one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from astraflow.algorithms import Group, Sample
from astraflow.streams.messages import Trajectory


def to_sample(t: Trajectory, deadline: float | None = None) -> Sample:
    return Sample(
        traj_id=t.traj_id, task_id=t.task_id, prompt_id=t.prompt_id, policy=t.policy, reward=t.reward,
        version=t.min_version, n_tokens=len(t.completion_ids) // 4, truncated=t.finish_reason == "length",
        created_at=t.created_at, deadline=deadline,
    )


@dataclass
class HeldGroup:
    """A complete group: its algorithm view, its trajectories and the deliveries to ack."""

    group: Group
    trajectories: list[Trajectory]
    deliveries: list[Any]


@dataclass
class Assembler:
    """Collects trajectories per (task, policy) until the group is complete."""

    partial: dict[tuple[str, str], dict[int, tuple[Trajectory, Any]]] = field(default_factory=dict)
    done: set[tuple[str, str]] = field(default_factory=set)

    def add(self, traj: Trajectory, delivery: Any) -> HeldGroup | None | bool:
        """Returns the completed group, None while incomplete, False for a duplicate (ack it)."""
        key = (traj.task_id, traj.policy)
        if key in self.done:
            return False
        slot = self.partial.setdefault(key, {})
        if traj.index in slot:
            return False
        slot[traj.index] = (traj, delivery)
        if len(slot) < traj.group_size:
            return None
        del self.partial[key]
        self.done.add(key)
        items = [slot[i] for i in sorted(slot)]
        trajs = [t for t, _ in items]
        group = Group(task_id=traj.task_id, prompt_id=traj.prompt_id, policy=traj.policy, samples=tuple(to_sample(t) for t in trajs))
        return HeldGroup(group, trajs, [d for _, d in items])

    def held_deliveries(self) -> list[Any]:
        return [d for slot in self.partial.values() for _, d in slot.values()]


@dataclass
class Ledger:
    """Every task's fate: trained, filtered (by reason), dropped at serving (by reason), failed."""

    issued: int = 0
    skipped: Counter[str] = field(default_factory=Counter)  # curator decisions, not issued
    fates: Counter[str] = field(default_factory=Counter)

    def record(self, fate: str, n: int = 1) -> None:
        self.fates[fate] += n

    def state(self) -> dict[str, Any]:
        return {"issued": self.issued, "skipped": dict(self.skipped), "fates": dict(self.fates)}

    def load_state(self, s: dict[str, Any]) -> None:
        self.issued = int(s.get("issued", 0))
        self.skipped = Counter(s.get("skipped", {}))
        self.fates = Counter(s.get("fates", {}))

    def settled(self) -> int:
        return sum(self.fates.values())
