"""The dataflow at its trust boundary, against a real nats-server: well-formed trajectories with bad
values, trajectories for tasks it never issued, explicit failures, batch plan records, and the
trainer's verdicts on batches. Each bad message reaches the DLQ with its reason, its task gets a
counted fate, the accounting adds up, and the service keeps serving and training."""

from __future__ import annotations

import math
from collections.abc import Callable

import msgpack
import numpy as np
import pytest
from factories import honest
from test_dataflow import Harness, recipe

from astraflow.streams.codec import decode, encode
from astraflow.streams.dataflow_state import DataflowState
from astraflow.streams.messages import (
    Batch,
    BatchRefusal,
    Refusal,
    Rejected,
    Suspect,
    Task,
    Trajectory,
    TrajectoryBundle,
    TrajectoryGroup,
)
from astraflow.streams.plane import Delivery
from astraflow.streams.state import AdmitRecord, BatchPlanRecord, FateRecord
from astraflow.streams.trajectories import TrainingBatch, offload, publish_trajectories
from astraflow.train.vetting import suspects_of

Make = Callable[[Task, str, int, int], Trajectory]  # (task, policy, index, version) -> what the node sends


def good(task: Task, policy: str, i: int, version: int, **over: object) -> Trajectory:
    fields: dict[str, object] = dict(
        traj_id=f"{task.task_id}.{policy}.{i}", task_id=task.task_id, prompt_id=task.prompt_id, policy=policy, index=i,
        group_size=task.group_size, **honest(task, float(i % 2)), logprobs=np.full(4, -0.5, np.float32),
        versions=np.full(4, version, np.int32), loss_mask=np.ones(4, np.uint8), reward=float(i % 2))
    fields.update(over)
    return Trajectory(**fields)  # type: ignore[arg-type]


async def serve(h: Harness, bad: Make | None = None, limit: int = 64, policies: tuple[str, ...] | None = None,
                bad_policy: str | None = None) -> list[Task]:
    """Serve the pool's tasks; the first trajectory of the first task comes from ``bad`` (for ``bad_policy``)."""
    got = await h.task_sub.pull(batch=limit, timeout=0.3)
    out = []
    for k, d in enumerate(got):
        t = d.msg
        for p in policies or h.recipe.policy_names:
            for i in range(t.group_size):
                make = bad if bad is not None and k == 0 and i == 0 and p == (bad_policy or h.recipe.primary) else good
                out.append((h.node.names.traj(p), make(t, p, i, h.versions[p]), None))
    await h.node.publish_many(out)
    for d in got:
        await d.ack()
    return [d.msg for d in got]


async def dead_letters(h: Harness, kind: str = "traj") -> list[Rejected]:
    return await h.node.history(h.node.names.dlq(kind), Rejected)


@pytest.fixture
async def harness(nats_server, run_id, request):
    h = await Harness(nats_server.url, run_id, request.param).start()
    yield h
    await h.close()


def with_recipe(**kw: object):
    policies = kw.pop("policies", ("solver",))
    return pytest.mark.parametrize("harness", [recipe(policies, **kw)], indirect=True)  # type: ignore[arg-type]


BAD: dict[str, Make] = {  # code -> a trajectory with one bad value, otherwise well formed
    "reward": lambda t, p, i, v: good(t, p, i, v, reward=math.nan),
    "logprob": lambda t, p, i, v: good(t, p, i, v, logprobs=np.array([-0.5, -math.inf, -0.5, -0.5], np.float32)),
    "token": lambda t, p, i, v: good(t, p, i, v, completion_ids=np.array([1, 2, 99999, 3])),
    "length": lambda t, p, i, v: good(t, p, i, v, completion_ids=np.arange(9), logprobs=np.full(9, -0.5, np.float32),
                                      versions=np.full(9, v, np.int32), loss_mask=np.ones(9, np.uint8)),
    "mask": lambda t, p, i, v: good(t, p, i, v, loss_mask=np.array([1, 3, 1, 1], np.uint8)),
    "version": lambda t, p, i, v: good(t, p, i, v, versions=np.full(4, v + 50, np.int32)),
    "group_size": lambda t, p, i, v: good(t, p, i, v, group_size=3),
    "traj_id": lambda t, p, i, v: good(t, p, i, v, traj_id="evil"),
    # claims a hostile node with a valid credential makes (``dataflow/claims.py``): well formed, and a lie
    "prompt_claim": lambda t, p, i, v: good(t, p, i, v, prompt_ids=honest(t.model_copy(update={"prompt": "9+9="}), 0.0)["prompt_ids"]),
    "reward_range": lambda t, p, i, v: good(t, p, i, v, reward=1e29),
    "reward_claim": lambda t, p, i, v: good(t, p, i, v, reward=1.0 - i % 2),  # a reward its completion does not earn
}


