"""The dataflow's durable state: one record (KV key ``dataflow``) that a restarted dataflow resumes from.

Written by the dataflow before every publication it must be able to repeat (tasks, batches) and
before every ack it explains; read by its successor and by ``astraflow status``
(``accounting``). Everything is plain data: ids, counters, stream sequences, plug-in state.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from astraflow.streams.messages import Batch, Task, TrajRef
from astraflow.streams.state import Record


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class BatchPlan(_Frozen):
    """A batch manifest written ahead of its publication; published again as it is after a crash."""

    batch_id: str
    tasks: list[str]  # groups taken fresh from the buffer (their fate becomes "batched", then "trained")
    groups: list[str]  # every group in the batch, replayed ones included, in batch order
    refs: list[TrajRef]  # every trajectory (TRAJ stream sequence and ids), in batch order
    advantages: list[float]  # one per trajectory, aligned with ``refs``
    created_at: float

    def to_batch(self, policy: str) -> Batch:
        """The manifest this plan describes."""
        return Batch(batch_id=self.batch_id, policy=policy, refs=list(self.refs), task_ids=list(self.groups),
                     advantages=np.asarray(self.advantages, "<f4").tobytes(), created_at=self.created_at)


class LedgerState(_Frozen):
    issued: int = 0
    received: int = 0
    samples: int = 0
    skipped: dict[str, int] = {}
    fates: dict[str, int] = {}
    late: dict[str, int] = {}
    replayed: int = 0


class IdSetState(_Frozen):
    ranges: list[tuple[int, int]] = []  # inclusive ranges of our own task numbers (``t%08d``)
    other: list[str] = []  # foreign-looking ids


class LaneState(_Frozen):
    """One policy lane (see ``dataflow/lane.py`` for what each part means)."""

    batch_seq: int = 0
    ledger: LedgerState = LedgerState()
    pipeline: dict[str, Any] = {}  # plug-in name -> its own JSON-able state
    kept: dict[str, float] = {}  # buffered task -> advantage weight
    closed: IdSetState = IdSetState()
    plans: dict[str, BatchPlan] = {}
    awaiting: dict[str, list[str]] = {}  # published batch -> its fresh tasks
    recent: dict[str, list[int]] = {}  # recently batched task -> TRAJ stream sequences of its samples, or the one holding all (replay)
    history: list[list[float]] = []  # per batch: [seq, groups received, tasks issued, max lag, mean lag]
    followed: int = 0  # the newest weight announcement taken in (its suspects counted against their nodes)


class Accounting(_Frozen):
    """Where every task of one lane is; ``adds_up`` says whether the parts sum to ``total``."""

    basis: Literal["issued", "received"]  # the primary lane counts tasks issued, the others groups received
    total: int
    in_flight: int = 0
    buffered: int = 0
    awaiting: int = 0
    fates: dict[str, int] = {}
    late: dict[str, int] = {}
    skipped: dict[str, int] = {}
    replayed: int = 0
    adds_up: bool


class TaskState(_Frozen):
    """The task side (see ``dataflow/issuing.py``): what was issued, what is still out, where the prompt order stands."""

    task_seq: int = Field(0, ge=0)  # the last task number issued (``t%08d``)
    cursor: int = Field(0, ge=0)  # position in the prompt order
    in_flight: dict[str, float | None] = {}  # issued, primary group not complete: task -> deadline
    deadlines: dict[str, float] = {}  # recent tasks' deadlines (every lane's late policy reads them)
    floors: list[tuple[int, dict[str, int]]] = []  # the min_versions tasks were issued with: (first task number, floors) per change
    issuing: list[Task] = []  # tasks written ahead of their publication


class Quarantine(_Frozen):
    """A rollout node cut off from the run (``dataflow/reputation.py``): when, the refusal that tipped it over, and
    its failed tasks by refusal code."""

    node: str
    at: float
    reason: str
    failures: dict[str, int]

    def summary(self) -> str:
        """``reward_claim ×2, prompt_claim ×1``."""
        return ", ".join(f"{code} ×{n}" for code, n in sorted(self.failures.items(), key=lambda kv: -kv[1]))


class DataflowState(Record):
    family: ClassVar[str] = "dataflow"
    tasks: TaskState = TaskState(task_seq=0, cursor=0)
    lanes: dict[str, LaneState] = {}
    accounting: dict[str, Accounting] = {}
    pool: str = "raas"
    mode: Literal["async", "sync"] = "async"
    quarantined: dict[str, Quarantine] = {}  # node -> why it is cut off (the launcher revokes these on its server)
