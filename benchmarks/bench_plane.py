"""Plane throughput: trajectories/s through task -> trajectory -> batch on a real nats-server,
side by side with raw ``publish_async`` + ``fetch`` of the same number of same-sized messages
on the same server in the same run. The ratio is the figure. A batch is a manifest: the trainer
side reads each batch's trajectories back by sequence (``fetch_trajectories``), as the trainer does.

The rollout side here answers each task instantly with fixed tokens (no model): this measures
the plane and the real dataflow service (started, and stepped as ``dataflow.service.serve``
does), not an engine. It publishes and acks the tasks of a pull the way the tree's rollout node
settles tasks that finish together (``rollout/outbox.py``: one pipelined publish of all their
trajectories, then their acks); a tree without it settles each task on its own (publish, wait for
the server, ack), concurrently, as its node's slots did. The trainer side announces each batch it
read as a version trained on it, as a trainer does (the announcement names the batch; no weights
are stored), so the dataflow settles each batch's tasks as in a run.

Run: ``python benchmarks/bench_plane.py [--batches 60]``. Side by side with another tree (e.g. ``main``):
``python benchmarks/bench_plane.py --before /tmp/lean_before`` runs each tree in its own child
process (``PYTHONPATH`` = the tree), alternating, ``--rounds`` each, and reports every round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import nats
import numpy as np
from nats.js import api
from rich.console import Console
from rich.table import Table

import astraflow
from astraflow.config import parse_recipe
from astraflow.dataflow.service import Dataflow
from astraflow.streams.codec import encode
from astraflow.streams.messages import Batch, ObjectRef, Task, Trajectory, WeightVersion
from astraflow.streams.plane import Delivery, NatsOptions, Plane
from astraflow.streams.server import EmbeddedServer
from astraflow.streams.trajectories import fetch_trajectories

try:  # the tree's roles tune the garbage collector at start-up; this process does as they do, before both paths
    from astraflow.runtime import run_event_loop, tune_gc
except ImportError:  # a tree from before them: the collector as CPython sets it, asyncio's own event loop
    def tune_gc() -> None:
        pass

    run_event_loop = asyncio.run

try:  # the tree's rollout node settles tasks that finish together at once
    from astraflow.rollout.outbox import Outbox
except ImportError:  # a tree from before it: each task on its own
    Outbox = None  # type: ignore[assignment,misc]

try:  # the tree's dataflow reads the trajectory log through its port
    from astraflow.streams.trajectory_log import TrajectoryLog
except ImportError:  # a tree from before the ports
    TrajectoryLog = None  # type: ignore[assignment,misc]

PROMPT, COMPLETION = 64, 256  # tokens per trajectory
ROOT = Path(__file__).resolve().parents[1]
MESSAGES = {"raw": 0, "plane": 0}  # NATS messages sent and received by the clients of each path
ENDS = {"made": 0, "first_batch_s": 0.0}  # the plane path's trajectories made (counted or not) and its first batch's time


PROMPT_IDS, COMPLETION_IDS = np.arange(PROMPT, dtype=np.int32).tobytes(), np.arange(COMPLETION, dtype=np.int32).tobytes()
LOGPROBS, VERSIONS = np.full(COMPLETION, -0.5, np.float32).tobytes(), np.zeros(COMPLETION, np.int32).tobytes()
LOSS_MASK = np.ones(COMPLETION, np.uint8).tobytes()  # fixed tokens: their arrays are packed once, each message built per sample


def trajectory_for(task: Task, i: int) -> Trajectory:
    return Trajectory(
        traj_id=f"{task.task_id}.{task.policy}.{i}",
        task_id=task.task_id,
        prompt_id=task.prompt_id,
        policy=task.policy,
        index=i,
        group_size=task.group_size,
        prompt_ids=PROMPT_IDS,
        completion_ids=COMPLETION_IDS,
        logprobs=LOGPROBS,
        versions=VERSIONS,
        loss_mask=LOSS_MASK,
        reward=float(i % 2),
    )


def announcement(version: int, batch_id: str) -> WeightVersion:
    """Version ``version``, trained on ``batch_id``: what a trainer announces after its step (a keyframe whose object
    the dataflow never reads; nothing is stored)."""
    digest = f"{version:064x}"
    ref = ObjectRef(name=f"v{version}", nuid=f"bench{version}", size=1, chunk_size=1, digests=[digest], digest=digest)
    return WeightVersion(policy="solver", version=version, encoding="keyframe", state_digest=digest, keyframe_version=version,
                         objects=[ref], batch_ids=[batch_id])


async def raw_throughput(url: str, n: int, size: int) -> float:
    """The baseline: plain nats-py on the same server, no astraflow in the path."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    run = "raw" + uuid.uuid4().hex[:6]
    stream, subject = "RAW_" + run, f"raw.{run}"
    await js.add_stream(api.StreamConfig(name=stream, subjects=[subject], storage=api.StorageType.FILE))
    await js.add_consumer(stream, api.ConsumerConfig(durable_name="c", ack_policy=api.AckPolicy.EXPLICIT, max_ack_pending=100_000))
    sub = await js.pull_subscribe_bind("c", stream)
    payload = b"x" * size
    t0 = time.perf_counter()

    async def produce() -> None:
        futs = [await js.publish_async(subject, payload) for _ in range(n)]
        await asyncio.gather(*futs)

    async def consume() -> None:
        got = 0
        while got < n:
            try:
                msgs = await sub.fetch(batch=256, timeout=1)
            except Exception:
                continue
            for m in msgs:
                await m.ack()
            got += len(msgs)

    await asyncio.gather(produce(), consume())
    dt = time.perf_counter() - t0
    MESSAGES["raw"] += nc.stats["in_msgs"] + nc.stats["out_msgs"]
    await nc.close()
    return n / dt