@pytest.mark.parametrize("code", BAD)
@with_recipe(max_staleness=1, max_tasks_in_flight=4)
async def test_a_bad_value_is_dead_lettered_its_task_is_invalid_and_the_run_goes_on(harness: Harness, code: str):
    h = harness
    await h.turn(2)
    tasks = await serve(h, BAD[code], limit=2)
    # the good task's group may be buffered after the bad one's fate is written: wait for both
    await h.until(lambda: h.acc().fates.get(f"invalid:{code}") == 1 and h.acc().buffered == 1)
    acc = h.acc()
    assert acc.adds_up and acc.buffered == 1 and acc.fates == {f"invalid:{code}": 1}
    (rej,) = await dead_letters(h)
    assert rej.reason.startswith(f"invalid {code}: ") and rej.subject == h.node.names.traj("solver")
    assert (await h.plane.state.get(FateRecord, "solver", tasks[0].task_id)).fate == f"invalid:{code}"
    assert h.df.stats[f"invalid.{code}"] == 1 and h.df.stats["claims.checked"] >= 1
    for _ in range(3):  # the service keeps going: new tasks, batches, training
        await h.turn(2)
        await serve(h)
        await h.turn(2)
        await h.train("solver")
    assert len(h.batches["solver"]) >= 2 and h.acc().adds_up
    assert tasks[0].task_id not in {t for b in h.batches["solver"] for t in b.task_ids}  # the invalid task was never trained


@with_recipe(max_staleness=1, max_tasks_in_flight=4)
async def test_a_redelivered_bad_trajectory_changes_nothing_after_a_restart(harness: Harness):
    h = harness
    await h.turn(2)
    await serve(h, BAD["reward"], limit=2)
    for _ in range(20):  # ingest only: its fate is queued, not yet written, nothing dead-lettered or acked
        await h.df.ingest.pull(h.sub, timeout=0.5)
        if h.df.stats["invalid.reward"]:
            break
    assert h.df.stats["invalid.reward"] == 1 and await dead_letters(h) == []
    await h.kill_dataflow()
    await h.open_dataflow()  # the NaN reward comes back: the restarted dataflow judges it the same, once
    await h.until(lambda: h.acc().fates.get("invalid:reward") == 1 and h.acc().buffered == 1)
    await h.turn(3)
    assert len(await dead_letters(h)) == 1 and h.acc().adds_up


async def serve_groups(h: Harness, bad: Make | None = None, limit: int = 64) -> list[Task]:
    """Serve the pool's tasks as a node does: each task's samples in one message (``TrajectoryGroup``); the first
    sample of the first task from ``bad``."""
    got = await h.task_sub.pull(batch=limit, timeout=0.3)
    seqs = []
    for k, d in enumerate(got):  # one message a task, as separate nodes (or settlements) send them
        seqs += await publish_trajectories(h.node, [(bad if bad is not None and k == 0 and i == 0 else good)(
            d.msg, "solver", i, h.versions["solver"]) for i in range(d.msg.group_size)])
    assert len(set(seqs)) == len(got)
    for d in got:
        await d.ack()
    return [d.msg for d in got]


async def traj_unacked(h: Harness) -> int:
    lag = await h.plane.stored.lag(h.plane.names.traj_stream, h.plane.names.DATAFLOW_CONSUMER)
    return lag.pending + lag.ack_pending


def held_tasks(h: Harness) -> set[str]:
    return {traj_id.rsplit(".", 2)[0] for traj_id in h.df.journal.held}


