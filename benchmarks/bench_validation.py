"""Cost of the dataflow's trajectory validation, next to the plane's own time per trajectory.

Measures, on the trajectory ``bench_plane.py`` moves (64 prompt + 256 completion tokens):

- the pure checks (``validate.check_trajectory`` + ``check_versions``), single-turn and multi-turn
  limits, in microseconds per trajectory (best of 5 rounds of 20,000 calls);
- the whole admission (``TrajectoryIngest.admit``: checks, the task's claim, the version window);
- the batch digest the dataflow writes in each plan record and the trainer checks (``Batch.digest``),
  per trajectory of a 64-trajectory batch;
- the plane's time per trajectory from ``bench_plane.plane_throughput`` (a real nats-server, the
  real dataflow service, which now validates every trajectory), run in the same process.

The figure is admission time / plane time per trajectory (goal: under 5 %), and the same with the
digest added (everything the trust boundary costs the dataflow per trajectory).
Run: ``python benchmarks/bench_validation.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import timeit
from collections import Counter

from rich.console import Console
from rich.table import Table

from astraflow.algorithms import AlgorithmsConfig, build_pipeline
from astraflow.config import DataflowConfig
from astraflow.dataflow.durability import Journal
from astraflow.dataflow.inflight import InFlight
from astraflow.dataflow.ingest import TrajectoryIngest
from astraflow.dataflow.lane import PolicyLane
from astraflow.dataflow.validate import Limits, PolicyLimits, check_trajectory, check_versions
from astraflow.streams.dataflow_state import DataflowState
from astraflow.streams.messages import Batch, Task
from astraflow.streams.server import EmbeddedServer
from bench_plane import plane_throughput, trajectory_for

GROUP = 8


def per_call_us(fn: object, number: int = 20_000, rounds: int = 5) -> float:
    return min(timeit.repeat(fn, number=number, repeat=rounds)) / number * 1e6  # type: ignore[arg-type]


async def _never(policy: str) -> int:
    raise AssertionError("admission asked the plane: the benchmark's tokens are all of a known version")


def admission() -> TrajectoryIngest:
    """An ingest over one lane with task t00000001 in flight (no server: ``admit`` does no I/O)."""
    in_flight = InFlight()
    in_flight.issue("t00000001", None, {"solver": 0})
    lane = PolicyLane("solver", build_pipeline(AlgorithmsConfig()), primary=True)
    limits = Limits(group_size=GROUP, policies={"solver": PolicyLimits(vocab=384, max_completion=512, max_generated=512, max_row=None)})
    return TrajectoryIngest({"solver": lane}, in_flight, Journal(_NoStore(), DataflowState), DataflowConfig(group_size=GROUP),
                            Counter(), limits, _never)


class _NoStore:
    async def put(self, record: object) -> None: ...

    async def put_many(self, records: list[object]) -> None: ...

    async def delete(self, cls: type, *parts: str | int) -> None: ...


async def main(quick: bool) -> dict[str, float]:
    t = trajectory_for(Task(task_id="t00000001", workflow="w", policy="solver", prompt_id="p", prompt="q", group_size=GROUP), 3)
    single = PolicyLimits(vocab=384, max_completion=512, max_generated=512, max_row=None)
    multi = PolicyLimits(vocab=384, max_completion=None, max_generated=512, max_row=1024)
    assert check_trajectory(t, single, GROUP) is None and check_trajectory(t, multi, GROUP) is None
    ingest = admission()
    assert ingest.admit(t).action == "assemble"
    checks_single = per_call_us(lambda: (check_trajectory(t, single, GROUP), check_versions(t, 0, 0)))
    checks_multi = per_call_us(lambda: (check_trajectory(t, multi, GROUP), check_versions(t, 0, 0)))
    admit = per_call_us(lambda: ingest.admit(t))
    batch = Batch(batch_id="solver-b000001", policy="solver", trajectories=[t] * 64, advantages=bytes(4 * 64), task_ids=["t00000001"] * 8)
    digest = per_call_us(batch.digest, number=500) / 64
    n_batches, gpb = (10, 8) if quick else (60, 8)
    with tempfile.TemporaryDirectory() as d, EmbeddedServer(d) as server:
        traj_per_s = await plane_throughput(server.url, n_batches, GROUP, gpb)
    plane_us = 1e6 / traj_per_s
    result = {"checks_single_turn_us": round(checks_single, 2), "checks_multi_turn_us": round(checks_multi, 2),
              "admit_us": round(admit, 2), "digest_us_per_traj": round(digest, 2), "plane_us_per_traj": round(plane_us, 1),
              "plane_traj_per_s": round(traj_per_s, 1), "admit_share_of_plane": round(admit / plane_us, 4),
              "admit_and_digest_share_of_plane": round((admit + digest) / plane_us, 4), "trajectories": n_batches * gpb * GROUP}
    table = Table(title="trajectory validation vs the plane (64 + 256 tokens per trajectory)")
    table.add_column("what")
    table.add_column("µs per trajectory", justify="right")
    table.add_row("value checks, single-turn limits", f"{checks_single:.1f}")
    table.add_row("value checks, multi-turn limits", f"{checks_multi:.1f}")
    table.add_row("whole admission (checks, task claim, version window)", f"{admit:.1f}")
    table.add_row("batch digest for the plan record (per trajectory of 64)", f"{digest:.1f}")
    table.add_row(f"plane: task → trajectory → batch ({traj_per_s:,.0f} traj/s)", f"{plane_us:.0f}")
    table.add_row("admission / plane", f"{100 * admit / plane_us:.1f} %")
    table.add_row("admission + digest / plane", f"{100 * (admit + digest) / plane_us:.1f} %")
    Console().print(table)
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    print(json.dumps(asyncio.run(main(ap.parse_args().quick))))
