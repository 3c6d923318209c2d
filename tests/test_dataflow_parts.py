"""The dataflow's collaborators without a server: budgets, prompt order, tasks in flight, ingest
decisions, batch plans, lane accounting and the journal's ordering of records, state and acks.

The transport is replaced only where its effect is the thing under test: an in-memory state
writer and in-memory deliveries that write what they were asked to do into one shared log.
"""

from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from factories import a_trajectory

from astraflow.algorithms import AlgorithmsConfig, Context, build_pipeline
from astraflow.config import DataflowConfig
from astraflow.dataflow import durability
from astraflow.dataflow.durability import Journal
from astraflow.dataflow.groups import Assembler, HeldGroup
from astraflow.dataflow.inflight import DEADLINES, InFlight
from astraflow.dataflow.ingest import Landing, TrajectoryIngest, land
from astraflow.dataflow.issuing import (
    PromptOrder,
    buffered_for_budget,
    lag_budget,
    min_versions,
    queued_for_budget,
    staleness_budget,
    sync_budget,
)
from astraflow.dataflow.lane import PolicyLane, plan_batch
from astraflow.dataflow.lifecycle import Stage
from astraflow.dataflow.validate import Limits, PolicyLimits
from astraflow.streams.dataflow_state import DataflowState
from astraflow.streams.fates import DROPPED_EXPIRED, TRAINED, Fate, Outcome
from astraflow.streams.messages import PER_TOKEN, ObjectRef, Trajectory
from astraflow.streams.state import FateRecord, Record
from astraflow.streams.trajectories import PayloadUnavailable

CFG = DataflowConfig(group_size=2, groups_per_batch=2, max_tasks_in_flight=10, max_staleness=1)


def traj(task: str, i: int, reward: float, policy: str = "solver", n: int = 2, traj_id: str | None = None, version: int = 4) -> Trajectory:
    named = {"traj_id": traj_id} if traj_id else {}
    return a_trajectory(task, i, policy=policy, group_size=n, prompt_ids=np.arange(3), completion_ids=np.arange(2), logprob=0.0,
                        version=version, reward=reward, prompt_id=f"p-{task}", **named)


def group_of(task: str, rewards: list[float], seq0: int = 1, version: int = 4) -> HeldGroup:
    a = Assembler()
    out = [a.add(traj(task, i, r, n=len(rewards), version=version), seq=seq0 + i) for i, r in enumerate(rewards)]
    held = out[-1]
    assert isinstance(held, HeldGroup)
    return held


def pipeline(**algorithms: Any):
    return build_pipeline(AlgorithmsConfig.model_validate(algorithms))


# ------------------------------------------------------------ issuing
def test_async_budget_is_the_staleness_window_less_what_is_out_or_buffered():
    assert staleness_budget(CFG, in_flight=0, buffered=0) == 4  # (1 + 1) batches of 2, under the cap of 10
    assert staleness_budget(CFG, in_flight=2, buffered=1) == 1
    assert staleness_budget(CFG, in_flight=4, buffered=1) == -1  # over: nothing is issued
    assert staleness_budget(CFG.model_copy(update={"max_staleness": 9}), in_flight=3, buffered=0) == 7  # the cap binds
    assert lag_budget(CFG, pending=7) == 3  # the pool's measured backlog, whoever issued it
    assert [staleness_budget(CFG, in_flight=1, buffered=0, queued=q) for q in range(4)] == [3, 3, 1, -1]  # one queued batch free


