"""Issuing tasks: prompt order, curator selection, the budget, and the write-ahead of what is published.

Tasks are issued for the primary policy (a multi-policy workflow feeds the other lanes from the
same tasks). Each turn the issuer computes how many it may publish:

    async:  min(max_tasks_in_flight, (max_staleness + 1) · groups_per_batch) − in_flight − buffered
            − max(0, queued − 1) · groups_per_batch (queued: batches waiting for the trainer),
            and at most max_tasks_in_flight − pending (the pool consumer's lag, read from the server)
    sync:   groups_per_batch − buffered, once every task released before is back, settled and
            its batch trained; else nothing

then draws prompts in order and lets the curators skip some (:meth:`TaskIssuer.issue`). The tasks
are written ahead (the turn's commit holds them as ``issuing``) before the dataflow publishes them,
with the turn's batches, under ``Nats-Msg-Id`` = task id, so a successor that finds them publishes
them again and the server keeps one copy; :meth:`TaskIssuer.published` then forgets them.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Mapping

from astraflow.algorithms import Context, PromptItem
from astraflow.config import DataflowConfig, Recipe
from astraflow.dataflow.durability import Journal
from astraflow.dataflow.inflight import InFlight
from astraflow.dataflow.lane import PolicyLane
from astraflow.streams.dataflow_state import TaskState
from astraflow.streams.messages import Task
from astraflow.streams.plane import Plane
from astraflow.streams.task_queue import TaskQueue
from astraflow.tasks import Problem

LAG_READ_S = 1.0  # how seldom the pool's lag is read while the last read found no task unaccounted for


def staleness_budget(cfg: DataflowConfig, in_flight: int, buffered: int, queued: int = 0) -> int:
    """async: (max_staleness + 1) batches' worth in flight, buffered, or queued for the trainer beyond its next batch,
    never above max_tasks_in_flight. ``queued``: batches waiting for the trainer. A group issued now is served after
    them: held behind more than one, it waits in the buffer while the trainer moves on, and goes stale there (a
    generation wasted)."""
    cap = min(cfg.max_tasks_in_flight, (cfg.max_staleness + 1) * cfg.groups_per_batch)
    return cap - in_flight - buffered - max(0, queued - 1) * cfg.groups_per_batch


def buffered_for_budget(lanes: Mapping[str, PolicyLane], steps: Mapping[str, int], primary: str) -> int:
    """The buffer the budget counts: the fullest among lanes whose trainer still has steps to take (a lane whose
    policy finished keeps buffering what no one will train, and must not starve its partners); the primary's
    once every policy is done."""
    training = [lane.buffered() for name, lane in lanes.items() if lane.version < steps[name]]
    return max(training) if training else lanes[primary].buffered()


def queued_for_budget(lanes: Mapping[str, PolicyLane], steps: Mapping[str, int]) -> int:
    """The trainer backlog the budget counts: the longest among lanes whose trainer still has steps to take."""
    return max((lane.backlog for name, lane in lanes.items() if lane.version < steps[name]), default=0)


def lag_budget(cfg: DataflowConfig, pending: int) -> int:
    """async: the pool's backlog of tasks (ours or anyone's; at most ours in flight and those the last read found
    beyond them) stays under max_tasks_in_flight."""
    return cfg.max_tasks_in_flight - pending


def sync_budget(cfg: DataflowConfig, buffered: int, drained: bool) -> int:
    """sync: a batch worth (less what is buffered) once everything released before is back and trained."""
    return max(0, cfg.groups_per_batch - buffered) if drained else 0


def min_versions(versions: Mapping[str, int], allowed_lag: int) -> dict[str, int]:
    """The oldest weights a node may roll a task out with: each policy's version − allowed lag, at least 0."""
    return {p: max(0, v - allowed_lag) for p, v in versions.items()}


class PromptOrder:
    """An endless order over ``n`` prompts: epoch ``e`` is a permutation seeded by ``seed + e``,
    computed once per epoch. ``cursor`` counts the prompts drawn, so a restarted dataflow that
    restores it continues the same order."""

    def __init__(self, n: int, seed: int, cursor: int = 0) -> None:
        if n < 1:
            raise ValueError("the prompt order needs at least one prompt")
        self.n, self.seed, self.cursor = n, seed, cursor
        self._epoch = -1
        self._order: list[int] = []

    def next(self) -> int:
        epoch, i = divmod(self.cursor, self.n)
        if epoch != self._epoch:
            self._order = list(range(self.n))
            random.Random(self.seed + epoch).shuffle(self._order)
            self._epoch = epoch
        self.cursor += 1
        return self._order[i]


