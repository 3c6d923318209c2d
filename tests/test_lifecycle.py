"""The task lifecycle on its own: every move the diagram draws is allowed, every other refused, and a lane's state
brings each record back at its stage."""

from __future__ import annotations

import pytest
from test_dataflow_parts import group_of, pipeline

from astraflow.dataflow.lane import PolicyLane
from astraflow.dataflow.lifecycle import FIRST, NEXT, IllegalTransition, Stage, TaskBook
from astraflow.streams.fates import Fate

PATH = {Stage.ISSUED: [], Stage.ASSEMBLING: [Stage.ASSEMBLING], Stage.KEPT: [Stage.KEPT], Stage.PLANNED: [Stage.KEPT, Stage.PLANNED],
        Stage.AWAITING: [Stage.KEPT, Stage.PLANNED, Stage.AWAITING], Stage.SETTLED: [Stage.SETTLED]}  # from issued, by legal moves


def book_at(stage: Stage) -> TaskBook:
    book = TaskBook("solver", primary=True)
    book.move("t1", Stage.ISSUED)
    for s in PATH[stage]:
        book.move("t1", s)
    return book


@pytest.mark.parametrize("was", list(Stage))
def test_a_move_is_allowed_exactly_when_the_diagram_draws_it(was):
    for to in Stage:
        book = book_at(was)
        if to in NEXT[was]:
            book.move("t1", to)
            assert book.stage("t1") is to
        else:
            with pytest.raises(IllegalTransition, match=f"t1 cannot go from {was.value} to {to.value}"):
                book.move("t1", to)
            assert book.stage("t1") is was  # a refused move changes nothing


def test_where_a_task_may_begin_depends_on_the_lane():
    for primary in (True, False):
        for to in Stage:
            book = TaskBook("p", primary)
            if to in FIRST[primary]:
                book.move("t1", to)
            else:
                with pytest.raises(IllegalTransition, match="from nowhere"):
                    book.move("t1", to)
    secondary = TaskBook("verifier", primary=False)
    secondary.move("t1", Stage.ASSEMBLING)
    secondary.forget("t1")  # its task failed: no fate in a lane that counts completed groups only
    assert secondary.stage("t1") is None and not secondary.count(Stage.ASSEMBLING)
    with pytest.raises(IllegalTransition):
        book_at(Stage.ASSEMBLING).forget("t1")  # the primary settles its tasks, always


def test_the_book_counts_by_stage_in_arrival_order_and_closes_what_is_batched_or_settled():
    book = TaskBook("solver", primary=True)
    for t in ("t1", "t2", "t3", "t4"):
        book.move(t, Stage.ISSUED)
    book.move("t3", Stage.KEPT)
    book.move("t1", Stage.KEPT)
    book.move("t2", Stage.SETTLED)
    assert [r.task_id for r in book.at_stage(Stage.KEPT)] == ["t3", "t1"] and book.count(Stage.ISSUED) == 1
    book.move("t3", Stage.KEPT)  # a restored group came back: to the end of the buffer
    assert [r.task_id for r in book.at_stage(Stage.KEPT)] == ["t1", "t3"]
    book.move("t1", Stage.PLANNED, batch="b1")
    assert book.in_batch("b1") == ["t1"] and "t1" in book.closed and "t2" in book.closed and "t3" not in book.closed
    assert book.get("t2") is None and book.stage("t2") is Stage.SETTLED  # a settled record leaves; its id stays closed
    book.restore("t4", Stage.KEPT)  # a state that names a task twice: where it names it last, counted once
    assert book.stage("t4") is Stage.KEPT and book.count(Stage.ISSUED) == 0 and book.count(Stage.KEPT) == 2


def test_a_lanes_state_brings_every_record_back_at_its_stage():
    lane = PolicyLane("solver", pipeline(), primary=True)
    for i in range(5):
        lane.issue(f"t{i}", None)
    groups = [group_of(f"t{i}", [0.0, 1.0], seq0=10 * (i + 1)) for i in range(5)]
    for g in groups[:4]:
        lane.keep(g)
    first = lane.plan(groups[:2], ["t0", "t1"], created_at=1.0)
    lane.published(first.batch_id)
    lane.plan(groups[2:3], ["t2"], created_at=2.0)  # written ahead, not published
    lane.settle("t4", Fate.parse("failed:rollout"))
    stages = {f"t{i}": lane.tasks.stage(f"t{i}") for i in range(5)}
    assert stages == {"t0": Stage.AWAITING, "t1": Stage.AWAITING, "t2": Stage.PLANNED, "t3": Stage.KEPT, "t4": Stage.SETTLED}
    restored = PolicyLane("solver", pipeline(), primary=True)
    restored.load_state(lane.state())
    assert {t: restored.tasks.stage(t) for t in stages} == stages and restored.state() == lane.state()
    assert not restored.is_buffered("t3") and restored.kept_weight("t3") == 1.0  # kept, its trajectories still to come back
    assert restored.accounting() == lane.accounting() and lane.accounting().adds_up
    with pytest.raises(IllegalTransition):
        lane.keep(groups[0])  # a batched group is never buffered again