def test_a_finished_policy_buffering_untrained_groups_does_not_starve_its_partner():
    solver, verifier = PolicyLane("solver", pipeline(), primary=True), PolicyLane("verifier", pipeline(), primary=False)
    for i in range(9):  # the solver's trainer is done: its groups pile up
        solver.tasks.restore(f"t{i}", Stage.KEPT)
    verifier.tasks.restore("t0", Stage.KEPT)
    lanes, steps = {"solver": solver, "verifier": verifier}, {"solver": 40, "verifier": 40}
    solver.backlog, verifier.backlog = 3, 1
    assert buffered_for_budget(lanes, steps, "solver") == 9  # both training: the fullest buffer bounds issuing
    assert queued_for_budget(lanes, steps) == 3  # and the longest trainer backlog
    solver.advance(40)
    assert buffered_for_budget(lanes, steps, "solver") == 1  # the verifier still needs tasks
    assert queued_for_budget(lanes, steps) == 1
    verifier.advance(40)
    assert queued_for_budget(lanes, steps) == 0  # no trainer left: nothing it queues holds issuing back
    assert buffered_for_budget(lanes, steps, "solver") == 9  # every policy done: the primary's, as before


def test_sync_budget_releases_a_batch_only_when_drained():
    assert sync_budget(CFG, buffered=0, drained=True) == 2
    assert sync_budget(CFG, buffered=1, drained=True) == 1  # a filter left the buffer short: the shortfall only
    assert sync_budget(CFG, buffered=3, drained=True) == 0
    assert sync_budget(CFG, buffered=0, drained=False) == 0


def test_min_versions_lag_the_trainers_by_the_allowed_staleness():
    assert min_versions({"solver": 5, "verifier": 1}, 2) == {"solver": 3, "verifier": 0}
    assert min_versions({"solver": 5}, 0) == {"solver": 5}  # sync: on-policy


def test_prompt_order_is_a_fresh_permutation_per_epoch_and_resumes_from_its_cursor():
    order = PromptOrder(7, seed=3)
    drawn = [order.next() for _ in range(21)]
    for epoch in range(3):
        reference = list(range(7))
        random.Random(3 + epoch).shuffle(reference)  # the order every earlier build used: a resumed run continues it
        assert drawn[7 * epoch: 7 * (epoch + 1)] == reference
    assert drawn[:7] != drawn[7:14]
    resumed = PromptOrder(7, seed=3, cursor=10)
    assert [resumed.next() for _ in range(11)] == drawn[10:]
    with pytest.raises(ValueError, match="at least one prompt"):
        PromptOrder(0, seed=3)


def test_in_flight_tasks_are_the_lanes_out_and_their_deadlines_outlive_them():
    lane = PolicyLane("solver", pipeline(), primary=True)
    f = InFlight(lane.tasks)
    for task, deadline in (("t1", 100.0), ("t2", None), ("t3", 300.0)):
        lane.issue(task, deadline)
        f.issued(task, deadline)
    assert len(f) == 3 and f.overdue(now=200.0) == 1 and f.out() == ["t1", "t2", "t3"]
    f.published("t3", 7, now=5.0)
    assert f.ticket("t3") == 7 and f.out_since() == {"t3": 5.0}
    lane.keep(group_of("t1", [0.0, 1.0]))  # its group came back
    assert "t1" not in f and f.deadline("t1") == 100.0  # a secondary lane's group may still come back late
    lane.assembling("t2")
    assert "t2" in f and lane.is_out("t2")  # part of it back: still out
    lane.settle("t2", Fate.parse("failed:rollout"))
    assert "t2" not in f and not lane.is_out("t2") and lane.is_closed("t2")
    back = InFlight(PolicyLane("solver", pipeline(), primary=True).tasks)
    back.load_state(*f.state(), newest=3)
    assert back.state() == f.state() == ({"t3": 300.0}, {"t1": 100.0, "t3": 300.0}, [])
    for i in range(DEADLINES + 5):
        f.issued(f"x{i}", float(i))
    assert f.deadline("t1") is None and f.deadline(f"x{DEADLINES + 4}") is not None  # bounded memory, oldest first out