def held_messages(h: Harness) -> int:
    return len(held_tasks(h))


@with_recipe(max_staleness=1, max_tasks_in_flight=4)
async def test_a_bad_trajectory_in_a_group_is_dead_lettered_alone_and_its_group_message_acked(harness: Harness):
    h = harness
    await h.turn(2)
    tasks = await serve_groups(h, BAD["reward"], limit=2)
    await h.until(lambda: h.acc().fates.get("invalid:reward") == 1 and h.acc().buffered == 1)
    await h.turn(2)
    (rej,) = await dead_letters(h)
    alone = decode(rej.payload, Trajectory)  # the bad sample, encoded alone: not its group
    assert alone.traj_id == f"{tasks[0].task_id}.solver.0" and math.isnan(alone.reward) and rej.reason.startswith("invalid reward: ")
    for _ in range(3):  # the run goes on: groups batched from their messages, read back by the trainer, trained
        await h.turn(2)
        await serve_groups(h)
        await h.turn(2)
        await h.train("solver")
    assert len(h.batches["solver"]) >= 2 and h.acc().adds_up and h.df.stats["invalid.reward"] == 1
    assert tasks[0].task_id not in {t for b in h.batches["solver"] for t in b.task_ids}
    for _ in range(20):  # a group's message is acked once its trajectories are settled (the half-bad one too): unacked
        await h.turn()   # are those of groups still held (buffered), one message each
        if await traj_unacked(h) == held_messages(h):
            break
    assert await traj_unacked(h) == held_messages(h) and tasks[0].task_id not in held_tasks(h)


@with_recipe(max_staleness=1, max_tasks_in_flight=4)
async def test_a_bundle_is_taken_group_by_group_and_its_bad_group_refused_alone(harness: Harness):
    """The tasks a node finished together come in one message (``TrajectoryBundle``): a bad sample in it is
    dead-lettered alone, a group larger than its task is refused whole (one entry), the other tasks are buffered,
    batched and trained from the bundle, and the message is acked once every part of it is settled."""
    h = harness
    await h.turn(2)
    got = await h.task_sub.pull(batch=3, timeout=0.3)
    assert len(got) == 3
    (a, b, c) = (d.msg for d in got)
    trajs = [BAD["reward"](a, "solver", 0, 0), *(good(a, "solver", i, 0) for i in range(1, a.group_size)),
             *(good(b, "solver", i, 0) for i in range(2 * b.group_size)),  # twice its task's samples
             *(good(c, "solver", i, 0) for i in range(c.group_size))]
    seqs = await publish_trajectories(h.node, trajs)
    assert len(set(seqs)) == 1  # one message for the three tasks
    for d in got:
        await d.ack()
    await h.until(lambda: h.acc().fates.get("invalid:reward") == 1 and h.acc().fates.get("invalid:group_size") == 1
                  and h.acc().buffered == 1)
    rejected = {r.code: r for r in await dead_letters(h)}
    assert set(rejected) == {"reward", "group_size"}
    assert decode(rejected["reward"].payload, Trajectory).traj_id == f"{a.task_id}.solver.0"
    whole = decode(rejected["group_size"].payload, TrajectoryGroup)  # the oversize group, one entry
    assert whole.task_id == b.task_id and len(whole.trajectories) == 2 * b.group_size
    for _ in range(3):  # the run goes on: the bundled task batched, read back by the trainer from the bundle, trained
        await h.turn(2)
        await serve(h)
        await h.turn(2)
        await h.train("solver")
    assert c.task_id in {t for batch in h.batches["solver"] for t in batch.task_ids}
    assert h.acc().adds_up and h.acc().fates.get("trained", 0) >= 2
    for _ in range(20):  # the bundle's message is acked (the first on the stream: the ack floor passes it)
        info = await h.plane.stored._jsm.consumer_info(h.plane.names.traj_stream, h.plane.names.DATAFLOW_CONSUMER)
        if info.ack_floor.stream_seq >= seqs[0]:
            break
        await h.turn()
    assert info.ack_floor.stream_seq >= seqs[0]


