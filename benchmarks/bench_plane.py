"""Plane throughput: trajectories/s through task -> trajectory -> batch on a real nats-server,
side by side with raw ``publish_async`` + ``fetch`` of the same number of same-sized messages
on the same server in the same run. The ratio is the figure. A batch is a manifest: the trainer
side reads each batch's trajectories back by sequence (``fetch_trajectories``), as the trainer does.

The rollout side here answers each task instantly with fixed tokens (no model): this measures
the plane and the real dataflow service, not an engine. Run: ``python benchmarks/bench_plane.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid

import nats
import numpy as np
from nats.js import api
from rich.console import Console
from rich.table import Table

from astraflow.config import parse_recipe
from astraflow.dataflow.service import Dataflow
from astraflow.streams.codec import encode
from astraflow.streams.messages import Batch, Task, Trajectory
from astraflow.streams.plane import NatsOptions, Plane
from astraflow.streams.server import EmbeddedServer
from astraflow.streams.trajectories import fetch_trajectories

PROMPT, COMPLETION = 64, 256  # tokens per trajectory


def trajectory_for(task: Task, i: int) -> Trajectory:
    n = COMPLETION
    return Trajectory(
        traj_id=f"{task.task_id}.{task.policy}.{i}",
        task_id=task.task_id,
        prompt_id=task.prompt_id,
        policy=task.policy,
        index=i,
        group_size=task.group_size,
        prompt_ids=np.arange(PROMPT, dtype=np.int32),
        completion_ids=np.arange(n, dtype=np.int32),
        logprobs=np.full(n, -0.5, np.float32),
        versions=np.zeros(n, np.int32),
        loss_mask=np.ones(n, np.uint8),
        reward=float(i % 2),
    )


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
                "max_staleness": 100,
                "max_batch_backlog": 4,
            },
            "rollout": {"max_new_tokens": COMPLETION},
            "data": {"n_train": 300},
        }
    )
    run = "pl" + uuid.uuid4().hex[:6]
    plane = await Plane.connect(NatsOptions(url=url), run, "dataflow")
    await plane.ensure_topology(recipe.topology())
    df = Dataflow(recipe, plane)
    rollout = await Plane.connect(NatsOptions(url=url), run, "rollout")
    trainer = await Plane.connect(NatsOptions(url=url), run, "trainer")
    done = asyncio.Event()
    trained = 0

    async def rollout_loop() -> None:
        sub = rollout.consumer(rollout.names.task_stream, "raas", Task)
        while not done.is_set():
            for d in await sub.pull(batch=16, timeout=0.2):
                trajs = [trajectory_for(d.msg, i) for i in range(d.msg.group_size)]
                await rollout.publish_many([(rollout.names.traj(d.msg.policy), t, t.traj_id) for t in trajs])
                await d.ack()

    async def trainer_loop() -> None:
        nonlocal trained
        sub = trainer.consumer(trainer.names.batch_stream, trainer.names.trainer_consumer("solver"), Batch)
        while trained < n_batches:
            for d in await sub.pull(batch=1, timeout=0.2):
                await fetch_trajectories(trainer, d.msg)  # a batch is a manifest: the trainer reads its trajectories itself
                trained += 1
                await d.ack()
        done.set()

    async def dataflow_loop() -> None:
        sub = plane.consumer(plane.names.traj_stream, plane.names.DATAFLOW_CONSUMER, Trajectory)
        while not done.is_set():
            await df.refresh_versions()
            await df.step(sub)

    t0 = time.perf_counter()
    await asyncio.gather(rollout_loop(), trainer_loop(), dataflow_loop())
    dt = time.perf_counter() - t0
    for p in (plane, rollout, trainer):
        await p.close()
    return n_batches * groups_per_batch * group / dt


async def main(quick: bool) -> dict[str, float]:
    n_batches = 10 if quick else 60
    group, gpb = 8, 8
    size = len(encode(trajectory_for(Task(task_id="x", workflow="w", policy="solver", prompt_id="p", prompt="q", group_size=group), 0)))
    with tempfile.TemporaryDirectory() as d, EmbeddedServer(d) as server:
        raw = await raw_throughput(server.url, n_batches * group * gpb, size)
        ours = await plane_throughput(server.url, n_batches, group, gpb)
    result = {"trajectory_bytes": size, "raw_msgs_per_s": round(raw, 1), "plane_traj_per_s": round(ours, 1),
              "ratio": round(ours / raw, 3), "trajectories": n_batches * group * gpb}
    t = Table(title="plane throughput (one nats-server, loopback)")
    t.add_column("path")
    t.add_column("per second", justify="right")
    t.add_row(f"raw publish_async + fetch + ack ({size} B msgs)", f"{raw:,.0f} msgs")
    t.add_row("task → trajectory → batch (real dataflow, typed messages)", f"{ours:,.0f} traj")
    t.add_row("ratio", f"{ours / raw:.3f}")
    Console().print(t)
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    print(json.dumps(asyncio.run(main(ap.parse_args().quick))))