# ------------------------------------------------------------ landing a complete group
def test_landing_runs_curator_feedback_then_the_late_policy_then_the_filters():
    p = pipeline(curators=[{"type": "greso"}], filters=[{"type": "dynamic_sampling"}])
    ctx = Context(now=50.0, versions={"solver": 4}, max_staleness=2)
    varied, solved = group_of("t1", [0.0, 1.0]).group, group_of("t2", [1.0, 1.0]).group
    assert land(varied, p, ctx, deadline=None, cfg=CFG) == Landing()
    assert land(varied, p, ctx, deadline=60.0, cfg=CFG) == Landing()  # before its deadline
    assert land(solved, p, ctx, deadline=None, cfg=CFG) == Landing(fate=Fate.parse("filtered:zero_variance"))
    late = {"keep": Landing(late="kept"), "downweight": Landing(weight=0.25, late="downweighted"),
            "drop": Landing(fate=DROPPED_EXPIRED, late="dropped")}
    for policy, expected in late.items():
        cfg = CFG.model_copy(update={"late_policy": policy, "late_weight": 0.25})
        assert land(varied, p, ctx, deadline=40.0, cfg=cfg) == expected
        dropped_first = "dropped:expired" if policy == "drop" else "filtered:zero_variance"
        assert str(land(solved, p, ctx, deadline=40.0, cfg=cfg).fate) == dropped_first  # a late drop precedes the filters
    assert p.state()["curators"][0]["state"]["window"]["solver"]["n"] == 9  # every completed group was observed, dropped or not


# ------------------------------------------------------------ the journal and ingest, on in-memory transport
class MemoryStore:
    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log

    async def put(self, record: Record) -> None:
        assert isinstance(record, DataflowState)
        self.log.append(("state", record.tasks.task_seq))

    async def put_many(self, records: list[Record]) -> None:
        self.log.append(("fates", [(r.task_id, r.fate) for r in records if isinstance(r, FateRecord)]))


class MemoryDelivery:
    def __init__(self, msg: Trajectory, seq: int, log: list[tuple[Any, ...]]) -> None:
        self.msg, self.seq, self.log = msg, seq, log

    @property
    def position(self) -> int:
        return self.seq

    @property
    def subject(self) -> str:
        return f"af.run.traj.{self.msg.policy}.node-0"  # as a node credential publishes it

    async def ack(self) -> None:
        self.log.append(("ack", self.seq))

    async def in_progress(self) -> None:
        self.log.append(("in_progress", self.seq))

    async def reject(self, reason: str, code: str = "") -> None:
        self.log.append(("reject", self.seq, reason))

    async def nak(self, delay: float | None = None) -> None:
        self.log.append(("nak", self.seq))


class Pulled:
    """A consumer whose next pull hands out these deliveries."""

    def __init__(self, *deliveries: MemoryDelivery) -> None:
        self.deliveries = list(deliveries)

    async def pull(self, batch: int = 1, timeout: float = 1.0) -> list[MemoryDelivery]:
        return self.deliveries


async def test_the_journal_writes_fates_then_the_state_then_acks():
    log: list[tuple[Any, ...]] = []
    seq = iter(range(100))
    journal = Journal(MemoryStore(log), lambda: DataflowState.model_validate({"tasks": {"task_seq": next(seq)}}))
    a, b, c = (MemoryDelivery(traj("t1", i, 0.0), 10 + i, log) for i in range(3))
    assert not journal.hold("a", a) and not journal.hold("b", b)
    journal.ack_later(c)
    journal.record("solver", "t1", Fate.filtered("zero_variance"))
    journal.release(["a", "unknown"])
    await journal.commit()  # write-ahead: durable, nothing acked
    assert log == [("fates", [("t1", "filtered:zero_variance")]), ("state", 0)]
    journal.record("solver", "t2", TRAINED, batch="solver-b000001")
    await journal.flush()
    assert log[2:] == [("fates", [("t2", "trained")]), ("state", 1), ("ack", 12), ("ack", 10)]
    await journal.flush()  # nothing changed, nothing to ack: nothing written
    assert len(log) == 6
    await journal.keep_alive()
    assert log[6:] == [("in_progress", 11)] and journal.is_held("b") and not journal.is_held("a")
    journal.changed()
    await journal.flush()
    assert log[7:] == [("state", 2)]


