"""The values data algorithms see: plain frozen dataclasses, no I/O, nothing live.

The dataflow service converts wire messages (``streams.messages``) into these and calls the
hooks in ``base``. Everything here is JSON-friendly so plug-in state can hold it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class PromptItem:
    """A prompt about to be rolled out (a task before it is published)."""

    prompt_id: str
    policy: str  # the policy that will solve it
    difficulty: float | None = None  # in [0, 1], 0 = easiest; None = unknown
    meta: Mapping[str, Any] = field(default_factory=dict)  # the task's metadata (source, …)


@dataclass(frozen=True, slots=True)
class Sample:
    """One finished trajectory, reduced to what data algorithms decide on."""

    traj_id: str
    task_id: str
    prompt_id: str
    policy: str
    reward: float | None  # None: the reward failed
    version: int  # weight version that produced the oldest token
    n_tokens: int  # completion tokens
    truncated: bool  # stopped by the length limit
    created_at: float  # unix seconds
    deadline: float | None = None  # unix seconds after which it is late; None = no time limit


@dataclass(frozen=True, slots=True)
class Group:
    """All samples of one task (one prompt rolled out ``len(samples)`` times)."""

    task_id: str
    prompt_id: str
    policy: str
    samples: tuple[Sample, ...]
    meta: Mapping[str, Any] = field(default_factory=dict)  # the task's metadata (source, …)

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError(f"group {self.task_id!r} has no samples")
        for s in self.samples:
            if s.task_id != self.task_id or s.policy != self.policy:
                raise ValueError(
                    f"sample {s.traj_id!r} (task {s.task_id!r}, policy {s.policy!r}) does not belong "
                    f"to group {self.task_id!r} (policy {self.policy!r})"
                )

    @property
    def rewards(self) -> tuple[float, ...]:
        """One reward per sample; a missing reward (None) reads as NaN."""
        return tuple(math.nan if s.reward is None else float(s.reward) for s in self.samples)

    @property
    def reward_mean(self) -> float:
        r = self.rewards
        return sum(r) / len(r)

    @property
    def reward_std(self) -> float:
        """Population standard deviation (ddof=0) of the rewards; NaN if any is missing."""
        r = self.rewards
        mean = sum(r) / len(r)
        return math.sqrt(sum((x - mean) ** 2 for x in r) / len(r))

    @property
    def min_version(self) -> int:
        """The oldest weight version any token of the group came from."""
        return min(s.version for s in self.samples)

    @property
    def deadline(self) -> float | None:
        """The earliest wall-clock deadline of any sample, or None if none has one."""
        deadlines = [s.deadline for s in self.samples if s.deadline is not None]
        return min(deadlines) if deadlines else None

    @property
    def created_at(self) -> float:
        return min(s.created_at for s in self.samples)

    def to_dict(self) -> dict[str, Any]:
        """JSON-shaped form (lists, not tuples; ``meta`` must itself be JSON-serialisable)."""
        d = dataclasses.asdict(self)
        d["samples"] = list(d["samples"])
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Group:
        fields = dict(d)
        fields["samples"] = tuple(Sample(**s) for s in fields["samples"])
        fields["meta"] = dict(fields.get("meta", {}))
        return cls(**fields)


@dataclass(frozen=True, slots=True)
class Context:
    """What the service knows when it calls a hook."""

    now: float  # unix seconds
    versions: Mapping[str, int]  # current trainer version per policy
    max_staleness: int  # how many versions a sample may lag the trainer

    def lag(self, group: Group) -> int | None:
        """Versions between the trainer and the group's oldest token; None if the policy's version is unknown."""
        current = self.versions.get(group.policy)
        return None if current is None else current - group.min_version

    def invalid_reason(self, group: Group, max_staleness: int | None = None) -> str | None:
        """``"stale"`` past the version budget, ``"expired"`` past a sample's deadline, else None."""
        limit = self.max_staleness if max_staleness is None else max_staleness
        lag = self.lag(group)
        if lag is not None and lag > limit:
            return "stale"
        deadline = group.deadline
        if deadline is not None and self.now > deadline:
            return "expired"
        return None


@dataclass(frozen=True, slots=True)
class Decision:
    """A hook's verdict; every drop or skip carries a reason the service counts."""

    keep: bool
    reason: str = ""


KEEP = Decision(True)


def drop(reason: str) -> Decision:
    return Decision(False, reason)