@with_recipe(max_staleness=1, max_tasks_in_flight=4)
async def test_a_group_redelivered_after_a_restart_is_judged_once(harness: Harness):
    h = harness
    await h.turn(2)
    await serve_groups(h, BAD["reward"], limit=2)
    for _ in range(20):  # ingest only: the fate queued, nothing written, dead-lettered or acked
        await h.df.ingest.pull(h.sub, timeout=0.5)
        if h.df.stats["invalid.reward"]:
            break
    assert h.df.stats["invalid.reward"] == 1 and await dead_letters(h) == []
    await h.kill_dataflow()
    await h.open_dataflow()  # both group messages come back whole: judged the same, once
    await h.until(lambda: h.acc().fates.get("invalid:reward") == 1 and h.acc().buffered == 1)
    await h.turn(3)
    assert len(await dead_letters(h)) == 1 and h.acc().adds_up
    assert h.df.lanes["solver"].ledger.samples == 2  # the good group's samples, counted once (the first count died unwritten)


async def a_task_and_its_group(h: Harness, times: int = 1) -> tuple[Delivery[Task], TrajectoryGroup]:
    """One task issued to the pool (its delivery, not acked yet) and a group of ``times`` x its group size valid
    samples for it, as one message."""
    await h.turn(2)
    (d,) = await h.task_sub.pull(batch=1, timeout=2.0)
    t = d.msg
    samples = [good(t, "solver", i, 0) for i in range(times * t.group_size)]
    return d, TrajectoryGroup(task_id=t.task_id, policy="solver", trajectories=samples)


@with_recipe(max_staleness=1, max_tasks_in_flight=4)
async def test_an_undecodable_group_settles_its_task_invalid(harness: Harness):
    h = harness
    d, group = await a_task_and_its_group(h)
    fields = msgpack.unpackb(encode(group)[1:], raw=False)["d"]
    fields["trajectories"][1]["logprobs"] = fields["trajectories"][1]["logprobs"][:4]  # arrays that do not align
    wire = b"\x01" + msgpack.packb({"k": "trajectory_group", "d": fields}, use_bin_type=True)
    await h.node._js.publish(h.node.names.traj("solver"), wire)
    await d.ack()
    await h.until(lambda: h.acc().fates.get("invalid:schema") == 1)
    (rej,) = await dead_letters(h)
    assert "invalid trajectory_group" in rej.reason and h.acc().adds_up


@with_recipe(max_staleness=1, max_tasks_in_flight=4)
async def test_an_undecodable_bundle_settles_each_of_its_tasks_invalid(harness: Harness):
    h = harness
    await h.turn(2)
    got = await h.task_sub.pull(batch=2, timeout=0.3)
    assert len(got) == 2
    bundle = TrajectoryBundle(policy="solver", groups=[
        TrajectoryGroup(task_id=d.msg.task_id, policy="solver", trajectories=[good(d.msg, "solver", i, 0) for i in range(d.msg.group_size)])
        for d in got])
    fields = msgpack.unpackb(encode(bundle)[1:], raw=False)["d"]
    fields["groups"][1]["trajectories"][0]["logprobs"] = fields["groups"][1]["trajectories"][0]["logprobs"][:4]  # do not align
    wire = b"\x01" + msgpack.packb({"k": "trajectory_bundle", "d": fields}, use_bin_type=True)
    await h.node._js.publish(h.node.names.traj("solver"), wire)
    for d in got:
        await d.ack()
    await h.until(lambda: h.acc().fates.get("invalid:schema") == 2)  # the whole message is unreadable: both its tasks
    (rej,) = await dead_letters(h)
    assert "invalid trajectory_bundle" in rej.reason and h.acc().adds_up


@with_recipe(max_staleness=1, max_tasks_in_flight=4)
async def test_a_group_larger_than_a_task_is_dead_lettered_whole_once(harness: Harness):
    h = harness
    d, group = await a_task_and_its_group(h, times=3)  # well-formed, distinct ids: only the count says it is no task's group
    await publish_trajectories(h.node, list(group.trajectories))
    await d.ack()
    await h.until(lambda: h.acc().fates.get("invalid:group_size") == 1)
    await h.turn(2)
    (rej,) = await dead_letters(h)  # one entry for the whole message, not one per trajectory
    assert decode(rej.payload, TrajectoryGroup) == group and rej.reason.startswith("invalid group_size: ")
    assert h.df.stats["invalid.group_size"] == 1 and h.df.lanes["solver"].ledger.samples == 0 and h.acc().adds_up
    assert await traj_unacked(h) == 0


