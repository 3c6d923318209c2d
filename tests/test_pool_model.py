"""benchmarks/pool_model.py: the discrete-event model of a rollout pool obeys the laws it must, and its fits recover a
known law."""

import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from pool_calibration import fit, fit_fanout
from pool_model import Latency, Links, Pool, fanout, relayed, simulate

LAT = Latency("lognormal", median_s=1.0, sigma=1.0)


def pool(**kw: Any) -> Pool:
    """50 nodes × 4 slots, groups of 8, a trainer that never holds anything back."""
    base = Pool(nodes=50, slots_per_node=4, group_size=8, latency=LAT, groups_per_batch=50, step_s=0.001,
                max_staleness=1000, max_tasks_in_flight=400)
    return replace(base, **kw)


@pytest.mark.parametrize("latency", [LAT, Latency("pareto", median_s=1.0, alpha=2.5), Latency("constant", median_s=1.0)])
def test_a_task_takes_the_longest_of_its_groups_draws(latency):
    draws = latency.draw(np.random.default_rng(0), (200_000, 8)).max(axis=1)
    assert latency.mean_max(8) == pytest.approx(draws.mean(), rel=0.01)


def test_with_nothing_else_in_the_way_throughput_is_littles_law():
    p = pool()
    run = simulate(p, window_s=1500)
    # every slot busy: slots × group / E[task time]
    assert run.traj_per_s == pytest.approx(p.slots * p.group_size / LAT.mean_max(8), rel=0.03)
    assert run.slot_util == pytest.approx(1.0, abs=0.02)
    assert run.dropped_share == 0


def test_a_dataflow_slower_than_the_pool_caps_throughput_at_its_service_rate():
    offered_groups = pool().offered_traj_per_s / 8
    ms_per_traj = 1000 / (offered_groups / 2) / 8  # one shard serves half the offered groups
    run = simulate(pool(dataflow_ms_per_traj=ms_per_traj), window_s=1500)
    assert run.traj_per_s == pytest.approx(1000 / ms_per_traj, rel=0.02)  # 1 / service time, in trajectories
    assert run.dataflow_util == pytest.approx(1.0, abs=0.02)
    two = simulate(pool(dataflow_ms_per_traj=ms_per_traj, dataflow_shards=2, max_tasks_in_flight=800), window_s=1500)
    assert two.traj_per_s > 1.8 * run.traj_per_s  # a second shard doubles what it can serve


def test_shared_cores_cap_throughput_at_cores_over_cpu_per_trajectory():
    run = simulate(pool(machine_cores=2.0, machine_ms_per_traj=40.0, machine_idle_cores=1.0), window_s=1500)
    assert run.traj_per_s == pytest.approx((2.0 - 1.0) / 0.040, rel=0.02)


def test_no_trained_sample_is_staler_than_max_staleness_and_the_budget_bounds_what_is_issued():
    run = simulate(pool(max_staleness=1, groups_per_batch=40, step_s=2.0, max_tasks_in_flight=None), window_s=600)
    assert max(run.staleness) <= 1
    # (max_staleness + 1) · groups_per_batch = 80 tasks at most in flight or buffered, of 200 slots
    assert run.slot_util <= 80 / 200 + 0.01


def test_a_version_that_reaches_the_nodes_late_makes_every_sample_that_much_staler():
    fed = pool(groups_per_batch=10, step_s=1.0)  # the trainer steps every second, always fed
    now, late = simulate(fed, window_s=600), simulate(replace(fed, fanout_s=5.0), window_s=600)
    assert late.version_interval_s == pytest.approx(1.0, abs=0.01)
    assert min(late.staleness) >= 5  # five versions announced while the one a node holds travelled
    assert late.staleness_mean - now.staleness_mean == pytest.approx(5.0, abs=0.5)


def test_mirrors_make_the_hub_send_one_copy_per_region_whatever_the_nodes():
    links = Links(0.01, 1e9, 1e9, 1e9)
    for nodes in (10, 1_000, 10_000):
        mirrored, direct = fanout(nodes, 10, 1e8, links), fanout(nodes, 0, 1e8, links)
        assert (mirrored.hub_copies, mirrored.hub_bytes) == (10, 10 * 1e8)
        assert mirrored.leaf_copies == math.ceil(nodes / 10)
        assert (direct.hub_copies, direct.hub_bytes) == (nodes, nodes * 1e8)


def test_relays_send_fan_out_copies_per_level():
    links = Links(0.01, 1e9, 2e9, 1e9)
    relayed, flat = fanout(10_000, 10, 1e8, links, relay=10), fanout(10_000, 10, 1e8, links)
    assert relayed.depth == 3  # 10 + 100 + 1,000 nodes hold it after three levels: a region's 1,000
    # base + hub's 10 copies + the mirror's 10 + two levels of 10 from the relays
    assert relayed.to_all_s == pytest.approx(0.01 + 10 * 0.1 + 10 * 0.05 + 2 * 10 * 0.1)
    assert flat.to_all_s == pytest.approx(0.01 + 10 * 0.1 + 1000 * 0.05)
    assert relayed.leaf_bytes == 10 * 1e8


def test_relay_servers_bound_each_servers_copies_and_are_never_fitted():
    links = Links(0.01, 1e9, 2e9, 1e9)
    tree, per_relay = relayed(64, 3, 4, 1e8, links)  # bench_fanout's relayed runs: 3 regions × 4 relays
    assert (tree.hub_copies, tree.leaf_copies, per_relay) == (3, 4, 6)
    assert tree.to_all_s == pytest.approx(0.01 + 3 * 0.1 + 4 * 0.05 + 6 * 0.05)
    runs = [{"nodes": n, "regions": 3, "to_all_s": 0.004 + 3 * 0.002 + math.ceil(n / 3) * 0.005} for n in (4, 16, 64)]
    runs += [{"nodes": n, "regions": 0, "to_all_s": 0.004 + n * 0.002} for n in (4, 16, 64)]
    assert fit_fanout([*runs, {"nodes": 64, "regions": 3, "relays": 4, "to_all_s": 9.0}]) == pytest.approx(fit_fanout(runs))


def test_the_fanout_fit_recovers_a_known_law_and_no_cost_is_negative():
    runs = [{"nodes": n, "regions": r, "to_all_s": 0.004 + (n if r == 0 else r) * 0.002 + (0 if r == 0 else math.ceil(n / r)) * 0.005}
            for n in (4, 16, 64) for r in (0, 3)]
    assert fit_fanout(runs) == pytest.approx([0.004, 0.002, 0.005], rel=1e-6)
    assert fit([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]], [3.0, 2.0, 1.0]) == pytest.approx([2.0, 0.0])  # a falling cost: 0