async def plane_throughput(url: str, n_batches: int, group: int, groups_per_batch: int) -> float:
    recipe = parse_recipe(
        {
            "name": "bench",
            "dataflow": {
                "group_size": group,
                "groups_per_batch": groups_per_batch,
                "max_tasks_in_flight": 4 * groups_per_batch,
                "max_staleness": 1_000_000,  # the fixed arrays claim version 0 whatever the trainer side announced
                "max_batch_backlog": 4,
                "trust_claims": True,  # fixed arrays, not answers: the plane's own cost (claims: bench_validation.py)
            },
            "model": {"max_positions": PROMPT + COMPLETION},
            "rollout": {"max_new_tokens": COMPLETION},
            "data": {"n_train": 300},
        }
    )
    run = "pl" + uuid.uuid4().hex[:6]
    plane = await Plane.connect(NatsOptions(url=url), run, "dataflow")
    await plane.ensure_topology(recipe.topology())
    df = Dataflow(recipe, plane)
    await df.start()  # as the dataflow service does: it follows announcements, dead letters and heartbeats
    rollout = await Plane.connect(NatsOptions(url=url), run, "rollout")
    trainer = await Plane.connect(NatsOptions(url=url), run, "trainer")
    done = asyncio.Event()
    trained = 0

    async def settle_alone(d: Delivery[Task], trajs: list[Trajectory]) -> None:
        await rollout.publish_many([(rollout.names.traj(t.policy), t, t.traj_id) for t in trajs])
        await d.ack()

    settle = Outbox(rollout).settle if Outbox is not None else settle_alone

    async def rollout_loop() -> None:
        sub = rollout.consumer(rollout.names.task_stream, "raas", Task)
        while not done.is_set():
            got = await sub.pull(batch=16, timeout=0.2)
            ENDS["made"] += sum(d.msg.group_size for d in got)
            await asyncio.gather(*(settle(d, [trajectory_for(d.msg, i) for i in range(d.msg.group_size)]) for d in got))

    async def trainer_loop() -> None:
        nonlocal trained
        sub = trainer.consumer(trainer.names.batch_stream, trainer.names.trainer_consumer("solver"), Batch)
        while trained < n_batches:
            for d in await sub.pull(batch=1, timeout=0.2):
                await fetch_trajectories(trainer, d.msg)  # a batch is a manifest: the trainer reads its trajectories itself
                trained += 1
                if trained == 1:
                    ENDS["first_batch_s"] = time.perf_counter() - t0
                await d.ack()
                await trainer.publish(trainer.names.weights("solver"), announcement(trained, d.msg.batch_id))
        done.set()

    async def dataflow_loop() -> None:
        if TrajectoryLog is not None:  # the tree's TRAJ stream carries trajectory groups too, read through its port
            sub = TrajectoryLog(plane).reader()
        elif hasattr(plane, "trajectory_consumer"):  # the same, before the flows had ports
            sub = plane.trajectory_consumer(plane.names.DATAFLOW_CONSUMER)
        else:
            sub = plane.consumer(plane.names.traj_stream, plane.names.DATAFLOW_CONSUMER, Trajectory)
        while not done.is_set():
            await df.step(sub)

    t0 = time.perf_counter()
    await asyncio.gather(rollout_loop(), trainer_loop(), dataflow_loop())
    dt = time.perf_counter() - t0
    for p in (plane, rollout, trainer):  # messages both ways on the three connections (nats-py's counters)
        MESSAGES["plane"] += p._nc.stats["in_msgs"] + p._nc.stats["out_msgs"]
    await df.watch.stop()
    for p in (plane, rollout, trainer):
        await p.close()
    return n_batches * groups_per_batch * group / dt


