"""Batch servers: fifo, edf (oldest valid first, stale dropped with reason), replay, mix."""

from __future__ import annotations

import random
from collections import Counter

from astraflow.algorithms import (
    Context,
    Edf,
    Fifo,
    FifoConfig,
    Group,
    Mix,
    MixConfig,
    Replay,
    ReplayConfig,
    Sample,
)

RNG = random.Random(0)


def ctx(version: int = 10, max_staleness: int = 4, now: float = 1000.0) -> Context:
    return Context(now=now, versions={"solver": version}, max_staleness=max_staleness)


def grp(
    task: str,
    version: int = 10,
    *,
    prompt: str | None = None,
    created_at: float = 900.0,
    deadline: float | None = None,
    meta: dict | None = None,
) -> Group:
    prompt = prompt or f"p-{task}"
    samples = tuple(
        Sample(f"{task}-{i}", task, prompt, "solver", float(i), version, 10, False, created_at, deadline)
        for i in range(2)
    )
    return Group(task, prompt, "solver", samples, meta or {})


def ids(groups: list[Group]) -> list[str]:
    return [g.task_id for g in groups]


# --- fifo ------------------------------------------------------------------------------------


def test_fifo_serves_in_buffer_order_and_drops_stale():
    buffer = [grp("a", 9), grp("old", 5), grp("b", 10), grp("c", 8)]
    result = Fifo().serve(buffer, 2, ctx(), RNG)
    assert ids(result.batch) == ["a", "b"] and result.taken == ["a", "b"]
    assert result.dropped == [("old", "stale")]  # lag 5 > 4
    # the buffer cannot fill 4: empty batch, nothing taken, but the drop still reported
    short = Fifo().serve(buffer, 4, ctx(), RNG)
    assert short.batch == [] and short.taken == [] and short.dropped == [("old", "stale")]
    kept = Fifo(FifoConfig(drop_stale=False)).serve(buffer, 4, ctx(), RNG)
    assert ids(kept.batch) == ["a", "old", "b", "c"] and kept.dropped == []


# --- edf -------------------------------------------------------------------------------------


def test_edf_serves_oldest_valid_first_and_drops_stale_with_reason():
    buffer = [
        grp("v9", 9, created_at=100.0),
        grp("v7", 7, created_at=300.0),  # version deadline 7 + 4 = 11: next to go stale
        grp("v5", 5),  # lag 5 > 4: stale
        grp("v8-late", 8, created_at=200.0),
        grp("v8-deadline", 8, created_at=250.0, deadline=1500.0),  # same version, earlier time deadline
        grp("expired", 10, deadline=999.0),
    ]
    result = Edf().serve(buffer, 3, ctx(), RNG)
    assert ids(result.batch) == ["v7", "v8-deadline", "v8-late"]
    assert result.taken == ids(result.batch)
    assert sorted(result.dropped) == [("expired", "expired"), ("v5", "stale")]
    rest = [g for g in buffer if g.task_id not in result.taken and g.task_id not in dict(result.dropped)]
    assert ids(Edf().serve(rest, 1, ctx(), RNG).batch) == ["v9"]


def test_edf_tie_breaks_by_age_then_position():
    buffer = [grp("young", 9, created_at=5.0), grp("old", 9, created_at=1.0), grp("old2", 9, created_at=1.0)]
    assert ids(Edf().serve(buffer, 3, ctx(), RNG).batch) == ["old", "old2", "young"]


# --- replay ----------------------------------------------------------------------------------


def test_replay_fills_its_ratio_from_served_groups():
    replay = Replay(ReplayConfig(ratio=0.5, capacity=100, max_replays=1), Fifo())
    buffer = [grp(f"g{i}") for i in range(40)]
    rng = random.Random(7)
    first = replay.serve(buffer, 4, ctx(), rng)
    assert ids(first.batch) == ["g0", "g1", "g2", "g3"]  # nothing to replay yet
    served = set(first.taken)
    buffer = buffer[4:]
    replayed_ever: list[str] = []
    for _ in range(6):
        result = replay.serve(buffer, 4, ctx(), rng)
        fresh, replayed = result.batch[:2], result.batch[2:]
        assert len(result.batch) == 4 and result.taken == ids(fresh)  # floor(0.5 * 4) = 2 replayed
        assert set(ids(replayed)) <= served  # only already-served groups come back
        assert set(ids(replayed)).isdisjoint(result.taken)  # and are not removed from the buffer again
        replayed_ever += ids(replayed)
        served |= set(result.taken)
        buffer = [g for g in buffer if g.task_id not in result.taken]
    assert len(replayed_ever) == len(set(replayed_ever))  # max_replays=1


