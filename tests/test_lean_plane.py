"""The lean paths of the plane against a real nats-server: pulls that wake once per burst (``streams/pull.py``), a
node's group settlement of finished tasks (``rollout/outbox.py``) and the messages that carry their samples."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
from factories import a_task, a_trajectory
from nats.aio.msg import Msg

from astraflow.dataflow.parts import GroupParts, by_group, taken
from astraflow.rollout.outbox import Outbox
from astraflow.streams import pull
from astraflow.streams.codec import decode
from astraflow.streams.messages import Rejected, Task, Trajectory, TrajectoryBundle, TrajectoryGroup
from astraflow.streams.plane import Plane
from astraflow.streams.trajectories import carried, decode_traj, publish_trajectories
from astraflow.streams.trajectory_log import READ_WINDOW, TrajectoryLog


def task(i: int) -> Task:
    return a_task(f"t{i:04d}", workflow="math", prompt_id=f"p{i}", prompt="1+1", answer=None)


def trajectory(t: Task, i: int) -> Trajectory:
    return a_trajectory(t.task_id, i, traj_id=f"{t.task_id}.{i}", prompt_id=t.prompt_id, group_size=t.group_size, n=6,
                        prompt_ids=np.arange(3), completion_ids=np.arange(6), reward=float(i))


async def publish_tasks(plane: Plane, n: int, start: int = 0) -> None:
    await plane.publish_many([(plane.names.task("math"), task(i), task(i).task_id) for i in range(start, start + n)])


async def test_every_message_is_handed_out_once_across_pulls(plane: Plane):
    await publish_tasks(plane, 300)
    tasks = plane.consumer(plane.names.task_stream, plane.names.pool_consumer("raas"), Task)
    seen: list[str] = []
    while len(seen) < 300:
        got = await tasks.pull(batch=64, timeout=5.0)
        assert got, "a pull came back empty while messages were pending"
        assert len(got) <= 64
        seen += [d.msg.task_id for d in got]
        for d in got:
            await d.ack()
    assert sorted(seen) == [task(i).task_id for i in range(300)]
    assert await tasks.pull(batch=64, timeout=0.3) == []
    await settled(plane)


async def settled(plane: Plane) -> None:
    """Wait (up to 10 s) until the server has processed every ack of the task consumer."""
    deadline = time.monotonic() + 10.0
    while (lag := await plane.stored.lag(plane.names.task_stream, plane.names.pool_consumer("raas"))).ack_pending or lag.pending:
        assert time.monotonic() < deadline, f"tasks still unsettled: {lag}"
        await asyncio.sleep(0.05)


async def test_a_waiting_pull_returns_with_the_first_arrivals_not_at_its_timeout(plane: Plane):
    tasks = plane.consumer(plane.names.task_stream, plane.names.pool_consumer("raas"), Task)
    waiting = asyncio.ensure_future(tasks.pull(batch=64, timeout=60.0))
    await asyncio.sleep(0.2)  # let the pull find nothing and wait
    t0 = time.monotonic()
    await publish_tasks(plane, 3)
    got = await asyncio.wait_for(waiting, 30.0)
    assert 1 <= len(got) <= 3 and time.monotonic() - t0 < 30.0  # nats-py's fetch would wait for 64 or the full 60 s
    rest = await tasks.pull(batch=64, timeout=5.0) if len(got) < 3 else []
    assert sorted(d.msg.task_id for d in got + rest) == ["t0000", "t0001", "t0002"]


async def test_the_trajectory_reader_keeps_one_request_standing_and_hands_out_everything_once(plane: Plane):
    """The dataflow's reader asks once for a window and is handed messages between its pulls: ``pull.STANDING_S``
    bounds how often it asks, not the number of pulls; every message is handed out once, in order, by the pulls."""
    asked: list[bytes] = []

    async def ask(msg: Msg) -> None:
        asked.append(msg.data)

    sub = await plane._nc.subscribe(f"{plane.api_prefix}.CONSUMER.MSG.NEXT.{plane.names.traj_stream}.{plane.names.DATAFLOW_CONSUMER}",
                                    cb=ask)
    reader = TrajectoryLog(plane).reader()
    assert await reader.pull(batch=16, timeout=0.2) == []
    t0, pulls, seen = time.monotonic(), 0, []
    for burst in range(30):
        for k in range(10):  # a message per task, as ten nodes would send them
            await publish_trajectories(plane, [trajectory(task(burst * 10 + k), i) for i in range(2)])
        while len(seen) < 10 * (burst + 1):
            got = await reader.pull(batch=4, timeout=5.0)
            pulls += 1
            assert got and len(got) <= 4
            seen += [d.msg.task_id for d in got]
            for d in got:
                await d.ack()
    assert seen == [task(i).task_id for i in range(300)]
    await until_lag(plane, (0, 0))
    await sub.drain()  # every request the server saw is counted before the count is read, and the module's plane forgets it
    assert pulls >= 75 and len(asked) <= 4 + (time.monotonic() - t0) / pull.STANDING_S, (pulls, len(asked))
    assert {json.loads(a)["batch"] for a in asked} == {READ_WINDOW}


async def test_tasks_that_finish_together_are_settled_together(plane: Plane):
    await publish_tasks(plane, 12)
    tasks = plane.consumer(plane.names.task_stream, plane.names.pool_consumer("raas"), Task)
    got = await tasks.pull(batch=12, timeout=5.0)
    while len(got) < 12:
        got += await tasks.pull(batch=12 - len(got), timeout=5.0)
    outbox = Outbox(plane)
    await asyncio.gather(*(outbox.settle(d, [trajectory(d.msg, i) for i in range(2)]) for d in got))
    assert outbox.settlements == 1  # one publish of 12 groups of 2, one wait, then 12 acks
    await settled(plane)  # every task acked
    assert await plane.stored.stream_msgs(plane.names.traj_stream) == 1  # the 12 groups in one message
    trajs = TrajectoryLog(plane).reader()
    (stored,) = await trajs.pull(batch=24, timeout=5.0)
    assert isinstance(stored.msg, TrajectoryBundle) and [g.task_id for g in stored.msg.groups] == [d.msg.task_id for d in got]
    assert sorted(t.traj_id for t in carried(stored.msg)) == sorted(f"{d.msg.task_id}.{i}" for d in got for i in range(2))
    await stored.ack()


async def test_a_task_whose_samples_cannot_be_stored_fails_alone_in_its_settlement(plane: Plane):
    """A settlement's joint publication fails (one task's samples are too large for a message, and the bucket they would
    go by reference to is gone): each task's are published again on their own, so the others are stored and acked and
    only that task's caller gets the error."""
    await publish_tasks(plane, 3)
    tasks = plane.consumer(plane.names.task_stream, plane.names.pool_consumer("raas"), Task)
    got = await tasks.pull(batch=3, timeout=5.0)
    while len(got) < 3:
        got += await tasks.pull(batch=3 - len(got), timeout=5.0)
    n = int(1.2 * plane.max_payload) // 4  # random int32 prompts: too large for a message even alone
    big = [Trajectory(**{**trajectory(got[2].msg, i).model_dump(), "prompt_ids": np.random.default_rng(i).integers(0, 1 << 30, n)})
           for i in range(2)]
    await plane._jsm.delete_stream(f"OBJ_{plane.names.traj_object_bucket}")
    outbox = Outbox(plane)
    results = await asyncio.gather(*(outbox.settle(d, [trajectory(d.msg, i) for i in range(2)]) for d in got[:2]),
                                   outbox.settle(got[2], big), return_exceptions=True)
    assert results[:2] == [None, None] and isinstance(results[2], Exception) and outbox.settlements == 1
    stored = carried_by_stream(await TrajectoryLog(plane).reader().pull(batch=8, timeout=5.0))
    assert stored >= {f"{d.msg.task_id}.{i}" for d in got[:2] for i in range(2)}
    assert not any(t.startswith(got[2].msg.task_id) for t in stored)
    await got[2].ack()  # the caller's to settle (nak or dead-letter); acked here so the consumer drains
    await settled(plane)