@with_recipe(max_staleness=1, max_tasks_in_flight=4)
async def test_trajectories_of_tasks_never_issued_are_turned_away_without_a_fate(harness: Harness):
    h = harness
    await h.turn(2)
    forged = Task(task_id="t00000999", workflow="single_turn", policy="solver", prompt_id="p", prompt="1+1=", group_size=2)
    foreign = Task(task_id="x7", workflow="single_turn", policy="solver", prompt_id="p", prompt="1+1=", group_size=2)
    await h.node.publish_many([(h.node.names.traj("solver"), good(t, "solver", i, 0), None) for t in (forged, foreign) for i in range(2)])
    await h.until(lambda: h.df.stats["invalid.task"] == 4)
    await h.turn()
    rejected = await dead_letters(h)
    assert len(rejected) == 4 and all(r.reason.startswith("invalid task: ") for r in rejected)
    acc = h.acc()
    assert acc.adds_up and acc.fates == {} and acc.in_flight == 4  # the real tasks are untouched


@with_recipe(max_staleness=1, max_tasks_in_flight=4)
async def test_an_explicitly_failed_sample_settles_its_group_without_reaching_the_advantage(harness: Harness):
    h = harness
    await h.turn(2)
    await serve(h, lambda t, p, i, v: good(t, p, i, v, reward=None, finish_reason="error"), limit=1)
    await h.until(lambda: h.acc().fates.get("filtered:sample_error") == 1)
    assert h.acc().adds_up and await dead_letters(h) == []  # a valid message: no dead letter


@with_recipe(max_staleness=1, max_tasks_in_flight=4)
async def test_tokens_older_than_the_task_allowed_are_invalid(harness: Harness):
    h = harness
    await h.announce("solver", 3, [])
    await h.heard("solver", 3)  # before the first turn: a turn before it would issue the tasks with floor 0
    await h.until(lambda: h.df.lanes["solver"].version == 3)
    await h.turn(2)  # tasks issued now carry min_versions solver >= 2
    await serve(h, lambda t, p, i, v: good(t, p, i, v, versions=np.full(4, 1, np.int32)), limit=2)
    await h.until(lambda: h.acc().fates.get("invalid:version") == 1)
    (rej,) = await dead_letters(h)
    assert "the task allows v2 or newer" in rej.reason and h.acc().adds_up


@with_recipe(policies=("solver", "verifier"), max_staleness=1, max_tasks_in_flight=4)
async def test_an_invalid_partner_trajectory_settles_only_its_own_lane(harness: Harness):
    h = harness
    await h.turn(2)
    await serve(h, BAD["reward"], limit=2, bad_policy="verifier")
    await h.until(lambda: h.acc("verifier").fates.get("invalid:reward") == 1 and h.acc().buffered + h.acc().awaiting == 2)
    assert h.acc().adds_up and h.acc("verifier").adds_up and h.acc("verifier").buffered == 1 and h.acc().fates == {}


@with_recipe(max_staleness=1, max_tasks_in_flight=4)
async def test_every_batch_has_a_plan_record_until_its_fate_is_known(harness: Harness):
    h = harness
    await h.turn(2)
    await serve(h, limit=2)  # two groups: one batch
    await h.until(lambda: h.df.lanes["solver"].batch_seq == 1)
    (d,) = await h.batch_subs["solver"].pull(batch=1, timeout=1)
    plan = await h.plane.state.get(BatchPlanRecord, "solver", d.msg.batch_id)
    assert plan is not None and plan.digest == d.msg.digest() and plan.trajectories == 4
    h.versions["solver"] += 1
    await h.announce("solver", 1, [d.msg.batch_id])
    await d.ack()
    await h.until(lambda: h.acc().fates.get("trained") == 2)
    await h.turn()
    assert await h.plane.state.get(BatchPlanRecord, "solver", d.msg.batch_id) is None  # the bucket stays bounded


