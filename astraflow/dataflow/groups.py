"""Assembling trajectories into groups, and remembering batched groups for replay. Pure bookkeeping (no I/O).

Ingest feeds accepted trajectories in (with their position in the trajectory log) and gets complete
groups out. Deliveries stay unacked while their trajectories are held, so a dataflow that dies
loses nothing: the server redelivers them to the next one. A group keeps what the algorithms
decide on (its samples) and where each trajectory lies in the TRAJ stream, never the arrays: a
batch is a manifest of those references (the trainer reads the trajectories itself).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

from astraflow.algorithms import Group, Sample
from astraflow.streams.messages import Trajectory, TrajRef


def to_sample(t: Trajectory, deadline: float | None = None, version: int | None = None) -> Sample:
    """``version``: the oldest token version, when measured already (``validate.measure``)."""
    return Sample(
        traj_id=t.traj_id, task_id=t.task_id, prompt_id=t.prompt_id, policy=t.policy, reward=t.reward,
        version=t.min_version if version is None else version, n_tokens=len(t.completion_ids) // 4, truncated=t.finish_reason == "length",
        created_at=t.created_at, deadline=deadline,
    )


@dataclass
class HeldGroup:
    """A complete group: its algorithm view and where the trajectory log keeps its trajectories."""

    group: Group
    positions: list[int]  # where the trajectory log keeps each trajectory, aligned with ``group.samples``
    weight: float = 1.0  # factor on the group's advantages (a late group may be down-weighted)

    @property
    def task_id(self) -> str:
        return self.group.task_id

    @property
    def traj_ids(self) -> list[str]:
        return [s.traj_id for s in self.group.samples]

    def refs(self) -> list[TrajRef]:
        """What a batch manifest names of this group, in sample order."""
        return [TrajRef(seq=at, traj_id=s.traj_id, task_id=s.task_id) for s, at in zip(self.group.samples, self.positions, strict=True)]


DONE_MEMORY = 65536  # completed (task, policy) keys remembered to spot late copies


@dataclass
class Assembler:
    """Collects trajectories per (task, policy), as samples, until the group is complete."""

    partial: dict[tuple[str, str], dict[int, tuple[Sample, int]]] = field(default_factory=dict)
    done: OrderedDict[tuple[str, str], None] = field(default_factory=OrderedDict)

    def add(self, traj: Trajectory, seq: int, deadline: float | None = None,
            version: int | None = None) -> HeldGroup | Literal[False] | None:
        """The completed group, None while incomplete, False for a copy of something already held or
        completed here (ack it): a second sample at a held index, or any sample of a completed group.
        ``version``: its oldest token version, when measured already."""
        key = (traj.task_id, traj.policy)
        if key in self.done:
            return False
        slot = self.partial.setdefault(key, {})
        if traj.index in slot:
            if slot[traj.index][0].traj_id == traj.traj_id:  # the same message again: keep the newer copy
                slot[traj.index] = (to_sample(traj, deadline, version), seq)
                return None
            return False
        slot[traj.index] = (to_sample(traj, deadline, version), seq)
        if len(slot) < traj.group_size:
            return None
        del self.partial[key]
        self.done[key] = None
        while len(self.done) > DONE_MEMORY:
            self.done.popitem(last=False)
        items = [slot[i] for i in sorted(slot)]
        group = Group(task_id=traj.task_id, prompt_id=traj.prompt_id, policy=traj.policy, samples=tuple(s for s, _ in items))
        return HeldGroup(group, [seq for _, seq in items])

    @property
    def assembling(self) -> bool:
        """Some group is partly back."""
        return bool(self.partial)

    def drop(self, task_id: str, policy: str | None = None) -> list[str]:
        """Forget the partial groups of ``task_id`` (every policy's, or ``policy``'s); returns their trajectory ids."""
        keys = [k for k in self.partial if k[0] == task_id and policy in (None, k[1])]
        return [s.traj_id for k in keys for s, _ in self.partial.pop(k).values()]


RECENT = 512  # batched groups remembered for replay


class Recent:
    """Recently batched groups, for replay: in memory while this process holds them, and by their
    trajectory-log positions (what the state keeps) so a successor can name them again. A group whose samples
    all lie in one message (a node's ``TrajectoryGroup``) is kept as that one position."""

    def __init__(self, size: int = RECENT) -> None:
        self.size = size
        self.held: OrderedDict[str, HeldGroup] = OrderedDict()
        self.positions: OrderedDict[str, list[int]] = OrderedDict()

    def remember(self, held: HeldGroup) -> None:
        self.held[held.task_id] = held
        self.positions[held.task_id] = held.positions[:1] if len(set(held.positions)) == 1 else list(held.positions)
        for memory in (self.held, self.positions):
            while len(memory) > self.size:
                memory.popitem(last=False)

    def get(self, task_id: str) -> HeldGroup | None:
        return self.held.get(task_id)

    def positions_of(self, task_id: str, n: int) -> list[int] | None:
        """The positions of the ``n`` samples of ``task_id``'s group; None when not remembered (or not ``n``)."""
        at = self.positions.get(task_id)
        if at is not None and len(at) == 1:
            at = at * n  # one message held them all
        return at if at is not None and len(at) == n else None

    def state(self) -> dict[str, list[int]]:
        return {k: list(v) for k, v in self.positions.items()}

    def load_state(self, positions: dict[str, list[int]]) -> None:
        self.held.clear()
        self.positions = OrderedDict((k, list(v)) for k, v in positions.items())
        while len(self.positions) > self.size:  # kept by a run whose server replayed, resumed with one that does not
            self.positions.popitem(last=False)
