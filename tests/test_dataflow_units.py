"""Pure parts of the dataflow: id sets, group assembly, accounting, autoscale advice, latency models."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
from factories import a_trajectory
from hypothesis import given
from hypothesis import strategies as st

from astraflow.config import AutoscaleConfig
from astraflow.dataflow.autoscale import Meter, Nodes, Observation, Starvation, advise
from astraflow.dataflow.groups import Assembler
from astraflow.dataflow.ledger import IdSet, Ledger, account
from astraflow.dataflow.reputation import Reputation, sender
from astraflow.rollout.engines.scripted import Latency
from astraflow.streams.messages import Trajectory


@given(st.lists(st.integers(0, 200), max_size=300), st.lists(st.text("abc", max_size=3), max_size=5))
def test_idset_matches_a_plain_set(nums: list[int], others: list[str]):
    ids = IdSet()
    for n in nums:
        ids.add(f"t{n:08d}")
    for o in others:
        ids.add("x" + o)
    expected = {f"t{n:08d}" for n in nums} | {"x" + o for o in others}
    assert len(ids) == len(expected)
    for n in range(-1, 202):
        assert (f"t{n:08d}" in ids) == (f"t{n:08d}" in expected)
    assert all(lo <= hi for lo, hi in zip(ids.los, ids.his))
    assert all(h + 1 < lo for h, lo in zip(ids.his, ids.los[1:]))  # disjoint, never adjacent: merged
    back = IdSet()
    back.load_state(ids.state())
    assert back.state() == ids.state()


def test_idset_is_compact_for_contiguous_ids():
    ids = IdSet()
    for n in [5, 3, 4, 1, 2, 10]:
        ids.add(f"t{n:08d}")
    assert ids.state().ranges == [(1, 5), (10, 10)]


def traj(task: str, i: int, n: int = 3, traj_id: str | None = None) -> Trajectory:
    named = {"traj_id": traj_id} if traj_id else {}
    return a_trajectory(task, i, group_size=n, prompt_ids=np.arange(3), completion_ids=np.arange(2), logprob=0.0,
                        versions=np.array([4, 5], np.int32), reward=float(i), **named)


def test_assembler_completes_groups_and_spots_duplicates():
    a = Assembler()
    assert a.add(traj("t1", 0), seq=10) is None
    assert a.add(traj("t1", 0), seq=11) is None  # the same message redelivered: the newer copy is kept
    assert a.add(traj("t1", 0, traj_id="other"), seq=12) is False  # a second sample at a held index
    assert a.add(traj("t1", 2), seq=13) is None
    held = a.add(traj("t1", 1), seq=14)
    assert held and held.positions == [11, 14, 13] and held.group.min_version == 4
    assert [s.reward for s in held.group.samples] == [0.0, 1.0, 2.0] and not a.partial
    assert a.add(traj("t1", 2), seq=15) is False  # a late copy of a completed group


def test_accounting_adds_up_only_when_every_task_is_somewhere():
    ledger = Ledger(issued=10, received=7)
    ledger.fates.update({"trained": 4, "filtered:zero_variance": 1, "failed:rollout": 1})
    assert account(ledger, True, in_flight=2, buffered=1, awaiting=1).adds_up
    assert not account(ledger, True, in_flight=1, buffered=1, awaiting=1).adds_up
    side = Ledger(received=6)
    side.fates.update({"trained": 4, "dropped:stale": 1})
    assert account(side, False, in_flight=0, buffered=1, awaiting=0).adds_up


CFG = AutoscaleConfig(hi=0.3, lo=0.05, min_nodes=1, max_nodes=8, max_step=2)


@pytest.mark.parametrize(
    "obs, target, action",
    [
        # trainers starve, one node makes 1 group/s, trainers would take 4/s if never idle -> need 4, step-limited to 2+2
        (Observation(nodes=2, wait_frac=0.5, produce_rate=2.0, consume_rate=2.0), 4, "up"),
        (Observation(nodes=2, wait_frac=0.9, produce_rate=0.0, consume_rate=0.0), 3, "up"),  # nothing measurable: one more
        (Observation(nodes=7, wait_frac=0.5, produce_rate=7.0, consume_rate=7.0), 8, "up"),  # capped at max_nodes
        (Observation(nodes=4, wait_frac=0.1, produce_rate=4.0, consume_rate=4.0), 4, "hold"),  # inside the dead band
        (Observation(nodes=6, wait_frac=0.0, produce_rate=6.0, consume_rate=2.0, busy=0.5), 4, "down"),  # need 1, step-limited
        (Observation(nodes=4, wait_frac=0.0, produce_rate=4.0, consume_rate=4.0), 4, "hold"),  # trainers busy, pool fully used
        (Observation(nodes=4, wait_frac=0.0, produce_rate=4.0, consume_rate=3.0), 3, "down"),  # need 3: never below it
        (Observation(nodes=0, wait_frac=0.0, produce_rate=0.0, consume_rate=0.0), 1, "up"),  # below min_nodes
    ],
)
def test_advice_has_a_dead_band_and_follows_the_rates(obs: Observation, target: int, action: str):
    advice = advise(obs, CFG)
    assert (advice.target, advice.action) == (target, action), advice


def test_advice_is_stable_inside_the_band():
    for wait in np.linspace(CFG.lo, CFG.hi, 11):
        assert advise(Observation(nodes=3, wait_frac=float(wait), produce_rate=3.0, consume_rate=1.0), CFG).action == "hold"


def test_bad_bands_fail_at_load():
    with pytest.raises(ValueError, match="dead band"):
        AutoscaleConfig(hi=0.1, lo=0.2)


def test_meters_measure_over_their_window():
    m = Meter(window_s=10)
    for t in range(0, 31):
        m.add(float(t), 2.0 * t if t < 20 else 40.0 + 5.0 * (t - 20))
    assert m.rate() == pytest.approx(5.0)  # only the last 10 s count
    s = Starvation(window_s=100)
    for t, starved in [(0, True), (1, True), (3, False), (4, False)]:
        s.sample(float(t), starved)
    assert s.fraction() == pytest.approx(3 / 4)
    nodes = Nodes(window_s=100, stale_s=6)
    nodes.seen("a", 0.0, True, 0.0)
    nodes.seen("a", 10.0, True, 5.0)
    nodes.seen("b", 10.0, False, 0.0)  # draining: not counted
    assert nodes.live_ids(12.0) == ["a"] and nodes.busy(12.0) == pytest.approx(0.5)
    assert nodes.live_ids(20.0) == []  # heartbeats stopped


@pytest.mark.parametrize("dist, sigma", [("lognormal", 1.0), ("pareto", 0.0), ("constant", 0.0)])
def test_latency_distributions_have_the_configured_median(dist: str, sigma: float):
    lat = Latency(dist, 0.5, sigma=sigma, alpha=1.5, seed=1)
    draws = [lat.draw() for _ in range(4000)]
    assert statistics.median(draws) == pytest.approx(0.5, rel=0.1)
    if dist == "lognormal":  # sigma 1: the 99th percentile is e^2.33 ≈ 10x the median
        assert np.percentile(draws, 99) == pytest.approx(0.5 * np.exp(2.326), rel=0.25)
    assert Latency(dist, 0.5, sigma=sigma, seed=1).draw() == Latency(dist, 0.5, sigma=sigma, seed=1).draw()  # seeded


def test_a_node_is_quarantined_after_its_threshold_of_failed_tasks_not_samples():
    r = Reputation(threshold=3)
    assert r.blame("a", "t1", "reward_claim", "x") is None
    assert r.blame("a", "t1", "prompt_claim", "x") is None  # another bad sample of the same task: one failure
    assert r.blame("a", "t2", "payload", "x") is None  # the store's trouble: counts against no one
    assert r.blame("b", "t3", "reward", "x") is None and r.failures("a") == 1
    assert r.blame("a", "t4", "token", "x") is None
    q = r.blame("a", "t5", "reward_claim", "last one", now=7.0)
    assert q is not None and q.node == "a" and q.at == 7.0 and q.reason == "last one"
    assert q.failures == {"reward_claim": 2, "token": 1} and q.summary() == "reward_claim ×2, token ×1"
    assert r.refuses("a") and not r.refuses("b") and r.blame("a", "t6", "reward", "x") is None  # counted once
    assert r.admit("a") and not r.refuses("a") and r.failures("a") == 0 and not r.admit("a")  # a clean record
    never = Reputation(threshold=0)
    assert all(never.blame("a", f"t{i}", "reward", "x") is None for i in range(50)) and not never.quarantined
    assert sender("af.run.traj.solver.node-7") == "node-7" and sender("af.run.traj.solver") is None