@pytest.mark.parametrize("verdict,fate", [(Refusal(BatchRefusal.STALE, "oldest token v0, trainer at v9"), "dropped:stale"),
                                          (Refusal(BatchRefusal.NON_FINITE, "loss nan, gradient norm nan"), "failed:train"),
                                          (Refusal(BatchRefusal.MISSING, "1 sequence(s) of AF_x_TRAJ are gone: 7"), "failed:train"),
                                          (Refusal(BatchRefusal.MISMATCH, "sequence 7 holds t1.solver.1"), "failed:train"),
                                          (Refusal(BatchRefusal.FORGED, "another content"), None),
                                          ("stale: in words only, no code", "failed:train")],  # the code decides, not the text
                         ids=lambda v: v.code.value if isinstance(v, Refusal) else str(v)[:16])
@with_recipe(max_staleness=1, max_tasks_in_flight=4)
async def test_a_trainer_verdict_on_a_batch_becomes_its_tasks_fate(harness: Harness, verdict: Refusal | str, fate: str | None):
    h = harness
    await h.turn(2)
    await serve(h, limit=2)  # two groups: one batch
    await h.until(lambda: h.df.lanes["solver"].batch_seq == 1)
    (d,) = await h.batch_subs["solver"].pull(batch=1, timeout=1)
    batch: Batch = d.msg
    await (d.refuse(verdict) if isinstance(verdict, Refusal) else d.reject(verdict))  # as the trainer does
    if fate is None:  # a forged copy under a planned id: the planned batch is still to come
        await h.until(lambda: h.df.stats["forged_batches"] == 1)
        assert h.acc().awaiting == 2 and h.acc().adds_up
        assert await h.plane.state.get(BatchPlanRecord, "solver", batch.batch_id) is not None
        return
    await h.until(lambda: h.acc().fates.get(fate) == 2)
    await h.turn()
    assert h.acc().adds_up and await h.plane.state.get(BatchPlanRecord, "solver", batch.batch_id) is None
    record = await h.plane.state.get(FateRecord, "solver", batch.task_ids[0])
    said = verdict.reason if isinstance(verdict, Refusal) else verdict
    assert record.fate == fate and record.batch == batch.batch_id and record.error == said


@with_recipe(max_staleness=1, max_tasks_in_flight=4)
async def test_trajectories_by_reference_are_read_back_checked_batched_and_fetched_whole(harness: Harness):
    h = harness
    await h.turn(2)
    got = await h.task_sub.pull(batch=2, timeout=0.3)
    whole = [good(d.msg, "solver", i, 0) for d in got for i in range(d.msg.group_size)]
    store = h.node.trajectory_objects()
    by_ref = [await offload(store, t) for t in whole[:3]]  # as a node sends what exceeds max_payload
    await store.delete(by_ref[2].payload_ref)  # the second task's first sample names arrays that are gone
    await h.node.publish_many([(h.node.names.traj("solver"), t, t.traj_id) for t in [*by_ref, whole[3]]])
    for d in got:
        await d.ack()
    await h.until(lambda: h.acc().fates.get("invalid:payload") == 1 and h.acc().buffered == 1)
    (rej,) = await dead_letters(h)
    assert rej.reason.startswith(f"invalid payload: {whole[2].traj_id}: its arrays") and h.acc().adds_up
    await h.turn(2)
    await serve(h, limit=1)
    await h.until(lambda: h.df.lanes["solver"].batch_seq == 1)
    (batch,) = await h.train("solver")  # the manifest names the stubs; the trainer gets them whole
    assert batch.trajectories[:2] == whole[:2] and all(not t.offloaded for t in batch.trajectories)
    assert [r.traj_id for r in batch.manifest.refs[:2]] == [t.traj_id for t in whole[:2]]


def kept(h: Harness) -> int:
    """Groups taken for training: buffered, in a batch, or trained."""
    acc = h.acc()
    return acc.buffered + acc.awaiting + acc.fates.get("trained", 0)


