"""Cost of the dataflow's trajectory validation, next to the plane's own time per trajectory.

Measures, on the trajectory ``bench_plane.py`` moves (64 prompt + 256 completion tokens):

- the pure checks (``validate.check_trajectory`` + ``check_versions``), single-turn and multi-turn
  limits, in microseconds per trajectory (best of 5 rounds of 20,000 calls);
- the whole admission (``TrajectoryIngest.admit``: checks, the task's claim, the version window);
- the batch digest the dataflow writes in each plan record and the trainer checks (``Batch.digest``,
  over the manifest: references and advantages), per trajectory of a 64-trajectory batch;
- the plane's time per trajectory from ``bench_plane.plane_throughput`` (a real nats-server, the
  real dataflow service, which now validates every trajectory), run in the same process, with
  the admission and the digests timed inside that run too (``in_loop``: fresh trajectories, cold
  caches, other work interleaved; the fair figure to set against the plane's).

The figure is admission time / plane time per trajectory (goal: under 5 %), and the same with the
digest added (everything the trust boundary costs the dataflow per trajectory).
Run: ``python benchmarks/bench_validation.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import timeit
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from bench_plane import plane_throughput, trajectory_for
from rich.console import Console
from rich.table import Table

from astraflow.algorithms import AlgorithmsConfig, build_pipeline
from astraflow.config import DataflowConfig
from astraflow.dataflow import ingest as ingest_module
from astraflow.dataflow.durability import Journal
from astraflow.dataflow.inflight import InFlight
from astraflow.dataflow.ingest import TrajectoryIngest
from astraflow.dataflow.lane import PolicyLane
from astraflow.dataflow.validate import Limits, PolicyLimits, check_trajectory, check_versions, measure
from astraflow.streams.dataflow_state import DataflowState
from astraflow.streams.messages import Batch, Task, Trajectory, TrajRef
from astraflow.streams.server import EmbeddedServer

GROUP = 8


def per_call_us(fn: object, number: int = 20_000, rounds: int = 5) -> float:
    return min(timeit.repeat(fn, number=number, repeat=rounds)) / number * 1e6  # type: ignore[arg-type]


async def _no_objects(trajs: list[Trajectory]) -> list[Trajectory]:
    raise AssertionError("admission read an object: the benchmark's trajectories all travel whole")


async def _never(policy: str) -> int:
    raise AssertionError("admission asked the plane: the benchmark's tokens are all of a known version")


def admission(tasks: list[str]) -> TrajectoryIngest:
    """An ingest over one lane with ``tasks`` in flight (no server: ``admit`` does no I/O)."""
    lane = PolicyLane("solver", build_pipeline(AlgorithmsConfig()), primary=True)
    in_flight = InFlight(lane.tasks)
    for task_id in tasks:
        lane.issue(task_id, None)
        in_flight.issued(task_id, None, {"solver": 0})
    limits = Limits(group_size=GROUP, policies={"solver": PolicyLimits(vocab=384, max_completion=512, max_generated=512, max_row=None)})
    return TrajectoryIngest({"solver": lane}, in_flight, Journal(_NoStore(), DataflowState), DataflowConfig(group_size=GROUP),
                            Counter(), limits, _never, _no_objects)


@contextmanager
def timed(cls: type, name: str, count: Callable[[Any], int]) -> Iterator[list[float]]:
    """Time every call of ``cls.name`` while inside: yields [seconds, items] (``count(self)`` items per call)."""
    original = getattr(cls, name)
    total = [0.0, 0.0]

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            total[0] += time.perf_counter() - t0
            total[1] += count(self)

    setattr(cls, name, wrapper)
    try:
        yield total
    finally:
        setattr(cls, name, original)


class _NoStore:
    async def put(self, record: object) -> None: ...

    async def put_many(self, records: list[object]) -> None: ...

    async def delete(self, cls: type, *parts: str | int) -> None: ...


async def main(quick: bool) -> dict[str, float]:
    tasks = [Task(task_id=f"t{k:08d}", workflow="w", policy="solver", prompt_id="p", prompt="q", group_size=GROUP) for k in range(1, 33)]
    pull = [trajectory_for(task, i) for task in tasks for i in range(GROUP)]  # what one pull of 256 brings
    single = PolicyLimits(vocab=384, max_completion=512, max_generated=512, max_row=None)
    multi = PolicyLimits(vocab=384, max_completion=None, max_generated=512, max_row=1024)
    pairs = list(zip(pull, measure(pull), strict=True))
    assert all(check_trajectory(t, lim, GROUP, s) is None for t, s in pairs for lim in (single, multi))
    ingest = admission([t.task_id for t in tasks])
    assert all(ingest.admit(t, s).action == "assemble" for t, s in pairs)
    n = len(pull)
    measured = per_call_us(lambda: measure(pull), number=200) / n
    def checks(lim: PolicyLimits) -> float:
        return per_call_us(lambda: [(check_trajectory(t, lim, GROUP, s), check_versions(t, 0, 0, s)) for t, s in pairs], number=200) / n

    checks_single, checks_multi = checks(single), checks(multi)
    admit = per_call_us(lambda: [ingest.admit(t, s) for t, s in zip(pull, measure(pull), strict=True)], number=200) / n
    batch = Batch(batch_id="solver-b000001", policy="solver", advantages=bytes(4 * 64), task_ids=["t00000001"] * 8,
                  refs=[TrajRef(seq=1000 + k, traj_id=t.traj_id, task_id=t.task_id) for k, t in enumerate(pull[:64])])
    digest = per_call_us(batch.digest, number=500) / 64
    n_batches, gpb = (10, 8) if quick else (60, 8)
    with tempfile.TemporaryDirectory() as d, EmbeddedServer(d) as server, timed(TrajectoryIngest, "admit", lambda _: 1) as admits, \
            timed(Batch, "digest", lambda b: len(b.refs)) as digests:
        ingest_module.measure, counted = measured_call(ingest_module.measure)
        try:
            traj_per_s = await plane_throughput(server.url, n_batches, GROUP, gpb)
        finally:
            ingest_module.measure = measure
    plane_us = 1e6 / traj_per_s
    admit_loop = (admits[0] + counted[0]) / admits[1] * 1e6
    digest_loop = digests[0] / digests[1] * 1e6
    result = {"measure_us": round(measured, 2), "checks_single_turn_us": round(checks_single, 2),
              "checks_multi_turn_us": round(checks_multi, 2),
              "admit_us": round(admit, 2), "digest_us_per_traj": round(digest, 2), "plane_us_per_traj": round(plane_us, 1),
              "plane_traj_per_s": round(traj_per_s, 1), "admit_share_of_plane": round(admit / plane_us, 4),
              "admit_and_digest_share_of_plane": round((admit + digest) / plane_us, 4), "in_loop_admit_us": round(admit_loop, 2),
              "in_loop_digest_us_per_traj": round(digest_loop, 2),
              "in_loop_share_of_plane": round((admit_loop + digest_loop) / plane_us, 4),
              "trajectories": n_batches * gpb * GROUP}
    table = Table(title="trajectory validation vs the plane (64 + 256 tokens per trajectory; pulls of 256)")
    table.add_column("what")
    table.add_column("µs per trajectory", justify="right")
    table.add_row("array stats (numpy over the whole pull)", f"{measured:.1f}")
    table.add_row("value checks given the stats, single-turn limits", f"{checks_single:.1f}")
    table.add_row("value checks given the stats, multi-turn limits", f"{checks_multi:.1f}")
    table.add_row("whole admission (stats, checks, task claim, version window)", f"{admit:.1f}")
    table.add_row("batch digest for the plan record (per trajectory of 64)", f"{digest:.1f}")
    table.add_row(f"plane: task → trajectory → batch ({traj_per_s:,.0f} traj/s)", f"{plane_us:.0f}")
    table.add_row("admission / plane", f"{100 * admit / plane_us:.1f} %")
    table.add_row("admission + digest / plane", f"{100 * (admit + digest) / plane_us:.1f} %")
    table.add_row("in the plane run: admission, digest", f"{admit_loop:.1f}, {digest_loop:.1f}")
    table.add_row("in the plane run: admission + digest / plane", f"{100 * (admit_loop + digest_loop) / plane_us:.1f} %")
    Console().print(table)
    return result


def measured_call(fn: Callable[..., Any]) -> tuple[Callable[..., Any], list[float]]:
    """``fn`` timed on every call (a module-level function, where ``timed`` wraps methods)."""
    total = [0.0]

    def wrapper(*args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            total[0] += time.perf_counter() - t0

    return wrapper, total


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    print(json.dumps(asyncio.run(main(ap.parse_args().quick))))