def carried_by_stream(deliveries: list) -> set[str]:
    return {t.traj_id for d in deliveries for t in carried(d.msg)}


async def test_groups_too_large_for_one_bundle_go_in_as_few_messages_as_fit(plane: Plane):
    n = int(0.2 * plane.max_payload) // 4  # prompts of random int32 (no compression): two groups fit, three do not
    big = [Trajectory(**{**trajectory(task(k), i).model_dump(), "prompt_ids": np.random.default_rng(k).integers(0, 1 << 30, n)})
           for k in range(5) for i in range(2)]
    seqs = await publish_trajectories(plane, big)
    assert seqs[0] == seqs[3] != seqs[4] != seqs[6] == seqs[9] and len(set(seqs)) == 3  # halves of halves: 2 + 1 + 2 tasks
    raw = await plane.stored.read_many(plane.names.traj_stream, sorted(set(seqs)))
    two, one, three = (decode_traj(data) for _, data in sorted(raw.items()))
    assert isinstance(two, TrajectoryBundle) and [g.task_id for g in two.groups] == [task(0).task_id, task(1).task_id]
    assert isinstance(one, TrajectoryGroup) and one.task_id == task(2).task_id
    assert isinstance(three, TrajectoryBundle) and [g.task_id for g in three.groups] == [task(3).task_id, task(4).task_id]