async def test_a_turn_that_publishes_nothing_writes_once_the_last_write_is_old_enough(monkeypatch):
    """Its changes and the acks they explain wait for a later write; a turn that publishes writes at once."""
    log: list[tuple[Any, ...]] = []
    seq = iter(range(100))
    journal = Journal(MemoryStore(log), lambda: DataflowState.model_validate({"tasks": {"task_seq": next(seq)}}))
    clock = [100.0]
    monkeypatch.setattr(durability, "time", SimpleNamespace(monotonic=lambda: clock[0]))  # the journal's clock only
    await journal.commit()
    a, b = (MemoryDelivery(traj("t1", i, 0.0), 10 + i, log) for i in range(2))
    journal.hold("a", a)
    journal.release(["a"])
    journal.record("solver", "t1", TRAINED, batch="solver-b000001")
    clock[0] += 0.6 * durability.COMMIT_EVERY_S
    await journal.flush(publishing=False)
    assert log == [("state", 0)] and journal.to_ack == [a]  # nothing written, nothing acked
    clock[0] += 0.6 * durability.COMMIT_EVERY_S
    await journal.flush(publishing=False)
    assert log[1:] == [("fates", [("t1", "trained")]), ("state", 1), ("ack", 10)]
    journal.ack_later(b)  # a copy of something settled: nothing to write, acked at once
    await journal.flush(publishing=False)
    journal.changed()
    await journal.flush(publishing=True)  # its publications need the state written ahead, however recent the last write
    assert log[4:] == [("ack", 11), ("state", 2)]
    journal.record("solver", "t2", Fate(Outcome.INVALID, "reward"))
    journal.reject_later(b, "invalid reward: a test", "reward")
    await journal.flush(publishing=False)  # a trajectory to dead-letter is not kept waiting either
    assert log[6:] == [("fates", [("t2", "invalid:reward")]), ("state", 3), ("reject", 11, "invalid reward: a test")]


def stub(t: Trajectory) -> Trajectory:
    """``t`` as a node publishes it when it is too large for a message: its arrays elsewhere."""
    ref = ObjectRef(name=f"traj/{t.traj_id}", nuid="n" + t.traj_id, size=1, chunk_size=1, digests=["d"], digest="d")
    return Trajectory.model_validate({**t.model_dump(), **dict.fromkeys(PER_TOKEN, b""), "payload_ref": ref})


class Objects:
    """A trajectory bucket in memory: the arrays of the stubs it was given, by object name; others are gone."""

    def __init__(self, *whole: Trajectory) -> None:
        self.whole = {f"traj/{t.traj_id}": t for t in whole}
        self.down = False  # reads fail as a lost connection does

    async def resolve(self, trajs: list[Trajectory]) -> list[Trajectory | PayloadUnavailable]:
        if self.down:
            raise TimeoutError("no answer")
        out: list[Trajectory | PayloadUnavailable] = []
        for t in trajs:
            name = t.payload_ref.name if t.payload_ref else ""
            out.append(self.whole.get(name, PayloadUnavailable(f"{t.traj_id}: {name} is gone")) if t.payload_ref else t)
        return out


def ingest_setup(objects: Objects | None = None,
                 **cfg: Any) -> tuple[TrajectoryIngest, PolicyLane, InFlight, Journal, list[tuple[Any, ...]]]:
    log: list[tuple[Any, ...]] = []
    lane = PolicyLane("solver", pipeline(filters=[{"type": "dynamic_sampling"}]), primary=True)
    journal = Journal(MemoryStore(log), DataflowState)
    lane.fates = journal
    in_flight = InFlight(lane.tasks)
    limits = Limits(group_size=2, policies={"solver": PolicyLimits(vocab=384, max_completion=8, max_generated=8, max_row=None)})

    async def newest(policy: str) -> int:  # what the plane's last announcement says
        return 4

    ingest = TrajectoryIngest({"solver": lane}, in_flight, journal, CFG.model_copy(update=cfg), Counter(), limits, newest,
                              (objects or Objects()).resolve)
    return ingest, lane, in_flight, journal, log