async def main(quick: bool, table: bool = True, batches: int = 60) -> dict[str, float | str]:
    n_batches = 10 if quick else batches
    group, gpb = 8, 8
    size = len(encode(trajectory_for(Task(task_id="x", workflow="w", policy="solver", prompt_id="p", prompt="q", group_size=group), 0)))
    with tempfile.TemporaryDirectory() as d, EmbeddedServer(d) as server:
        n = n_batches * group * gpb
        cpu0 = time.process_time()
        raw = await raw_throughput(server.url, n, size)
        cpu1 = time.process_time()
        ours = await plane_throughput(server.url, n_batches, group, gpb)
        cpu2 = time.process_time()
    result: dict[str, float | str] = {"trajectory_bytes": size, "raw_msgs_per_s": round(raw, 1), "plane_traj_per_s": round(ours, 1),
                                      "ratio": round(ours / raw, 3), "trajectories": n,
                                      "raw_cpu_us_per_msg": round((cpu1 - cpu0) / n * 1e6, 1),  # this process's CPU, not the server's
                                      "plane_cpu_us_per_traj": round((cpu2 - cpu1) / n * 1e6, 1),
                                      "raw_msgs_per_msg": round(MESSAGES["raw"] / n, 2),
                                      "plane_msgs_per_traj": round(MESSAGES["plane"] / n, 2),
                                      # the run's ends: the fill before the first batch, the tasks still out after the last
                                      "plane_first_batch_ms": round(ENDS["first_batch_s"] * 1e3, 1),
                                      "plane_trajectories_made": ENDS["made"],
                                      "astraflow": str(Path(astraflow.__file__).parents[1])}
    if not table:
        return result
    t = Table(title="plane throughput (one nats-server, loopback)")
    t.add_column("path")
    t.add_column("per second", justify="right")
    t.add_row(f"raw publish_async + fetch + ack ({size} B msgs)", f"{raw:,.0f} msgs")
    t.add_row("task → trajectory → batch (real dataflow, typed messages)", f"{ours:,.0f} traj")
    t.add_row("ratio", f"{ours / raw:.3f}")
    Console().print(t)
    return result


def run_child(tree: Path, quick: bool, batches: int) -> dict[str, float]:
    """This benchmark once, in a child process that imports astraflow from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, __file__, "--child", "--batches", str(batches), *(["--quick"] if quick else [])],
                          capture_output=True, text=True, env=env, cwd=tree)
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}: exit {proc.returncode}: {proc.stderr.strip()[-1500:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def side_by_side(before: Path, rounds: int, quick: bool, batches: int) -> dict[str, list[dict[str, float]]]:
    """Both trees, alternating, ``rounds`` each; every round's figures."""
    out: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for r in range(rounds):
        for name, tree in (("before", before), ("after", ROOT)):
            out[name].append(run_child(tree, quick, batches))
            print(f"round {r + 1} {name}: {out[name][-1]}", flush=True)
    t = Table(title=f"plane throughput, {rounds} rounds each, trees alternating (before: {before})")
    for col in ("round", "tree", "raw msgs/s", "plane traj/s", "ratio", "client CPU µs / raw msg", "client CPU µs / traj",
                "NATS msgs / raw msg", "NATS msgs / traj"):
        t.add_column(col, justify="right")
    for r in range(rounds):
        for name in out:
            x = out[name][r]
            t.add_row(str(r + 1), name, f"{x['raw_msgs_per_s']:,.0f}", f"{x['plane_traj_per_s']:,.0f}", f"{x['ratio']:.3f}",
                      f"{x['raw_cpu_us_per_msg']:.0f}", f"{x['plane_cpu_us_per_traj']:.0f}", f"{x['raw_msgs_per_msg']:.2f}",
                      f"{x['plane_msgs_per_traj']:.2f}")
    Console().print(t)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--before", type=Path, help="a baseline source tree, measured side by side with this one")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=60, help="batches of 8 groups x 8 per path (raw: as many messages)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.before is not None:
        print(json.dumps(side_by_side(args.before, args.rounds, args.quick, args.batches)))
    else:
        tune_gc()
        result = run_event_loop(main(args.quick, table=not args.child, batches=args.batches))
        print(json.dumps(result))