async def test_a_gpu_sized_settlement_goes_in_bundles_of_at_most_a_groups_trajectories(plane: Plane):
    """300 tasks of 16 samples finished together (4,800 trajectories, small): halves of 2,400, each under the 4,096
    a bundle may carry."""
    tasks = [a_task(f"g{k:03d}", workflow="math", prompt_id=f"p{k}", prompt="1+1", answer=None, group_size=16) for k in range(300)]
    seqs = await publish_trajectories(plane, [trajectory(t, i) for t in tasks for i in range(16)])
    assert len(set(seqs)) == 2 and seqs[0] == seqs[150 * 16 - 1] != seqs[150 * 16]
    raw = await plane.stored.read_many(plane.names.traj_stream, sorted(set(seqs)))
    assert [len(decode_traj(data).groups) for _, data in sorted(raw.items())] == [150, 150]


async def test_a_bundles_group_is_refused_whole_and_the_others_are_taken(plane: Plane):
    """A group of a bundle refused (one larger than a task's) goes to the DLQ as one group entry; the bundle's message
    is acked once its other groups' trajectories are settled too."""
    await publish_trajectories(plane, [trajectory(task(k), i) for k in range(3) for i in range(2)])
    (d,) = await TrajectoryLog(plane).reader().pull(batch=4, timeout=5.0)
    (g0, _, p0), (g1, r1, p1), (g2, _, p2) = by_group(d)
    assert [g.task_id for g in (g0, g1, g2)] == [task(k).task_id for k in range(3)] and all(len(p) == 2 for p in (p0, p1, p2))
    assert isinstance(r1, GroupParts) and [p.msg for p in p1] == g1.trajectories
    await r1.reject("invalid group_size: a test", "group_size")
    for p in p0 + p2[:1]:
        await p.ack()
    assert await settled_lag(plane) == (0, 1)  # a part still open: the message stays unacked
    await p2[1].ack()
    await until_lag(plane, (0, 0))
    (rej,) = await plane.history(plane.names.dlq("traj"), Rejected, stream=plane.names.dlq_stream)
    assert decode(rej.payload, TrajectoryGroup) == g1 and rej.code == "group_size"


async def test_a_group_goes_as_one_message_when_it_fits_and_alone_otherwise(plane: Plane):
    small = [trajectory(task(0), i) for i in range(3)]
    seqs = await publish_trajectories(plane, [small[2], small[0], small[1]])
    assert len(set(seqs)) == 1  # one message for the task's three samples, whatever their order
    (stored,) = await plane.stored.get_many(plane.names.traj_stream, seqs[:1], TrajectoryGroup)
    assert [t.traj_id for t in stored.trajectories] == [small[2].traj_id, small[0].traj_id, small[1].traj_id]
    assert await publish_trajectories(plane, small) != seqs  # other order, other group id: stored again (ingest dedups)
    one = await publish_trajectories(plane, [trajectory(task(1), 0)])
    assert isinstance((await plane.stored.get_many(plane.names.traj_stream, one, Trajectory))[0], Trajectory)  # one sample: alone
    n = int(0.6 * plane.max_payload) // 4  # prompts of random int32 (no compression): each fits alone, two together do not
    big = [Trajectory(**{**trajectory(task(2), i).model_dump(), "prompt_ids": np.random.default_rng(i).integers(0, 1 << 30, n)})
           for i in range(2)]
    seqs = await publish_trajectories(plane, big)
    assert len(set(seqs)) == 2
    assert [t.traj_id for t in await plane.stored.get_many(plane.names.traj_stream, seqs, Trajectory)] == [t.traj_id for t in big]