class TaskIssuer:
    def __init__(self, recipe: Recipe, plane: Plane, lanes: Mapping[str, PolicyLane], problems: list[Problem],
                 in_flight: InFlight, journal: Journal, rng: random.Random) -> None:
        self.cfg = recipe.dataflow
        self.lanes = lanes
        self.steps = {p: recipe.policies[p].trainer.steps for p in lanes}
        self.workflow, self.tasks = recipe.workflow, TaskQueue(plane, recipe.rollout.pool)
        self.plane = plane
        self.lane = lanes[recipe.primary]  # the primary policy's: tasks are issued in its name
        self.problems = problems
        self.order = PromptOrder(len(problems), recipe.data.seed)
        self.in_flight = in_flight
        self.journal = journal
        self.rng = rng
        self.task_seq = 0
        self.issuing: list[Task] = []  # written ahead, not confirmed published yet
        self.unaccounted = 0  # tasks waiting in the pool's queue beyond those counted in flight, at the last lag read
        self.lag_read_at = -math.inf  # monotonic time of the last lag read

    async def read_pending(self) -> None:
        """async: how many tasks wait in the pool's queue that this dataflow does not count in flight (``unaccounted``:
        another's, or one whose group came back that the server handed out again), from the server's count now (before
        :meth:`issue`). Each of its own that waits there it counts in flight, so the queue's lag is at most
        ``len(in_flight) + unaccounted``. Read in a turn whose staleness budget lets it issue (in the others the lag
        changes nothing): in each while the last read found some unaccounted for, else once every ``LAG_READ_S`` (most
        turns: a request to the server each spared)."""
        if self.cfg.mode != "async" or self.staleness_room() <= 0:
            return
        if self.unaccounted or time.monotonic() - self.lag_read_at >= LAG_READ_S:
            pending = (await self.tasks.backlog()).pending
            self.unaccounted, self.lag_read_at = max(0, pending - len(self.in_flight)), time.monotonic()

    def issue(self, ctx: Context, drained: bool) -> list[Task]:
        """The tasks the budget allows now, counted in flight and held as ``issuing`` until :meth:`published`;
        ``drained``: no group partly back, every batch published and trained."""
        budget = self.budget(drained)
        tasks = self.draw(budget, ctx) if budget > 0 else []
        if tasks:
            for t in tasks:
                self.lane.issue(t.task_id, t.deadline)
                self.in_flight.issued(t.task_id, t.deadline, t.min_versions, t.prompt_id)
            self.issuing = tasks
            self.journal.changed()
        return tasks

    def budget(self, drained: bool) -> int:
        if self.cfg.mode == "sync":
            return sync_budget(self.cfg, self.buffered(), drained and not self.in_flight and not self.issuing)
        return min(self.staleness_room(), lag_budget(self.cfg, len(self.in_flight) + self.unaccounted))

    def staleness_room(self) -> int:
        """async: the tasks the staleness bound leaves room for now (``staleness_budget``)."""
        return staleness_budget(self.cfg, len(self.in_flight), self.buffered(), queued_for_budget(self.lanes, self.steps))

    def buffered(self) -> int:
        return buffered_for_budget(self.lanes, self.steps, self.lane.name)

    def draw(self, budget: int, ctx: Context) -> list[Task]:
        """Up to ``budget`` tasks in prompt order, each prompt past the curators; one pass over the prompts at most."""
        floors = min_versions(ctx.versions, 0 if self.cfg.mode == "sync" else self.cfg.max_staleness)
        timeout = self.cfg.task_timeout_s
        tasks: list[Task] = []
        for _ in range(len(self.problems)):
            if len(tasks) >= budget:
                break
            p = self.problems[self.order.next()]
            if not self.lane.select(PromptItem(p.prompt_id, self.lane.name, meta=p.meta), ctx, self.rng):
                continue
            self.task_seq += 1
            now = time.time()  # a task's deadline runs from its creation, not from the turn's start (a round trip ago)
            tasks.append(Task(task_id=f"t{self.task_seq:08d}", workflow=self.workflow, policy=self.lane.name, prompt_id=p.prompt_id,
                              prompt=p.prompt, group_size=self.cfg.group_size, meta=p.meta, min_versions=floors, created_at=now,
                              deadline=now + timeout if timeout else None))
        return tasks

    def published(self) -> None:
        """The tasks being issued are on the plane."""
        if self.issuing:
            self.issuing = []
            self.journal.changed()

    async def restore(self, s: TaskState) -> None:
        """After a restart: the saved state loaded, where each task out is in the TASK stream (a work queue holds only
        the unacked), and the tasks written ahead published again under their ids (a copy of one that landed before is
        dropped by the server)."""
        self.load_state(s)
        now = time.time()
        held = await self.tasks.queued_tasks()
        found = {t.task_id: ticket for ticket, t in held}
        for _, t in held:
            self.in_flight.note_prompt(t.task_id, t.prompt_id)
        for task in self.in_flight.out():
            self.in_flight.published(task, found.get(task), now)
        for t in s.issuing:
            self.in_flight.note_prompt(t.task_id, t.prompt_id)
        if s.issuing:
            tickets = await self.tasks.issue(s.issuing)
            for t, ticket in zip(s.issuing, tickets, strict=True):
                self.in_flight.published(t.task_id, ticket, now)

    # ------------------------------------------------------------ state
    def state(self) -> TaskState:
        in_flight, deadlines, floors = self.in_flight.state()
        return TaskState(task_seq=self.task_seq, cursor=self.order.cursor, in_flight=in_flight, deadlines=deadlines,
                         floors=floors, issuing=list(self.issuing))

    def load_state(self, s: TaskState) -> None:
        """Restore the saved state alone (:meth:`restore` does the rest of a restart)."""
        self.task_seq, self.order.cursor = s.task_seq, s.cursor
        self.in_flight.load_state(s.in_flight, s.deadlines, s.floors, s.task_seq)
