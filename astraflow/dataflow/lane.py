"""One policy's lane in the dataflow: its tasks, plug-ins, batches and accounting.

Policies progress independently: each lane has its own tasks (``lifecycle.TaskBook``: one record per
task, moved only through the lifecycle's stages), plug-in pipeline, batch subject (``batch.{policy}``),
trainer backlog and version. Callers move a lane only through its methods (keep, settle, plan,
published, trained, failed); every fate a task is settled with goes to the lane's fate recorder (the
dataflow's journal) from :meth:`PolicyLane.settle`, the one place that settles. Everything a restarted
dataflow needs to continue exactly where this one stopped is in ``state()``:

- ``kept``: the tasks at ``kept``, with their weights (their trajectories are still unacked, so they
  come back after a restart and go straight back into the buffer);
- ``closed``: tasks planned, awaiting or settled: a redelivered trajectory of one is acked and
  ignored, so nothing already batched is batched again;
- ``plans``: batch manifests written ahead of their publication (id, tasks, trajectory
  references, advantages); one found at restart is published again as it is, with the same
  ``Nats-Msg-Id``, and the server drops it if the first publication had landed;
- ``awaiting``: the tasks of each batch planned or published that the trainer has not announced yet;
- ``recent``: trajectory-log positions of recently batched groups, so replay survives a restart
  (kept only when the lane's server replays: ``Server.replays``);
- ``history``: per batch, the groups received and tasks issued when it was planned (the data
  each version cost) and how many versions its groups lagged the trainer (max, mean), for the last
  ``HISTORY`` batches (the state is written every turn that changes it, so what it keeps is kept short);
- the ledger and the plug-ins' own state.

The primary lane's tasks at ``issued`` are saved by the issuer (``TaskState.in_flight``, through
``inflight.InFlight``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from astraflow.algorithms import Context, Group, Pipeline, PromptItem, ServeResult
from astraflow.dataflow.groups import RECENT, HeldGroup, Recent
from astraflow.dataflow.ledger import Ledger, account
from astraflow.dataflow.lifecycle import IN_A_BATCH, OUT, Stage, TaskBook
from astraflow.streams.dataflow_state import Accounting, BatchPlan, LaneState
from astraflow.streams.fates import FAILED_TRAIN, TRAINED, Fate


class FateRecorder(Protocol):
    """Where a lane's settled tasks go (the dataflow's journal writes a fate record each)."""

    def record(self, policy: str, task_id: str, fate: Fate, **extra: Any) -> None: ...


HISTORY = 256  # batches whose data cost and staleness the state keeps (the state is written every turn: kept short)


def plan_batch(batch_id: str, chosen: list[HeldGroup], taken: list[str], advantages: Callable[[Group], list[float]],
               created_at: float) -> BatchPlan:
    """A batch manifest written ahead of its publication: every chosen group's trajectory references in
    order, with advantage ``a_i · w`` per trajectory (``w``: the group's weight, below 1 for a down-weighted
    late group). ``taken`` are the groups fresh from the buffer; the others are replayed."""
    return BatchPlan(batch_id=batch_id, tasks=list(taken), groups=[h.task_id for h in chosen], refs=[r for h in chosen for r in h.refs()],
                     advantages=[a * h.weight for h in chosen for a in advantages(h.group)], created_at=created_at)


def batch_stats(version: int, chosen: list[HeldGroup]) -> dict[str, float]:
    """A batch's staleness (how many versions its groups lag ``version``: mean, max) and its mean reward."""
    lags = [version - h.group.min_version for h in chosen]
    rewards = [s.reward or 0.0 for h in chosen for s in h.group.samples]
    return {"lag_mean": sum(lags) / len(lags), "lag_max": max(lags), "batch_reward": sum(rewards) / len(rewards)}


def context(lanes: Mapping[str, PolicyLane], max_staleness: int, now: float | None = None) -> Context:
    """What a plug-in hook sees: the time and every policy's current version."""
    return Context(now=now or time.time(), versions={p: lane.version for p, lane in lanes.items()}, max_staleness=max_staleness)


