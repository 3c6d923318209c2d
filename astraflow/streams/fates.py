"""How a task ended for one policy: an outcome kind and why, a typed value (``Fate``), never a string to take apart.

Written as ``kind:reason`` (``dropped:stale``; ``trained`` alone) where it is stored or shown: the ledger's counters,
``FateRecord.fate``, the accounting table, ``summary.json``. ``Fate.parse`` reads that form back and refuses any other.
The reasons of the system's own fates are named here; a filter plug-in's reason (``filtered:zero_variance``) and a
trajectory check's code (``invalid:logprobs``) are the plug-in's and the check's own words, a token each.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Outcome(str, Enum):
    TRAINED = "trained"  # in a batch the trainer trained
    FILTERED = "filtered"  # dropped by a filter after rollout (reason: the filter's)
    DROPPED = "dropped"  # dropped at serving (stale) or past its deadline (expired)
    FAILED = "failed"  # the task itself failed (its rollout, its training, or it was lost)
    INVALID = "invalid"  # a trajectory of it failed a value check (reason: the check's code)

    @property
    def completes_a_group(self) -> bool:
        """Whether a group came back whole before this outcome (not so for a failed or invalid task): only those are
        counted among a secondary lane's received groups."""
        return self not in (Outcome.FAILED, Outcome.INVALID)


@dataclass(frozen=True)
class Fate:
    outcome: Outcome
    reason: str = ""  # "" only for trained

    def __post_init__(self) -> None:
        if (self.outcome is Outcome.TRAINED) != (self.reason == ""):
            raise ValueError(f"a {self.outcome.value} fate {'takes no' if self.outcome is Outcome.TRAINED else 'needs a'} reason")

    def __str__(self) -> str:
        return f"{self.outcome.value}:{self.reason}" if self.reason else self.outcome.value

    @classmethod
    def parse(cls, text: str) -> Fate:
        kind, _, reason = text.partition(":")
        try:
            return cls(Outcome(kind), reason)
        except ValueError as e:
            raise ValueError(f"not a fate: {text!r} ({e})") from None

    @classmethod
    def filtered(cls, reason: str) -> Fate:
        return cls(Outcome.FILTERED, reason)

    @classmethod
    def invalid(cls, code: str) -> Fate:
        return cls(Outcome.INVALID, code)


TRAINED = Fate(Outcome.TRAINED)
DROPPED_STALE = Fate(Outcome.DROPPED, "stale")  # too many versions behind at serving, or a batch the trainer found stale
DROPPED_EXPIRED = Fate(Outcome.DROPPED, "expired")  # completed after its deadline under ``late_policy: drop``
FILTERED_SAMPLE_ERROR = Fate(Outcome.FILTERED, "sample_error")  # a sample the workflow marked failed
FAILED_TRAIN = Fate(Outcome.FAILED, "train")  # its batch was turned away by the trainer
FAILED_LOST = Fate(Outcome.FAILED, "lost")  # kept before a restart, its trajectories never came back