async def test_ingest_admits_assembles_and_acks_copies_only_after_a_durable_write():
    ingest, lane, in_flight, journal, log = ingest_setup()
    lane.issue("t1", None)
    await ingest.take(MemoryDelivery(traj("t1", 0, 0.0, policy="critic"), 1, log))
    first = MemoryDelivery(traj("t1", 0, 0.0), 2, log)
    await ingest.take(first)
    assert journal.is_held("t1.solver.0") and ingest.assembling
    again = MemoryDelivery(traj("t1", 0, 0.0), 3, log)  # redelivered while held: the newer delivery is the live one
    await ingest.take(again)
    assert journal.held["t1.solver.0"] is again and ingest.stats == {"invalid.policy": 1, "redelivered_held": 1}
    assert lane.version == 4  # its tokens are v4: the plane confirmed v4 is announced
    await ingest.take(MemoryDelivery(traj("t1", 1, 1.0), 4, log))
    assert lane.is_buffered("t1") and "t1" not in in_flight and not ingest.assembling
    assert lane.accounting().buffered == 1 and lane.ledger.received == 1
    await ingest.take(MemoryDelivery(traj("t1", 1, 1.0, traj_id="copy"), 5, log))  # another sample for a complete group
    assert ingest.stats["invalid.traj_id"] == 1 and lane.is_buffered("t1")  # dead-lettered; the complete group stands
    lane.issue("t0", None)
    lane.settle("t0", Fate.parse("failed:rollout"))
    await ingest.take(MemoryDelivery(traj("t0", 0, 1.0), 6, log))  # a task settled before a restart
    assert ingest.stats["redelivered_settled"] == 1
    assert log == []  # nothing acked or dead-lettered before the state is written
    await journal.flush()
    assert log == [("fates", [("t0", "failed:rollout")]), ("state", 0), ("ack", 6),
                   ("reject", 1, "invalid policy: 'critic'; run has ['solver']"),
                   ("reject", 5, "invalid traj_id: traj_id 'copy' is not t1.solver.1")]  # the buffered group's deliveries stay held


async def test_a_filtered_group_is_settled_and_its_trajectories_acked_after_its_fate_is_written():
    ingest, lane, _in_flight, journal, log = ingest_setup()
    lane.issue("t1", None)
    for i in range(2):
        await ingest.take(MemoryDelivery(traj("t1", i, 1.0), 10 + i, log))
    assert lane.is_closed("t1") and lane.ledger.fates == {"filtered:zero_variance": 1}
    await journal.flush()
    assert log == [("fates", [("t1", "filtered:zero_variance")]), ("state", 0), ("ack", 10), ("ack", 11)]


async def test_a_run_of_filtered_groups_is_warned_about_at_each_doubling_and_a_kept_group_ends_it(caplog):
    ingest, lane, _in_flight, _, log = ingest_setup(groups_per_batch=1)  # a warning at 4, 8, 16 ... groups in a row
    warned = []
    for n, rewards in enumerate([(1.0, 1.0)] * 8 + [(0.0, 1.0)] + [(0.0, 0.0)] * 4):
        task = f"t{n}"
        lane.issue(task, None)
        caplog.clear()
        for i, r in enumerate(rewards):
            await ingest.take(MemoryDelivery(traj(task, i, r), 100 + 2 * n + i, log))
        if any("dropped the last" in r.getMessage() for r in caplog.records):
            warned.append(n + 1)
    assert warned == [4, 8, 13]  # groups 1-4, 1-8, then after the kept ninth group, 10-13
    assert ingest.filtered_in_a_row["solver"] == 4 and lane.ledger.fates["filtered:zero_variance"] == 12