def test_replay_ratio_rounds_down_and_needs_a_full_fresh_part():
    replay = Replay(ReplayConfig(ratio=0.3, max_replays=5), Fifo())
    buffer = [grp(f"g{i}") for i in range(10)]
    replay.serve(buffer[:5], 5, ctx(), RNG)
    result = replay.serve(buffer[5:], 5, ctx(), RNG)
    assert len(result.batch) == 5 and len(result.taken) == 4  # floor(0.3 * 5) = 1 replayed
    # 4 fresh are needed but only 3 are buffered: no batch, and the replay memory is untouched
    before = replay.state()
    assert replay.serve(buffer[:3], 5, ctx(), RNG).batch == []
    assert replay.state() == before


def test_replayed_samples_obey_staleness():
    replay = Replay(ReplayConfig(ratio=0.5, capacity=100, max_replays=10), Fifo())
    replay.serve([grp("old1", 6), grp("old2", 6), grp("new1", 10), grp("new2", 10)], 4, ctx(version=10), RNG)
    # trainer moves to 11: groups at version 6 now lag 5 > 4 and must never be replayed
    fresh = [grp(f"f{i}", 11) for i in range(20)]
    for _ in range(5):
        result = replay.serve(fresh, 4, ctx(version=11), RNG)
        assert all(11 - g.min_version <= 4 for g in result.batch)
        fresh = [g for g in fresh if g.task_id not in result.taken]
    assert not {"old1", "old2"} & {g.task_id for g, _ in replay.memory}


def test_replay_memory_is_bounded():
    replay = Replay(ReplayConfig(ratio=0.0, capacity=3), Fifo())
    replay.serve([grp(f"g{i}") for i in range(5)], 5, ctx(), RNG)
    assert [g.task_id for g, _ in replay.memory] == ["g2", "g3", "g4"]


# --- mix -------------------------------------------------------------------------------------


def test_mix_fills_batches_by_weight():
    mix = Mix(MixConfig(weights={"math": 3, "code": 1}), Fifo())
    buffer = [grp(f"m{i}", prompt=f"math/{i}") for i in range(20)] + [grp(f"c{i}", prompt=f"code/{i}") for i in range(20)]
    result = mix.serve(buffer, 4, ctx(), RNG)
    assert ids(result.batch) == ["m0", "m1", "m2", "c0"]  # batch keeps base (buffer) order
    # weights 1:3 with batches of 2: the share is carried as credit across batches
    mix = Mix(MixConfig(weights={"math": 1, "code": 3}), Fifo())
    counts: Counter[str] = Counter()
    for _ in range(8):
        result = mix.serve(buffer, 2, ctx(), RNG)
        counts.update(tid[0] for tid in result.taken)
        buffer = [g for g in buffer if g.task_id not in result.taken]
    assert counts == {"m": 4, "c": 12}


def test_mix_source_from_meta_key_before_prompt_prefix():
    mix = Mix(MixConfig(weights={"math": 1, "code": 1}, meta_key="dataset"), Fifo())
    tagged = grp("t", prompt="code/1", meta={"dataset": "math"})
    assert mix.source_of(tagged) == "math"
    assert mix.source_of(grp("u", prompt="code/1")) == "code"
    assert mix.source_of(grp("v", prompt="plain")) == "plain"


def test_mix_fills_from_other_sources_when_one_runs_dry_and_drops_stale():
    mix = Mix(MixConfig(weights={"math": 1, "code": 1}), Fifo())
    buffer = [grp("m0", prompt="math/0"), grp("x0", prompt="misc/0"), grp("m1", prompt="math/1"), grp("s", 1, prompt="code/9")]
    result = mix.serve(buffer, 3, ctx(), RNG)
    assert ids(result.batch) == ["m0", "x0", "m1"]  # no servable code: math, then unweighted misc
    assert result.dropped == [("s", "stale")]
    assert mix.serve(buffer, 4, ctx(), RNG).batch == []  # only 3 servable