async def test_a_task_settled_again_stores_nothing_twice(plane: Plane):
    """A task redelivered after its trajectories were stored (its node died before the ack) is settled again:
    the server drops the copies by their ids, and the new delivery is acked."""
    await publish_tasks(plane, 1)
    tasks = plane.consumer(plane.names.task_stream, plane.names.pool_consumer("raas"), Task)
    (first,) = await tasks.pull(batch=1, timeout=5.0)
    await publish_trajectories(plane, [trajectory(first.msg, i) for i in range(2)])
    await first.nak()  # as if the node had died before its ack: the task comes back
    (again,) = await tasks.pull(batch=1, timeout=5.0)
    assert again.msg.task_id == first.msg.task_id and again.num_delivered == 2
    await Outbox(plane).settle(again, [trajectory(again.msg, i) for i in range(2)])
    assert await plane.stored.stream_msgs(plane.names.traj_stream) == 1  # the group, once: the copy had its id
    await settled(plane)


async def traj_lag(plane: Plane) -> tuple[int, int]:
    lag = await plane.stored.lag(plane.names.traj_stream, plane.names.DATAFLOW_CONSUMER)
    return lag.pending, lag.ack_pending


async def settled_lag(plane: Plane) -> tuple[int, int]:
    """The lag once the server has taken every ack this connection wrote (a round trip after them)."""
    await plane._nc.flush()
    return await traj_lag(plane)


async def until_lag(plane: Plane, want: tuple[int, int]) -> None:
    deadline = time.monotonic() + 10.0
    while (got := await traj_lag(plane)) != want:
        assert time.monotonic() < deadline, f"TRAJ consumer lag {got}, expected {want}"
        await asyncio.sleep(0.05)


async def test_a_groups_message_is_acked_once_every_part_is_settled_and_given_back_whole(plane: Plane):
    await publish_trajectories(plane, [trajectory(task(0), i) for i in range(3)])
    sub = TrajectoryLog(plane).reader()
    (d,) = await sub.pull(batch=4, timeout=5.0)
    p0, p1, p2 = taken(d)
    assert [p.msg.traj_id for p in (p0, p1, p2)] == ["t0000.0", "t0000.1", "t0000.2"] and p0.position == d.position
    await p0.ack()
    await p0.ack()  # once is once
    await p1.reject("invalid reward: a test")  # dead-lettered alone, counted settled
    assert await settled_lag(plane) == (0, 1)  # one part still open: the message stays unacked
    await p2.ack()
    await until_lag(plane, (0, 0))
    (rej,) = await plane.history(plane.names.dlq("traj"), Rejected, stream=plane.names.dlq_stream)
    assert decode(rej.payload, Trajectory).traj_id == "t0000.1" and rej.subject == plane.names.traj("solver")

    await publish_trajectories(plane, [trajectory(task(1), i) for i in range(2)])
    (d,) = await sub.pull(batch=4, timeout=5.0)
    q0, q1 = taken(d)
    await q1.nak()  # the whole message comes back
    (again,) = await sub.pull(batch=4, timeout=5.0)
    assert again.position == d.position and again.num_delivered == 2
    await q0.ack()  # parts of the delivery given back, settled late: they ack nothing
    await q1.ack()
    assert await settled_lag(plane) == (0, 1)  # the redelivery is still out: nothing acked it
    for p in taken(again):
        await p.ack()
    await until_lag(plane, (0, 0))