async def test_a_group_kept_before_a_restart_goes_back_into_the_buffer_without_the_hooks():
    ingest, lane, in_flight, _journal, log = ingest_setup(late_policy="drop")
    lane.tasks.restore("t1", Stage.KEPT, weight=0.5)  # what a restored state says
    in_flight.issued("t1", 1.0)  # long past its deadline: the late policy would drop it
    for i in range(2):
        await ingest.take(MemoryDelivery(traj("t1", i, float(i)), 10 + i, log))
        assert lane.tasks.stage("t1") is Stage.KEPT  # not assembling: its group was kept before
    assert lane.is_buffered("t1") and lane.state().kept == {"t1": 0.5} and lane.ledger.received == 0 and not lane.ledger.late


async def test_offloaded_arrays_are_read_back_and_checked_like_any_others():
    big, bad, gone = traj("t1", 0, 1.0), traj("t2", 0, 1.0), stub(traj("t3", 0, 1.0))
    bad = bad.model_copy(update={"completion_ids": np.array([1, 999], "<i4").tobytes()})  # a token outside the vocabulary
    objects = Objects(big, bad)
    ingest, lane, _in_flight, journal, log = ingest_setup(objects)
    for task in ("t1", "t2", "t3"):
        lane.issue(task, None)
    pulled = Pulled(*(MemoryDelivery(t, seq, log) for seq, t in ((10, stub(big)), (20, stub(bad)), (30, gone))))
    assert await ingest.pull(pulled) == 3  # type: ignore[arg-type]
    assert journal.is_held("t1.solver.0") and ingest.assembling  # read back whole, checked, assembled
    assert lane.ledger.fates == {"invalid:token": 1, "invalid:payload": 1}  # its values are checked; its arrays must be there
    await journal.flush()
    assert [e[:2] for e in log if e[0] == "reject"] == [("reject", 20), ("reject", 30)]
    assert "t3.solver.0: traj/t3.solver.0 is gone" in log[-1][2]
    objects.down = True  # a read that fails for another reason says nothing about the trajectory: it comes back later
    lane.issue("t4", None)
    pulled = Pulled(MemoryDelivery(stub(traj("t4", 0, 1.0)), 40, log), MemoryDelivery(traj("t4", 1, 0.0), 41, log))
    assert await ingest.pull(pulled) == 2  # type: ignore[arg-type]
    assert log[-1] == ("nak", 40) and not journal.is_held("t4.solver.0") and ingest.stats["payload_retries"] == 1
    assert journal.is_held("t4.solver.1")  # the rest of the pull goes on


async def test_a_failed_task_releases_what_came_back_of_it():
    ingest, lane, _in_flight, journal, log = ingest_setup()
    lane.issue("t1", None)
    await ingest.take(MemoryDelivery(traj("t1", 0, 0.0), 10, log))
    assert lane.tasks.stage("t1") is Stage.ASSEMBLING
    ingest.abandon("t1")
    await journal.flush()
    assert log == [("ack", 10)] and not ingest.assembling


# ------------------------------------------------------------ batch plans and the lane's accounting
def test_a_plan_scales_advantages_by_group_weight_and_is_the_manifest():
    p = pipeline()  # GRPO: (r - mean) / std
    fresh, replayed = group_of("t1", [0.0, 1.0], seq0=10), group_of("t2", [1.0, 3.0], seq0=20)
    fresh.weight = 0.5
    plan = plan_batch("solver-b000001", [fresh, replayed], ["t1"], p.advantages, created_at=7.0)
    grpo = 1 / np.sqrt(2)
    assert plan.tasks == ["t1"] and plan.groups == ["t1", "t2"] and [r.seq for r in plan.refs] == [10, 11, 20, 21]
    assert [(r.traj_id, r.task_id) for r in plan.refs] == [("t1.solver.0", "t1"), ("t1.solver.1", "t1"), ("t2.solver.0", "t2"),
                                                           ("t2.solver.1", "t2")]
    assert np.allclose(plan.advantages, [-0.5 * grpo, 0.5 * grpo, -grpo, grpo])
    batch = plan.to_batch("solver")
    assert batch.task_ids == ["t1", "t2"] and batch.created_at == 7.0 and batch.batch_id == plan.batch_id and batch.refs == plan.refs
    assert np.allclose(batch.advantage_array(), plan.advantages)
    assert plan.to_batch("solver").digest() == batch.digest()  # published again after a restart: the same manifest