class PolicyLane:
    """Everything the dataflow keeps for one policy."""

    def __init__(self, name: str, pipeline: Pipeline, primary: bool, fates: FateRecorder | None = None) -> None:
        self.name = name
        self.pipeline = pipeline
        self.primary = primary
        self.fates = fates  # None: the fates are counted, not recorded (a lane on its own, in tests)
        self.tasks = TaskBook(name, primary)
        self.plans: dict[str, BatchPlan] = {}  # batches written ahead, not published yet
        self.unannounced: dict[str, None] = {}  # batches planned or published that the trainer has not announced yet
        self.recent = Recent(RECENT if pipeline.server.replays else 0)  # only a replaying server asks for batched groups
        self.ledger = Ledger()
        self.version = 0
        self.batch_seq = 0
        self.backlog = 0  # the trainer consumer's pending batches, as last measured
        self.followed = 0  # the newest weight announcement taken in (a restarted dataflow reads them all again)
        self.stats: dict[str, float] = {}
        self.history: list[list[float]] = []  # per batch: [seq, groups received, tasks issued, max lag, mean lag] when planned

    # ------------------------------------------------------------ questions
    def is_closed(self, task_id: str) -> bool:
        """Planned, awaiting or settled already: anything more of it is a copy."""
        return task_id in self.tasks.closed

    def is_out(self, task_id: str) -> bool:
        """Issued here, its group not complete yet."""
        return self.tasks.stage(task_id) in OUT

    def is_buffered(self, task_id: str) -> bool:
        """Kept, its group in memory."""
        return self.tasks.group(task_id) is not None

    def kept_weight(self, task_id: str) -> float | None:
        """The weight of a kept group (one a restart brought back is kept before its trajectories return), else None."""
        rec = self.tasks.kept(task_id)
        return rec.weight if rec is not None else None

    def buffered(self) -> int:
        return self.tasks.count(Stage.KEPT)

    def buffer(self) -> list[HeldGroup]:
        """The kept groups in memory, in the order they were kept."""
        return [r.group for r in self.tasks.at_stage(Stage.KEPT) if r.group is not None]

    def ready(self, n_groups: int) -> bool:
        return len(self.buffer()) >= n_groups

    def drained(self) -> bool:
        """Every batch planned here is published and trained."""
        return not self.unannounced and not self.plans

    def planned(self) -> list[BatchPlan]:
        return list(self.plans.values())

    def find(self, task_id: str) -> HeldGroup | None:
        """A group in memory: buffered, or batched recently (replay)."""
        return self.tasks.group(task_id) or self.recent.get(task_id)

    def replay_positions(self, task_id: str, n: int) -> list[int] | None:
        return self.recent.positions_of(task_id, n)

    # ------------------------------------------------------------ transitions
    def advance(self, version: int) -> None:
        self.version = max(self.version, version)

    def select(self, prompt: PromptItem, ctx: Context, rng: random.Random) -> bool:
        """The curators' verdict on a prompt about to be issued; a skip is counted with its reason."""
        decision = self.pipeline.select(prompt, ctx, rng)
        if not decision.keep:
            self.ledger.skipped[decision.reason or "skipped"] += 1
        return decision.keep

    def issue(self, task_id: str, deadline: float | None) -> None:
        """A task issued for this (the primary) lane: out on the plane from now."""
        self.tasks.move(task_id, Stage.ISSUED, deadline=deadline)
        self.ledger.issued += 1

    def backpressured(self) -> None:
        self.stats["backpressure"] = self.stats.get("backpressure", 0) + 1

    def assembling(self, task_id: str) -> None:
        """Part of the task's group is held: an issued task (or one unknown to a lane other than the primary) is
        assembling; a kept one a restart brought back stays kept while its trajectories return."""
        if self.tasks.stage(task_id) in (Stage.ISSUED, None):
            self.tasks.move(task_id, Stage.ASSEMBLING)

    def forget(self, task_id: str) -> None:
        """The task failed on the plane: a partial group in a lane other than the primary is forgotten (no fate)."""
        if not self.primary and self.tasks.stage(task_id) is Stage.ASSEMBLING:
            self.tasks.forget(task_id)

    def keep(self, held: HeldGroup) -> None:
        """A complete group into the buffer (a restored one back into it, at its end)."""
        self.tasks.move(held.task_id, Stage.KEPT, group=held, weight=held.weight, deadline=None, ticket=None, since=None)

    def settle(self, task_id: str, fate: Fate, **extra: Any) -> HeldGroup | None:
        """A terminal fate: counted, and recorded with ``extra`` (batch, version, error); returns the group if it was buffered."""
        held = self.tasks.group(task_id)
        self.tasks.move(task_id, Stage.SETTLED)
        self.ledger.record(fate)
        if self.fates is not None:
            self.fates.record(self.name, task_id, fate, **extra)
        return held

    def choose(self, n_groups: int, ctx: Context, rng: random.Random) -> ServeResult:
        """The server plug-in's pick from the buffer: a batch, and the groups it dropped on the way."""
        return self.pipeline.serve([h.group for h in self.buffer()], n_groups, ctx, rng)

    def plan(self, chosen: list[HeldGroup], taken: list[str], created_at: float) -> BatchPlan:
        """Write the next batch ahead: its taken groups leave the buffer, planned."""
        self.batch_seq += 1
        plan = plan_batch(f"{self.name}-b{self.batch_seq:06d}", chosen, taken, self.pipeline.advantages, created_at)
        self.plans[plan.batch_id] = plan
        self.unannounced[plan.batch_id] = None
        self.ledger.replayed += len(chosen) - len(taken)
        self.stats.update(batch_stats(self.version, chosen))
        self.history = [*self.history[-(HISTORY - 1):], [self.batch_seq, self.ledger.received, self.ledger.issued, self.stats["lag_max"],
                                                          round(self.stats["lag_mean"], 3)]]
        fresh = set(taken)
        for h in chosen:
            if h.task_id in fresh:  # from the buffer (the others are replayed)
                self.recent.remember(h)
                self.tasks.move(h.task_id, Stage.PLANNED, batch=plan.batch_id, group=None)
        return plan

    def published(self, batch_id: str) -> None:
        """The planned batch is on the plane: its plan is no longer needed, its tasks await training."""
        del self.plans[batch_id]
        for task_id in self.tasks.in_batch(batch_id):
            if self.tasks.stage(task_id) is Stage.PLANNED:
                self.tasks.move(task_id, Stage.AWAITING)

    def trained(self, batch_id: str, version: int) -> list[str]:
        """The trainer announced ``batch_id`` in ``version``: its tasks are trained (empty if not ours or already counted)."""
        tasks = self.announced(batch_id)
        for task_id in tasks:
            self.settle(task_id, TRAINED, batch=batch_id, version=version)
        return tasks

    def failed(self, batch_id: str, fate: Fate = FAILED_TRAIN, error: str = "") -> list[str]:
        """The trainer turned ``batch_id`` away: its tasks get ``fate`` (empty if not ours or already counted)."""
        tasks = self.announced(batch_id)
        for task_id in tasks:
            self.settle(task_id, fate, batch=batch_id, error=error)
        return tasks

    def announced(self, batch_id: str) -> list[str]:
        """The trainer announced ``batch_id`` (trained or refused): its tasks, to be settled (empty if not ours or
        already announced)."""
        if batch_id not in self.unannounced:
            return []
        del self.unannounced[batch_id]
        return self.tasks.in_batch(batch_id)

    def awaits(self, batch_id: str) -> bool:
        """Planned or published here, and not yet trained or failed."""
        return batch_id in self.unannounced

    # ------------------------------------------------------------ views
    def accounting(self) -> Accounting:
        return account(self.ledger, self.primary, self.tasks.count(*OUT), self.buffered(), self.tasks.count(*IN_A_BATCH))

    def gauges(self) -> dict[str, float]:
        """Heartbeat values of this lane besides its accounting."""
        return {"batches": self.batch_seq, "version": self.version, "backlog": self.backlog, **self.stats}

    # ------------------------------------------------------------ state
    def awaiting(self) -> dict[str, list[str]]:
        """Each batch planned or published and not announced yet -> its tasks."""
        return self.tasks.by_batch(self.unannounced)

    def state(self) -> LaneState:
        return LaneState(batch_seq=self.batch_seq, ledger=self.ledger.state(), pipeline=self.pipeline.state(),
                         kept={r.task_id: r.weight for r in self.tasks.at_stage(Stage.KEPT)}, closed=self.tasks.closed.state(),
                         plans=dict(self.plans), awaiting=self.awaiting(), recent=self.recent.state(),
                         history=[list(h) for h in self.history], followed=self.followed)

    def load_state(self, s: LaneState) -> list[str]:
        """Restore; returns the plug-ins that start fresh (no saved state matched them)."""
        self.batch_seq = s.batch_seq
        self.ledger.load_state(s.ledger)
        self.tasks.closed.load_state(s.closed)
        for task_id, weight in s.kept.items():
            self.tasks.restore(task_id, Stage.KEPT, weight=weight)
        self.plans = dict(s.plans)
        self.unannounced = dict.fromkeys(s.awaiting)
        for batch_id, tasks in s.awaiting.items():
            for task_id in tasks:
                self.tasks.restore(task_id, Stage.PLANNED if batch_id in self.plans else Stage.AWAITING, batch=batch_id)
        self.recent.load_state(s.recent)
        self.history = [list(h) for h in s.history]
        self.followed = s.followed
        return self.pipeline.load_state(s.pipeline)