async def serve_as(h: Harness, node: str, make: Make, tasks: int) -> list[Task]:
    """``node`` (its own subject, as its credential allows) answers ``tasks`` of the pool's tasks, every sample with ``make``."""
    got = await h.task_sub.pull(batch=tasks, timeout=0.5)
    await h.node.publish_many([(h.node.names.traj("solver", node), make(d.msg, "solver", i, h.versions["solver"]), None)
                               for d in got for i in range(d.msg.group_size)])
    for d in got:
        await d.ack()
    return [d.msg for d in got]


@with_recipe(max_staleness=3, max_tasks_in_flight=8, groups_per_batch=1)
async def test_a_node_that_keeps_lying_is_quarantined_until_an_operator_admits_it(harness: Harness):
    h = harness
    after = h.recipe.dataflow.quarantine_after
    await h.turn(2)
    lies = await serve_as(h, "liar", BAD["reward_claim"], after)  # one failed task each, however many bad samples
    assert len(lies) == after
    await h.until(lambda: h.acc().fates.get("invalid:reward_claim") == after)
    (q,) = h.df.reputation.quarantined.values()
    assert q.node == "liar" and q.failures == {"reward_claim": after} and q.reason.startswith("invalid reward_claim")
    await h.turn(2)
    (told_truth,) = await serve_as(h, "liar", good, 1)  # once quarantined, even the truth is refused
    await h.until(lambda: h.acc().fates.get("invalid:quarantined") == 1)
    assert (await h.plane.state.get(FateRecord, "solver", told_truth.task_id)).fate == "invalid:quarantined"
    saved = await h.plane.state.get(DataflowState)  # where the launcher and `astraflow status` read it
    assert saved is not None and set(saved.quarantined) == {"liar"}
    await h.turn(2)
    honest_tasks = await serve_as(h, "honest", good, 2)  # the other nodes go on
    await h.until(lambda: kept(h) >= 2)
    assert h.df.reputation.failures("honest") == 0 and not h.df.reputation.refuses("honest") and honest_tasks

    await h.kill_dataflow()  # the quarantine survives a restart
    await h.open_dataflow()
    assert h.df.reputation.refuses("liar")
    at = h.df.reputation.quarantined["liar"].at
    await h.plane.state.put(AdmitRecord(node="liar", quarantined_at=at - 60))  # the admission of an earlier quarantine
    h.df._audited = 0.0
    await h.df.audit()
    assert h.df.reputation.refuses("liar")
    # `astraflow node admit liar` names the quarantine it lifts: written on a clock an hour behind, it still lifts it
    await h.plane.state.put(AdmitRecord(node="liar", quarantined_at=at, ts=at - 3600))
    h.df._audited = 0.0
    await h.df.audit()
    assert not h.df.reputation.quarantined and h.df.stats["readmitted"] == 1
    await h.turn(2)
    await serve_as(h, "liar", good, 1)
    await h.until(lambda: kept(h) >= 3)
    assert h.acc().fates.get("invalid:quarantined") == 1 and h.acc().adds_up


@with_recipe(max_staleness=1, max_tasks_in_flight=4)
async def test_a_flood_is_cut_off_after_the_threshold_and_costs_no_more_checks(harness: Harness):
    """A node floods the plane with answers to tasks that were never issued: quarantined at its third, and the rest of
    the flood is refused as quarantined before its claims are scored again."""
    h = harness
    await h.turn(2)
    (task,) = (await h.task_sub.pull(batch=1, timeout=0.5))[:1]
    flood = [good(task.msg.model_copy(update={"task_id": f"t9{k:07d}"}), "solver", 0, 0) for k in range(200)]
    after = h.recipe.dataflow.quarantine_after
    await h.node.publish_many([(h.node.names.traj("solver", "flood"), t, None) for t in flood[:after]])
    await h.until(lambda: h.df.reputation.refuses("flood"))
    await h.node.publish_many([(h.node.names.traj("solver", "flood"), t, None) for t in flood[after:]])
    await task.ack()
    await h.until(lambda: h.df.stats["invalid.task"] + h.df.stats["invalid.quarantined"] >= len(flood))
    assert h.df.stats["invalid.task"] == after and h.df.stats["invalid.quarantined"] == len(flood) - after
    assert h.df.reputation.quarantined["flood"].failures == {"task": after}
    assert h.df.stats["claims.checked"] == after  # the flood past the threshold is not scored again
    assert h.acc().adds_up and not h.acc().fates  # nothing it sent settled a task of the run