def test_a_lane_accounts_for_every_task_through_plan_publication_and_training():
    lane = PolicyLane("solver", pipeline(server={"type": "replay", "ratio": 0.5, "base": {"type": "fifo"}}), primary=True)
    for i in range(3):
        lane.issue(f"t{i}", None)
    groups = [group_of(f"t{i}", [0.0, 1.0], seq0=10 * (i + 1), version=1) for i in range(3)]  # stream sequences start at 1
    for _h in groups:
        lane.ledger.receive(1)
    lane.keep(groups[0])
    lane.keep(groups[1])
    lane.settle("t2", Fate.filtered("zero_variance"))
    assert lane.accounting().adds_up and lane.ready(2) and not lane.ready(3)
    lane.advance(3)
    plan = lane.plan(groups[:2], ["t0", "t1"], created_at=1.0)
    acc = lane.accounting()
    assert plan.batch_id == "solver-b000001" and acc.awaiting == 2 and acc.buffered == 0 and acc.adds_up
    assert lane.is_closed("t0") and lane.find("t0") is groups[0] and lane.replay_positions("t1", 2) == [20, 21]
    assert lane.replay_positions("t1", 3) is None  # not the group the replay memory names
    assert lane.stats["lag_max"] == 2 and not lane.drained()
    restored = PolicyLane("solver", pipeline(server={"type": "replay", "ratio": 0.5, "base": {"type": "fifo"}}), primary=True)
    restored.load_state(lane.state())
    assert restored.state() == lane.state() and restored.planned() == [plan]
    lane.published(plan.batch_id)
    assert [lane.tasks.stage(t) for t in ("t0", "t1")] == [Stage.AWAITING] * 2
    assert lane.trained(plan.batch_id, 1) == ["t0", "t1"] and lane.trained(plan.batch_id, 1) == []  # counted once
    assert lane.drained() and lane.accounting().fates == {"filtered:zero_variance": 1, "trained": 2}
    assert lane.failed("solver-b000009") == [] and "failed:train" not in lane.ledger.fates


def test_a_group_in_one_message_is_remembered_for_replay_by_that_one_sequence():
    from astraflow.dataflow.groups import Recent

    recent = Recent(size=2)
    one, two, three = group_of("t1", [0.0, 1.0, 1.0], seq0=10), group_of("t2", [0.0, 1.0], seq0=20), group_of("t3", [1.0, 0.0], seq0=30)
    one.positions = [7, 7, 7]  # a node's TrajectoryGroup: every sample at the message's sequence
    for h in (one, two):
        recent.remember(h)
    assert recent.state() == {"t1": [7], "t2": [20, 21]}
    restored = Recent(size=2)
    restored.load_state(recent.state())
    assert restored.positions_of("t1", 3) == [7, 7, 7] and restored.positions_of("t2", 2) == [20, 21]
    assert restored.positions_of("t2", 3) is None
    restored.remember(three)
    assert restored.positions_of("t1", 3) is None and list(restored.state()) == ["t2", "t3"]  # the oldest forgotten


