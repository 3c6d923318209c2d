"""Every task's life, driven by random event sequences against the real dataflow on a real nats-server: nodes that
answer, answer twice, give tasks back or fail them; trainers that train, refuse batches (stale or failed) or jump
versions; the dataflow killed without a word and restarted from its state. After every event the accounting adds
up; at the end every issued task is in exactly one place (out, buffered, in a batch, or settled with one fate) and the
fate records written for it agree with the ledger.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import numpy as np
import pytest
from factories import honest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_dataflow import Harness, recipe

from astraflow.dataflow.lifecycle import IN_A_BATCH, Stage
from astraflow.streams.messages import BatchRefusal, Refusal, Trajectory
from astraflow.streams.state import FateRecord

EVENTS = ("turn", "answer", "answer_twice", "give_back", "fail", "crash", "train", "refuse_stale", "refuse_failed", "jump")
RECIPE = recipe(max_tasks_in_flight=6, max_staleness=1, group_size=2, groups_per_batch=2)


async def answer(h: Harness, copies: int, limit: int) -> None:
    """A node serves up to ``limit`` tasks: each trajectory published ``copies`` times (a retry after a lost ack), then
    the task acked. Rewards differ within a group, so no filter drops it."""
    got = await h.task_sub.pull(batch=limit, timeout=0.2)
    items = []
    for d in got:
        t, v = d.msg, h.versions["solver"]
        items += [(h.node.names.traj("solver"), Trajectory(
            traj_id=f"{t.task_id}.solver.{i}", task_id=t.task_id, prompt_id=t.prompt_id, policy="solver", index=i,
            group_size=t.group_size, **honest(t, float(i % 2)), logprobs=np.full(4, -0.5, np.float32),
            versions=np.full(4, v, np.int32), loss_mask=np.ones(4, np.uint8), reward=float(i % 2)), None)
            for i in range(t.group_size)] * copies
    await h.node.publish_many(items)
    for d in got:
        await d.ack()


async def refuse(h: Harness, code: BatchRefusal) -> None:
    for d in await h.batch_subs["solver"].pull(batch=1, timeout=0.2):
        await d.refuse(Refusal(code, "refused by the scripted trainer"))


async def event(h: Harness, kind: str) -> None:
    if kind == "turn":
        await h.turn(2)
    elif kind in ("answer", "answer_twice"):
        await answer(h, 2 if kind == "answer_twice" else 1, limit=3)
    elif kind == "give_back":
        for d in await h.task_sub.pull(batch=2, timeout=0.2):
            await d.nak()
    elif kind == "fail":
        await h.fail()
    elif kind == "crash":
        await h.kill_dataflow()
        await h.open_dataflow()
    elif kind == "train":
        await h.train("solver", limit=1)
    elif kind == "refuse_stale":
        await refuse(h, BatchRefusal.STALE)
    elif kind == "refuse_failed":
        await refuse(h, BatchRefusal.STEP_FAILED)
    elif kind == "jump":  # a trainer's versions run ahead of what the nodes serve: groups go stale
        await h.announce("solver", h.versions["solver"] + 2, [])


async def life(url: str, events: list[str]) -> None:
    h = await Harness(url, "life" + uuid.uuid4().hex[:8], RECIPE).start()
    try:
        for kind in events:
            await event(h, kind)
            await h.turn()
            acc = h.acc()
            assert acc.adds_up, (kind, acc)
        await h.df.journal.flush()
        await h.df.journal.commit()
        lane, issued = h.df.lanes["solver"], h.df.ledger.issued
        ids = [f"t{n:08d}" for n in range(1, issued + 1)]
        records = dict(zip(ids, await asyncio.gather(*(h.plane.state.get(FateRecord, "solver", t) for t in ids)), strict=True))
        places = {"out": set(h.df.in_flight.out()), "buffered": {r.task_id for r in lane.tasks.at_stage(Stage.KEPT)},
                  "in a batch": {r.task_id for r in lane.tasks.at_stage(*IN_A_BATCH)},
                  "settled": {t for t, r in records.items() if r is not None}}
        assert all(lane.tasks.stage(t) is Stage.SETTLED for t in places["settled"]), events  # a fate record: the record settled
        for a, b in [(a, b) for a in places for b in places if a < b]:
            assert not places[a] & places[b], (a, b, places[a] & places[b], events)  # one place each
        assert set().union(*places.values()) == set(ids), (set(ids) - set().union(*places.values()), events)  # none lost
        fates = Counter(records[t].fate for t in places["settled"])  # type: ignore[union-attr]
        assert fates == Counter(h.acc().fates), (fates, h.acc().fates, events)  # one fate each, as the ledger counts
    finally:
        await h.close()


@pytest.mark.timeout(600)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(events=st.lists(st.sampled_from(EVENTS), min_size=4, max_size=24))
def test_every_task_ends_in_one_place_whatever_happens(nats_server, events: list[str]):
    asyncio.run(life(nats_server.url, ["turn", "answer", *events]))
