"""One policy's lane in the dataflow: its buffer, plug-ins, batches and accounting.

Policies progress independently: each lane has its own buffer, plug-in pipeline, batch subject
(``batch.{policy}``), trainer backlog and version. Callers move a lane only through its methods
(receive, keep, settle, plan, published, trained, failed); everything a restarted dataflow needs
to continue exactly where this one stopped is in ``state()``:

- ``kept``: groups that passed the filters and wait in the buffer (their trajectories are still
  unacked, so they come back after a restart and go straight back into the buffer);
- ``closed``: tasks whose group is settled or batched: a redelivered trajectory of one is acked
  and ignored, so nothing already batched is batched again;
- ``plans``: batch manifests written ahead of their publication (id, tasks, trajectory
  references, advantages); one found at restart is published again as it is, with the same
  ``Nats-Msg-Id``, and the server drops it if the first publication had landed;
- ``awaiting``: published batches the trainer has not announced yet (their tasks);
- ``recent``: trajectory-log positions of recently batched groups, so replay survives a restart
  (kept only when the lane's server replays: ``Server.replays``);
- ``history``: per batch, the groups received and tasks issued when it was planned (the data
  each version cost) and how many versions its groups lagged the trainer (max, mean), for the last
  ``HISTORY`` batches (the state is written every turn that changes it, so what it keeps is kept short);
- the ledger and the plug-ins' own state.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping

from astraflow.algorithms import Context, Group, Pipeline, PromptItem, ServeResult
from astraflow.dataflow.groups import RECENT, HeldGroup, Recent
from astraflow.dataflow.ledger import IdSet, Ledger, account
from astraflow.streams.dataflow_state import Accounting, BatchPlan, LaneState
from astraflow.streams.fates import FAILED_TRAIN, TRAINED, Fate

HISTORY = 256  # batches whose data cost and staleness the state keeps (the state is written every turn: kept short)


def plan_batch(batch_id: str, chosen: list[HeldGroup], taken: list[str], advantages: Callable[[Group], list[float]],
               created_at: float) -> BatchPlan:
    """A batch manifest written ahead of its publication: every chosen group's trajectory references in
    order, with advantage ``a_i · w`` per trajectory (``w``: the group's weight, below 1 for a down-weighted
    late group). ``taken`` are the groups fresh from the buffer; the others are replayed."""
    return BatchPlan(batch_id=batch_id, tasks=list(taken), groups=[h.task_id for h in chosen], refs=[r for h in chosen for r in h.refs()],
                     advantages=[a * h.weight for h in chosen for a in advantages(h.group)], created_at=created_at)


def context(lanes: Mapping[str, PolicyLane], max_staleness: int, now: float | None = None) -> Context:
    """What a plug-in hook sees: the time and every policy's current version."""
    return Context(now=now or time.time(), versions={p: lane.version for p, lane in lanes.items()}, max_staleness=max_staleness)


