"""Ingesting trajectories: admit, assemble into groups, land complete groups in their lane.

Each delivery of the TRAJ stream goes through, in order:

0. ``whole`` — a trajectory too large for one message carries its arrays by reference
   (``payload_ref``): they are read back from the trajectory bucket (``streams/trajectories.py``,
   every digest checked) so the checks below see its values. Only those are read; a pull of
   normal-size trajectories costs nothing here. An object that is gone or corrupt makes the
   trajectory invalid (``payload``); a read that fails otherwise (a timeout) gives the
   delivery back (nak) to be read again.
1. ``admit`` — the one place a trajectory is accepted or turned away, in this order:

   - a policy the run does not have: dead-lettered;
   - a node that is quarantined (``reputation.py``: the node its subject names): invalid (``quarantined``), whatever
     else it says (its claims are not even scored);
   - arrays that could not be read whole (step 0): invalid (``payload``);
   - its values are checked (``validate.check_trajectory``: ids, group size, reward, tokens in
     the policy's vocabulary, lengths, logprobs, mask), then its claims (``claims.ClaimCheck``: the
     prompt it was issued, the reward's range, the reward scored again), which a pull checks in a
     worker thread before admitting any of its trajectories;
   - a task already settled or batched in this lane: a valid copy is acked and ignored (a
     redelivery after a restart), an invalid one dead-lettered;
   - a task this dataflow did not issue, or does not wait on (primary lane: in flight or kept;
     other lanes: one of the last ``inflight.RECENT`` tasks): dead-lettered;
   - its token versions (``validate.check_versions``): none newer than the policy's newest
     announced version (a version the dataflow has not heard of yet is first confirmed on the
     plane), generated ones not older than the task's ``min_versions``;
   - a redelivery of a trajectory held now replaces the held delivery; the same trajectory from
     another node is acked and ignored, counted against no one (``redelivered_elsewhere``: its task went
     to a second node after the first one's ack was lost or its ack wait ran out, and both answered; the held
     one stays); another sample for a group already complete is acked and ignored.

   **The invalid fate.** An invalid trajectory is dead-lettered with its reason after the next
   durable write. If its task is one this lane still waits on and this sample has not arrived
   yet, the task is settled in this lane as ``invalid:{code}`` (its partial group released; the
   task is not issued again: its prompt comes round in the next epoch). Otherwise (a task
   unknown or settled, a copy of a sample held already) nothing else changes. Every rejection is
   counted as ``invalid.{code}`` in heartbeats, and against the node that sent it
   (``reputation.Reputation.blame``). A trajectory that does not even decode (a value
   outside the wire's range) is dead-lettered by the consumer before ingest sees it; the dataflow
   reads the ids it claims back from ``dlq.traj`` and settles its task the same way, as
   ``invalid:schema`` (:meth:`TrajectoryIngest.undecodable`). A group message carrying more
   trajectories than a task has samples is dead-lettered whole, one entry rather than one per
   trajectory, and settles its task ``invalid:group_size`` (:meth:`TrajectoryIngest.refuse_group`).
2. assembly per ``(task, policy)`` (``groups.Assembler``); the delivery stays held, unacked,
   until its group's fate is decided.
3. ``land`` (pure) for a group that completes: curator feedback on every completed group, then
   a group with an explicitly failed sample (reward None, ``finish_reason: error``) is settled
   ``filtered:sample_error``, then the late policy for one past its task's deadline, then the
   filters. A group kept before a restart goes straight back into the buffer, with its weight,
   without the hooks. Every group that reaches the filters and the advantage has finite rewards.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from astraflow.algorithms import Context, Group, Pipeline
from astraflow.config import DataflowConfig
from astraflow.dataflow.claims import ClaimCheck
from astraflow.dataflow.durability import Journal, Rejectable
from astraflow.dataflow.groups import Assembler, HeldGroup
from astraflow.dataflow.inflight import InFlight
from astraflow.dataflow.lane import PolicyLane, context
from astraflow.dataflow.parts import by_group
from astraflow.dataflow.reading import Incoming, PullReader, Resolve
from astraflow.dataflow.reputation import Reputation, sender
from astraflow.dataflow.validate import Invalid, Limits, Stats, check_trajectory, check_versions, measure
from astraflow.streams.fates import DROPPED_EXPIRED, FILTERED_SAMPLE_ERROR, Fate, Outcome
from astraflow.streams.messages import Trajectory, TrajectoryGroup
from astraflow.streams.plane import Consumer
from astraflow.streams.trajectories import TrajMessage

log = logging.getLogger(__name__)
PULL_WAIT_S = 0.1  # how long a pull waits for the first trajectory (an idle turn: nothing else to do meanwhile)
BUSY_PULL_WAIT_S = 0.005  # after a busy turn: long enough for the server's answer on a loaded machine, short against a turn
FILTERED_BATCHES = 4  # a warning once a policy's filters dropped this many batches' worth of groups in a row, then at each doubling


@dataclass(frozen=True)
class Admission:
    action: Literal["reject", "invalid", "ack", "refresh", "assemble", "confirm"]
    reason: str = ""  # the DLQ reason (reject, invalid), the counter to bump (ack, refresh)
    code: str = ""  # reject, invalid: what failed (counted as ``invalid.{code}``; the fate suffix)
    settles: bool = False  # invalid: the task is settled ``invalid:{code}`` in this lane


ASSEMBLE = Admission("assemble")
CONFIRM = Admission("confirm")  # a token version newer than the lane knows: ask the plane, then admit again
REDELIVERED_ELSEWHERE = Admission("ack", "redelivered_elsewhere")  # a held trajectory, answered by a second node too


@dataclass(frozen=True)
class Landing:
    """What becomes of a group that completed."""

    fate: Fate | None = None  # a terminal fate (``filtered:R``, ``dropped:expired``); None: kept
    weight: float = 1.0  # factor on its advantages when kept
    late: str | None = None  # what the late policy did with it (kept / downweighted / dropped); None: on time


def land(group: Group, pipeline: Pipeline, ctx: Context, deadline: float | None, cfg: DataflowConfig) -> Landing:
    """Curators observe every completed group; a group with an explicitly failed sample is settled
    ``filtered:sample_error``; a group completing after its deadline is dropped under
    ``late_policy: drop``; then the filters; a late group that passes is kept as is or
    down-weighted by ``late_weight``."""
    pipeline.observe(group, ctx)
    if any(s.reward is None for s in group.samples):  # an explicit failure (validated: only with finish_reason "error")
        return Landing(fate=FILTERED_SAMPLE_ERROR)
    late = deadline is not None and ctx.now > deadline
    if late and cfg.late_policy == "drop":
        return Landing(fate=DROPPED_EXPIRED, late="dropped")
    decision = pipeline.keep(group, ctx)
    if not decision.keep:
        return Landing(fate=Fate.filtered(decision.reason))
    if not late:
        return Landing()
    if cfg.late_policy == "downweight":
        return Landing(weight=cfg.late_weight, late="downweighted")
    return Landing(late="kept")


NewestVersion = Callable[[str], Awaitable[int]]  # the newest announced version of a policy, as the plane has it now


class TrajectoryIngest:
    def __init__(self, lanes: Mapping[str, PolicyLane], in_flight: InFlight, journal: Journal, cfg: DataflowConfig,
                 stats: Counter[str], limits: Limits, newest: NewestVersion, resolve: Resolve, claims: ClaimCheck | None = None,
                 reputation: Reputation | None = None) -> None:
        self.lanes = lanes
        self.in_flight = in_flight
        self.journal = journal
        self.cfg = cfg
        self.stats = stats  # the dataflow's heartbeat counters
        self.limits = limits
        self.newest = newest
        self.reputation = reputation or Reputation(cfg.quarantine_after, on_quarantine=lambda q: journal.changed())  # per node
        self.reader = PullReader(resolve, claims, in_flight, lanes, self.reputation, stats)
        self.assembler = Assembler()
        self.filtered_in_a_row: Counter[str] = Counter()  # per policy: groups its filters dropped since the last one kept

    @property
    def assembling(self) -> bool:
        return self.assembler.assembling

    async def pull(self, trajectories: Consumer[TrajMessage], timeout: float = PULL_WAIT_S) -> int:
        """One pull of the TRAJ stream taken in; returns the number of trajectories it carried (a group's or a
        bundle's each)."""
        deliveries = await trajectories.pull(batch=256, timeout=timeout)
        incoming: list[Incoming] = []
        for delivery in deliveries:
            for group, refusable, parts in by_group(delivery):  # a group's trajectory by trajectory (``parts.py``)
                if group is not None and refusable is not None and len(group.trajectories) > self.limits.group_size:
                    self.refuse_group(refusable, group, sender(delivery.subject))
                else:
                    incoming.extend(parts)
        items = await self.reader.whole(incoming)
        claims = await self.reader.check_claims(items)
        for (d, t, unreadable), s, claim in zip(items, measure([t for _, t, _ in items]), claims, strict=True):  # a pull's arrays at once
            await self.take(d, s, t, unreadable, claim)
        return len(incoming)

    def waits_on(self, lane: PolicyLane, task_id: str) -> bool:
        """A task this dataflow issued and this lane has not settled: out or kept (primary lane, where tasks
        are issued), or one of the last ``inflight.RECENT`` issued (other lanes: their groups may come later)."""
        if lane.primary:
            return lane.is_out(task_id) or lane.kept_weight(task_id) is not None
        return self.in_flight.recent(task_id)

    def admit(self, t: Trajectory, s: Stats | None = None, confirmed: bool = False, unreadable: Invalid | None = None,
              claim: Invalid | None = None, node: str | None = None) -> Admission:
        """The one place a trajectory is accepted or turned away (see the module's docstring); ``s``: its
        arrays' stats (``validate.measure``); ``confirmed``: the lane's version was just read from the plane;
        ``unreadable``: why its offloaded arrays could not be read; ``claim``: what its claims failed on
        (:meth:`check_claims`), reported after what its values fail on; ``node``: who sent it (a quarantined node's
        trajectory is refused before anything else is looked at)."""
        lane = self.lanes.get(t.policy)
        if lane is None:
            return Admission("reject", f"invalid policy: {t.policy!r}; run has {list(self.lanes)}", "policy")
        s = s or measure([t])[0]
        cut_off = self.reputation.refusal(node)
        bad = cut_off or unreadable or check_trajectory(t, self.limits.policies[t.policy], self.limits.group_size, s) or claim
        if lane.is_closed(t.task_id):  # settled or batched before (a redelivery after a restart, a late copy)
            return Admission("reject", bad.reason, bad.code) if bad else Admission("ack", "redelivered_settled")
        if not self.waits_on(lane, t.task_id):
            if cut_off is not None:
                return Admission("reject", cut_off.reason, cut_off.code)
            return Admission("reject", f"invalid task: {t.task_id!r} is not a task this dataflow issued and waits on", "task")
        if bad is None:
            bad = check_versions(t, self.in_flight.floor(t.task_id, t.policy), lane.version, s)
            if bad is not None and bad.ahead and not confirmed:
                return CONFIRM
        held = self.journal.is_held(t.traj_id)
        if bad is not None:
            return Admission("invalid", bad.reason, bad.code, settles=not held and not lane.is_buffered(t.task_id))
        if held:  # redelivered while we hold it: the newer delivery is the live one; another node's answer changes nothing
            return Admission("refresh", "redelivered_held") if self.held_from(t.traj_id) == node else REDELIVERED_ELSEWHERE
        if lane.is_buffered(t.task_id):  # another sample for a complete group
            return Admission("ack", "duplicates")
        return ASSEMBLE

    async def take(self, d: Incoming, s: Stats | None = None, t: Trajectory | None = None, unreadable: Invalid | None = None,
                   claim: Invalid | None = None) -> None:
        """Admit and place one delivery; ``t``: its trajectory whole (default: as delivered)."""
        t = t or d.msg
        s = s or measure([t])[0]
        node = sender(d.subject)
        admission = self.admit(t, s, unreadable=unreadable, claim=claim, node=node)
        if admission.action == "confirm":
            self.lanes[t.policy].advance(await self.newest(t.policy))
            admission = self.admit(t, s, confirmed=True, unreadable=unreadable, claim=claim, node=node)
        if admission.action in ("reject", "invalid"):
            self.stats[f"invalid.{admission.code}"] += 1
            self.blame(node, t.task_id, admission)
            if admission.settles:
                self.invalidate(self.lanes[t.policy], t.task_id, admission.code, admission.reason)
            self.journal.reject_later(d, admission.reason, admission.code)
            return
        if admission.action != "assemble":
            if admission.action == "refresh":
                self.journal.hold(t.traj_id, d)
            else:
                self.journal.ack_later(d)
            self.stats[admission.reason] += 1
            return
        deadline = self.in_flight.deadline(t.task_id) if self.cfg.late_policy == "drop" else None  # samples carry it for EDF
        held = self.assembler.add(t, d.position, deadline, s.v_min)
        if held is False:  # a second sample at an index, or a copy of a group completed here
            self.journal.ack_later(d)
            self.stats["duplicates"] += 1
            return
        self.journal.hold(t.traj_id, d)
        if held is None:
            self.lanes[t.policy].assembling(t.task_id)
        else:
            self.complete(self.lanes[t.policy], held)

    def held_from(self, traj_id: str) -> str | None:
        """The node the held delivery of ``traj_id`` came from (every held delivery is an ``Incoming``)."""
        return sender(getattr(self.journal.held[traj_id], "subject", ""))

    def blame(self, node: str | None, task_id: str, refused: Admission) -> None:
        """Count a refusal against the node that sent it (``reputation.Reputation.blame``)."""
        self.reputation.blame(node, task_id, refused.code, refused.reason)

    def undecodable(self, lane: PolicyLane, task_id: str, traj_id: str, reason: str, node: str | None = None) -> None:
        """A sample its consumer dead-lettered because it did not decode (a value outside the wire's range), naming
        ``task_id`` (read from the DLQ, ``watch.SampleUndecodable``): its task is settled ``invalid:schema`` as an invalid
        sample's is, when this lane still waits on it and holds no copy of the sample. Otherwise nothing changes.
        Counted against ``node`` (None: no one; the service passes None for a dead letter older than its restored state)."""
        self.blame(node, task_id, Admission("reject", reason, "schema"))
        if lane.is_closed(task_id) or not self.waits_on(lane, task_id) or self.journal.is_held(traj_id) or lane.is_buffered(task_id):
            return
        self.stats["invalid.schema"] += 1
        self.invalidate(lane, task_id, "schema", reason)

    def refuse_group(self, d: Rejectable, g: TrajectoryGroup, node: str | None = None) -> None:
        """A group with more trajectories than a task has samples cannot be a task's: dead-lettered whole, one entry
        (not one per trajectory), its task settled ``invalid:group_size`` as a bad sample's would be."""
        reason = f"invalid group_size: {len(g.trajectories)} trajectories in one message, the run's tasks have {self.limits.group_size}"
        self.stats["invalid.group_size"] += 1
        self.blame(node, g.task_id, Admission("reject", reason, "group_size"))
        lane = self.lanes.get(g.policy)
        if lane is not None and not lane.is_closed(g.task_id) and not lane.is_buffered(g.task_id) and self.waits_on(lane, g.task_id):
            self.invalidate(lane, g.task_id, "group_size", reason)
        self.journal.reject_later(d, reason, "group_size")

    def invalidate(self, lane: PolicyLane, task_id: str, code: str, reason: str) -> None:
        """Settle ``task_id`` in ``lane`` as ``invalid:{code}``, its partial group released."""
        self.journal.release(self.assembler.drop(task_id, lane.name))
        lane.settle(task_id, Fate.invalid(code), error=reason[:300])

    def complete(self, lane: PolicyLane, held: HeldGroup) -> None:
        self.journal.changed()
        weight = lane.kept_weight(held.task_id)
        if weight is not None:  # kept before a restart: straight back into the buffer, counted and hooked already
            held.weight = weight
            lane.keep(held)
            return
        landing = land(held.group, lane.pipeline, context(self.lanes, self.cfg.max_staleness), self.in_flight.deadline(held.task_id),
                       self.cfg)
        lane.ledger.receive(len(held.group.samples), landing.late)
        if landing.fate is None:
            self.filtered_in_a_row[lane.name] = 0
            held.weight = landing.weight
            lane.keep(held)
            return
        lane.settle(held.task_id, landing.fate)
        self.journal.release(held.traj_ids)
        if landing.fate.outcome is Outcome.FILTERED:
            self.note_filtered(lane.name, landing.fate)

    def note_filtered(self, policy: str, fate: Fate) -> None:
        """Warn when ``policy``'s filters drop every group for a while: no batch forms, so no version comes (a policy
        whose samples all score the same under ``dynamic_sampling``; a filter too strict). Said at FILTERED_BATCHES
        batches' worth of groups in a row, then at each doubling; the run goes on (a policy may come out of it)."""
        n = self.filtered_in_a_row[policy] = self.filtered_in_a_row[policy] + 1
        first = FILTERED_BATCHES * self.cfg.groups_per_batch
        if n % first == 0 and (n // first) & (n // first - 1) == 0:
            why = ": every sample of each group scored the same" if fate.reason == "zero_variance" else ""
            log.warning("%s: its filters dropped the last %d groups in a row (the last %s%s); no batch forms while every group "
                        "is dropped", policy, n, fate, why)

    def abandon(self, task_id: str) -> None:
        """The task failed: forget what came back of it (in every lane) and ack that once the failure is durable."""
        self.journal.release(self.assembler.drop(task_id))
        for lane in self.lanes.values():
            lane.forget(task_id)