@with_recipe(max_staleness=3, max_tasks_in_flight=4)
async def test_a_task_answered_by_a_second_node_too_keeps_the_first_answer_and_blames_no_one(harness: Harness):
    """A task goes to a second node when the first one's ack is lost (a server restart) or its ack wait runs out: both
    answer it with the same trajectory ids. The second copy is acked and ignored, counted against neither node (three
    such counted as failures quarantined every honest node of a pool after a server restart)."""
    h = harness
    await h.turn(2)
    (d,) = await h.task_sub.pull(batch=1, timeout=0.5)
    first, second = (good(d.msg, "solver", i, 0) for i in range(2))
    await h.node.publish_many([(h.node.names.traj("solver", "first"), first, None)])  # held: its group is not complete
    await h.until(lambda: h.df.journal.is_held(first.traj_id))
    for _ in range(4):  # past dataflow.quarantine_after, were it counted
        await h.node.publish_many([(h.node.names.traj("solver", "second"), first, None)])  # the same sample, another node
    await h.until(lambda: h.df.stats["redelivered_elsewhere"] == 4)
    assert h.df.reputation.failures("second") == 0 and h.df.reputation.failures("first") == 0
    assert not h.df.reputation.refuses("second") and h.df.journal.held[first.traj_id].subject == h.node.names.traj("solver", "first")
    await h.node.publish_many([(h.node.names.traj("solver", "first"), second, None)])
    await d.ack()
    await h.until(lambda: kept(h) == 1)  # the group completes as if nothing happened
    assert h.acc().adds_up and not any(f.startswith("invalid:") for f in h.acc().fates)
    assert not await dead_letters(h)


@with_recipe(max_staleness=3, max_tasks_in_flight=8, groups_per_batch=1)
async def test_trajectories_the_trainers_token_check_left_out_count_against_the_node_that_sent_them(harness: Harness):
    """Tokens that pass every check of the dataflow, with logprobs the trainer's recomputation contradicts: the trainer
    names them in its announcement (``WeightVersion.suspects``) with the node their TRAJ subject names, each task counts
    once against that node, and ``quarantine_after`` tasks quarantine it. A dataflow restarted after the operator let
    the node back in reads those announcements again and does not count them again."""
    h = harness
    after = h.recipe.dataflow.quarantine_after
    trained: list[TrainingBatch] = []

    def left_out(b: TrainingBatch) -> list[Suspect]:  # the even samples' logprobs, as the token check would find them
        return suspects_of(b, {i: 5.5 for i, t in enumerate(b.trajectories) if t.index % 2 == 0})

    for node in ["honest", *["faker"] * after]:  # one group, one batch each
        await h.turn(2)
        assert await serve_as(h, node, good, 1)
        await h.until(lambda: h.df.lanes["solver"].batch_seq > len(trained))
        trained += await h.train("solver", suspects=left_out if node == "faker" else None)
    senders = {tuple(b.senders or ()) for b in trained}
    assert ("honest",) * 2 in senders and ("faker",) * 2 in senders  # the subject's node, as the server stored it
    await h.until(lambda: "faker" in h.df.reputation.quarantined)
    q = h.df.reputation.quarantined["faker"]
    assert q.failures == {"logprobs": after} and "left out" in q.reason and "nats per token" in q.reason
    assert h.df.reputation.failures("honest") == 0 and not h.df.reputation.refuses("honest")
    await h.turn(2)
    await h.plane.state.put(AdmitRecord(node="faker"))  # `astraflow node admit faker`
    h.df._audited = 0.0
    await h.df.audit()
    assert not h.df.reputation.quarantined
    await h.turn(2)  # the admission written
    await h.kill_dataflow()
    await h.open_dataflow()  # follows every announcement again, from the start of the stream
    await h.turn(3)
    assert h.df.watch.newest["solver"].version == len(trained) and not h.df.reputation.quarantined
    assert h.df.reputation.failures("faker") == 0