class PolicyLane:
    """Everything the dataflow keeps for one policy."""

    def __init__(self, name: str, pipeline: Pipeline, primary: bool) -> None:
        self.name = name
        self.pipeline = pipeline
        self.primary = primary
        self.buffer: dict[str, HeldGroup] = {}  # kept groups in memory, in completion order
        self.kept: dict[str, float] = {}  # task -> advantage weight of every kept group (persisted)
        self.closed = IdSet()
        self.plans: dict[str, BatchPlan] = {}
        self.awaiting: dict[str, list[str]] = {}
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
        """Settled or batched already: anything more of it is a copy."""
        return task_id in self.closed

    def is_buffered(self, task_id: str) -> bool:
        return task_id in self.buffer

    def kept_weight(self, task_id: str) -> float | None:
        """The weight of a group that was kept before (a restart brought its trajectories back), else None."""
        return self.kept.get(task_id)

    def buffered(self) -> int:
        return len(self.kept)

    def ready(self, n_groups: int) -> bool:
        return len(self.buffer) >= n_groups

    def drained(self) -> bool:
        """Every batch planned here is published and trained."""
        return not self.awaiting and not self.plans

    def planned(self) -> list[BatchPlan]:
        return list(self.plans.values())

    def find(self, task_id: str) -> HeldGroup | None:
        """A group in memory: buffered, or batched recently (replay)."""
        return self.buffer.get(task_id) or self.recent.get(task_id)

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

    def note_issued(self, n: int) -> None:
        self.ledger.issued += n

    def note_backlog(self, pending: int) -> None:
        self.backlog = pending

    def backpressured(self) -> None:
        self.stats["backpressure"] = self.stats.get("backpressure", 0) + 1

    def receive(self, samples: int, late: str | None = None) -> None:
        """A group of ``samples`` trajectories completed into this lane; ``late``: what the late policy did with it."""
        self.ledger.received += 1
        self.ledger.samples += samples
        if late:
            self.ledger.late[late] += 1

    def keep(self, held: HeldGroup) -> None:
        self.buffer[held.task_id] = held
        self.kept[held.task_id] = held.weight

    def remember(self, held: HeldGroup) -> None:
        self.recent.remember(held)

    def settle(self, task_id: str, fate: Fate) -> HeldGroup | None:
        """A terminal fate for a group that is not in a batch (filtered, dropped, failed); returns it if it was buffered."""
        held = self.buffer.pop(task_id, None)
        self.kept.pop(task_id, None)
        self.closed.add(task_id)
        self.ledger.record(fate)
        return held

    def choose(self, n_groups: int, ctx: Context, rng: random.Random) -> ServeResult:
        """The server plug-in's pick from the buffer: a batch, and the groups it dropped on the way."""
        return self.pipeline.serve([h.group for h in self.buffer.values()], n_groups, ctx, rng)

    def plan(self, chosen: list[HeldGroup], taken: list[str], created_at: float) -> BatchPlan:
        """Write the next batch ahead: its taken groups leave the buffer and count as awaiting training."""
        self.batch_seq += 1
        plan = plan_batch(f"{self.name}-b{self.batch_seq:06d}", chosen, taken, self.pipeline.advantages, created_at)
        self.plans[plan.batch_id] = plan
        self.awaiting[plan.batch_id] = list(taken)
        self.ledger.replayed += len(chosen) - len(taken)
        lags = [self.version - h.group.min_version for h in chosen]
        self.stats["lag_mean"], self.stats["lag_max"] = sum(lags) / len(lags), max(lags)
        rewards = [s.reward or 0.0 for h in chosen for s in h.group.samples]
        self.stats["batch_reward"] = sum(rewards) / len(rewards)
        self.history = [*self.history[-(HISTORY - 1):], [self.batch_seq, self.ledger.received, self.ledger.issued, max(lags),
                                                          round(sum(lags) / len(lags), 3)]]
        for task_id in taken:
            h = self.buffer.pop(task_id)
            self.kept.pop(task_id, None)
            self.closed.add(task_id)
            self.remember(h)
        return plan

    def published(self, batch_id: str) -> None:
        """The planned batch is on the plane: its plan is no longer needed."""
        del self.plans[batch_id]

    def trained(self, batch_id: str) -> list[str]:
        """The trainer announced ``batch_id``: its tasks are trained (empty if not ours or already counted)."""
        tasks = self.awaiting.pop(batch_id, [])
        if tasks:
            self.ledger.record(TRAINED, len(tasks))
        return tasks

    def failed(self, batch_id: str, fate: Fate = FAILED_TRAIN) -> list[str]:
        """The trainer turned ``batch_id`` away: its tasks get ``fate`` (empty if not ours or already counted)."""
        tasks = self.awaiting.pop(batch_id, [])
        if tasks:
            self.ledger.record(fate, len(tasks))
        return tasks

    def awaits(self, batch_id: str) -> bool:
        """Published here and not yet trained or failed."""
        return batch_id in self.awaiting

    # ------------------------------------------------------------ views
    def accounting(self, in_flight: int) -> Accounting:
        return account(self.ledger, self.primary, in_flight, len(self.kept), sum(len(t) for t in self.awaiting.values()))

    def gauges(self) -> dict[str, float]:
        """Heartbeat values of this lane besides its accounting."""
        return {"batches": self.batch_seq, "version": self.version, "backlog": self.backlog, **self.stats}

    # ------------------------------------------------------------ state
    def state(self) -> LaneState:
        return LaneState(batch_seq=self.batch_seq, ledger=self.ledger.state(), pipeline=self.pipeline.state(), kept=dict(self.kept),
                         closed=self.closed.state(), plans=dict(self.plans), awaiting={b: list(t) for b, t in self.awaiting.items()},
                         recent=self.recent.state(), history=[list(h) for h in self.history], followed=self.followed)

    def load_state(self, s: LaneState) -> list[str]:
        """Restore; returns the plug-ins that start fresh (no saved state matched them)."""
        self.batch_seq = s.batch_seq
        self.ledger.load_state(s.ledger)
        self.kept = dict(s.kept)
        self.closed.load_state(s.closed)
        self.plans = dict(s.plans)
        self.awaiting = {b: list(t) for b, t in s.awaiting.items()}
        self.recent.load_state(s.recent)
        self.history = [list(h) for h in s.history]
        self.followed = s.followed
        return self.pipeline.load_state(s.pipeline)