def test_the_audit_calls_a_task_lost_only_past_the_grace_and_once_its_trajectories_were_delivered():
    from astraflow.dataflow.audit import due, lost_groups, lost_tasks

    assert due({"t1": 0.0, "t2": 50.0, "t3": 10.0}, now=100.0, older_than=60.0) == ["t1", "t3"]  # oldest first
    gone: dict[str, tuple[float, int]] = {}
    out = {"t1", "t2", "t3"}
    assert lost_tasks(gone, out, {"t1": False, "t2": True}, now=0.0, grace=10.0, stored=500, delivered=400) == []
    assert gone == {"t1": (0.0, 500)}  # first seen gone while TRAJ held up to seq 500
    assert lost_tasks(gone, out, {}, now=20.0, grace=10.0, stored=600, delivered=499) == []  # 500 not delivered yet
    assert lost_tasks(gone, out, {"t3": False}, now=21.0, grace=10.0, stored=600, delivered=500) == ["t1"]
    assert gone == {"t3": (21.0, 600)}  # a lost task is forgotten
    assert lost_tasks(gone, {"t1"}, {}, now=99.0, grace=10.0, stored=600, delivered=900) == [] and gone == {}  # t3 came back
    missing: dict[str, tuple[float, int]] = {}
    assert lost_groups(missing, {"g1": False, "g2": True}, now=0.0, grace=10.0) == []
    assert lost_groups(missing, {"g1": True}, now=5.0, grace=10.0) == [] and missing == {}  # back in memory: forgotten
    assert lost_groups(missing, {"g1": False}, now=6.0, grace=10.0) == [] and lost_groups(missing, {"g1": False}, 17.0, 10.0) == ["g1"]


def test_a_lane_remembers_batched_groups_only_when_its_server_replays():
    """Every turn's commit writes the lane's state: positions no server will ask for are not kept (nor written)."""
    def lane_after_batching(server: dict[str, Any]) -> PolicyLane:
        lane = PolicyLane("solver", pipeline(server=server), primary=True)
        for i in range(3):
            lane.recent.remember(group_of(f"t{i}", [0.0, 1.0], seq0=10 * i))
        return lane

    assert lane_after_batching({"type": "fifo"}).state().recent == {}
    assert lane_after_batching({"type": "mix", "weights": {"a": 1.0}}).state().recent == {}
    replaying = lane_after_batching({"type": "replay", "ratio": 0.5, "base": {"type": "fifo"}})
    assert replaying.state().recent == {"t0": [0, 1], "t1": [10, 11], "t2": [20, 21]}
    assert replaying.replay_positions("t1", 2) == [10, 11]
    resumed = lane_after_batching({"type": "fifo"})  # a run that replayed, resumed without replay: nothing kept
    resumed.load_state(replaying.state())
    assert resumed.state().recent == {}


async def test_a_failed_task_is_settled_in_the_primary_lane_and_forgotten_partway_in_the_others():
    log: list[tuple[Any, ...]] = []
    journal = Journal(MemoryStore(log), DataflowState)
    solver, verifier = PolicyLane("solver", pipeline(), True, journal), PolicyLane("verifier", pipeline(), False, journal)
    in_flight = InFlight(solver.tasks, other_lanes=True)
    limits = Limits(group_size=2, policies={p: PolicyLimits(vocab=384, max_completion=8, max_generated=8, max_row=None)
                                            for p in ("solver", "verifier")})

    async def newest(policy: str) -> int:
        return 4

    ingest = TrajectoryIngest({"solver": solver, "verifier": verifier}, in_flight, journal, CFG, Counter(), limits, newest,
                              Objects().resolve)
    solver.issue("t1", None)
    in_flight.issued("t1", None, {"solver": 0, "verifier": 0})
    await ingest.take(MemoryDelivery(traj("t1", 0, 0.0, policy="verifier"), 1, log))
    await ingest.take(MemoryDelivery(traj("t1", 0, 0.0), 2, log))
    assert solver.tasks.stage("t1") is verifier.tasks.stage("t1") is Stage.ASSEMBLING
    ingest.abandon("t1")  # as the dataflow does when the plane reports the task failed
    solver.settle("t1", Fate.parse("failed:rollout"))
    assert solver.tasks.stage("t1") is Stage.SETTLED and verifier.tasks.stage("t1") is None  # no fate where no group completed
    await ingest.take(MemoryDelivery(traj("t1", 1, 1.0, policy="verifier"), 3, log))  # a late sample: a partial group again
    assert verifier.tasks.stage("t1") is Stage.ASSEMBLING and solver.accounting().adds_up and verifier.accounting().adds_up
    await journal.flush()
    assert log == [("fates", [("t1", "failed:rollout")]), ("state", 0), ("ack", 1), ("ack", 2)]  # the late one stays held
