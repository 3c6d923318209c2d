"""One policy's lane in the dataflow: its buffer, plug-ins, batches and accounting.

Policies progress independently: each lane has its own buffer, plug-in pipeline, batch subject
(``batch.{policy}``), trainer backlog and version. Everything a restarted dataflow needs to
continue exactly where this one stopped is in ``state()``:

- ``kept``: groups that passed the filters and wait in the buffer (their trajectories are still
  unacked, so they come back after a restart and go straight back into the buffer);
- ``closed``: tasks whose group is settled or batched: a redelivered trajectory of one is acked
  and ignored, so nothing already batched is batched again;
- ``plans``: batches written ahead of their publication (id, tasks, trajectory stream
  sequences, advantages); one found at restart is rebuilt from the stream and published again
  with the same ``Nats-Msg-Id``, and the server drops it if the first publication had landed;
- ``awaiting``: published batches the trainer has not announced yet (their tasks);
- ``recent``: stream sequences of recently batched groups, so replay survives a restart;
- ``history``: per batch, the groups received and tasks issued when it was planned (the data
  each version cost) and how many versions its groups lagged the trainer (max, mean);
- the ledger and the plug-ins' own state.
"""

from __future__ import annotations

from collections import OrderedDict

from astraflow.algorithms import Pipeline
from astraflow.dataflow.groups import HeldGroup
from astraflow.dataflow.ledger import IdSet, Ledger, account
from astraflow.streams.dataflow_state import Accounting, BatchPlan, LaneState

RECENT = 512  # batched groups remembered for replay
HISTORY = 1024  # batches whose data cost and staleness the state keeps


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
        self.recent: OrderedDict[str, HeldGroup] = OrderedDict()  # batched groups held in memory
        self.recent_seqs: OrderedDict[str, list[int]] = OrderedDict()
        self.trained_batches: set[str] = set()  # seen in announcements while this process runs
        self.ledger = Ledger()
        self.version = 0
        self.batch_seq = 0
        self.backlog = 0  # the trainer consumer's pending batches, as last measured
        self.stats: dict[str, float] = {}
        self.history: list[list[float]] = []  # per batch: [seq, groups received, tasks issued, max lag, mean lag] when planned

    # ------------------------------------------------------------ transitions
    def keep(self, held: HeldGroup) -> None:
        self.buffer[held.task_id] = held
        self.kept[held.task_id] = held.weight

    def settle(self, task_id: str, fate: str) -> None:
        """A terminal fate for a group that is not in a batch (filtered, dropped, failed)."""
        self.buffer.pop(task_id, None)
        self.kept.pop(task_id, None)
        self.closed.add(task_id)
        self.ledger.record(fate)

    def plan(self, batch_id: str, held: list[HeldGroup], taken: list[str], advantages: list[float], created_at: float) -> BatchPlan:
        """Write the batch ahead: its taken groups leave the buffer and count as awaiting training."""
        plan = BatchPlan(batch_id=batch_id, tasks=taken, groups=[h.task_id for h in held], seqs=[s for h in held for s in h.seqs],
                         advantages=advantages, created_at=created_at)
        self.plans[batch_id] = plan
        self.awaiting[batch_id] = list(taken)
        lags = [self.version - h.group.min_version for h in held]
        self.stats["lag_mean"], self.stats["lag_max"] = sum(lags) / len(lags), max(lags)
        self.history = [*self.history[-(HISTORY - 1):], [self.batch_seq, self.ledger.received, self.ledger.issued, max(lags),
                                                          round(sum(lags) / len(lags), 3)]]
        for task_id in taken:
            h = self.buffer.pop(task_id)
            self.kept.pop(task_id, None)
            self.closed.add(task_id)
            self.remember(h)
        return plan

    def remember(self, held: HeldGroup) -> None:
        self.recent[held.task_id] = held
        self.recent_seqs[held.task_id] = list(held.seqs)
        while len(self.recent) > RECENT:
            self.recent.popitem(last=False)
        while len(self.recent_seqs) > RECENT:
            self.recent_seqs.popitem(last=False)

    def trained(self, batch_id: str) -> list[str]:
        """The trainer announced ``batch_id``: its tasks are trained (empty if not ours or already counted)."""
        self.trained_batches.add(batch_id)
        tasks = self.awaiting.pop(batch_id, [])
        if tasks:
            self.ledger.record("trained", len(tasks))
        return tasks

    # ------------------------------------------------------------ views
    def accounting(self, in_flight: int) -> Accounting:
        return account(self.ledger, self.primary, in_flight, len(self.kept), sum(len(t) for t in self.awaiting.values()))

    # ------------------------------------------------------------ state
    def state(self) -> LaneState:
        return LaneState(batch_seq=self.batch_seq, ledger=self.ledger.state(), pipeline=self.pipeline.state(), kept=dict(self.kept),
                         closed=self.closed.state(), plans=dict(self.plans), awaiting={b: list(t) for b, t in self.awaiting.items()},
                         recent={k: list(v) for k, v in self.recent_seqs.items()}, history=[list(h) for h in self.history])

    def load_state(self, s: LaneState) -> list[str]:
        """Restore; returns the plug-ins that start fresh (no saved state matched them)."""
        self.batch_seq = s.batch_seq
        self.ledger.load_state(s.ledger)
        self.kept = dict(s.kept)
        self.closed.load_state(s.closed)
        self.plans = dict(s.plans)
        self.awaiting = {b: list(t) for b, t in s.awaiting.items()}
        self.recent_seqs = OrderedDict((k, list(v)) for k, v in s.recent.items())
        self.history = [list(h) for h in s.history]
        return self.pipeline.load_state(s.pipeline)
