"""The RaaS worker: pull tasks from the pool's shared durable consumer, roll out, publish.

Joining = binding the shared consumer and fetching the current weights. A task is acked only
after its trajectories are stored; a task the node cannot serve yet (weights older than the
task allows) is nak'ed back with a delay; a node told to stop finishes what it holds and
leaves. A node that dies is covered by the server's ack_wait redelivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import torch

from astraflow.config import Recipe
from astraflow.models import load_tokenizer
from astraflow.rollout.engine import SamplingParams, build_engine
from astraflow.rollout.rewards import get_reward
from astraflow.rollout.workflows import PolicyHandle, get_workflow
from astraflow.runtime import every, stop_event
from astraflow.streams.messages import Heartbeat, Task
from astraflow.streams.plane import Delivery, NatsOptions, Plane
from astraflow.weights.sync import WeightSync

log = logging.getLogger(__name__)


def make_handle(recipe: Recipe, policy: str, params: SamplingParams | None = None) -> PolicyHandle:
    model_cfg = recipe.policies[policy].model
    tokenizer = load_tokenizer(model_cfg.tokenizer)
    engine = build_engine(recipe.rollout.engine, model_cfg, recipe.rollout, tokenizer)
    r = recipe.rollout
    return PolicyHandle(engine, tokenizer, params or SamplingParams(r.max_new_tokens, r.temperature, r.top_p))


async def _keep_in_progress(held: list[Delivery[Task]], every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        await asyncio.gather(*(d.in_progress() for d in held), return_exceptions=True)


async def serve(recipe: Recipe, nats: NatsOptions, run: str, worker_id: str, pool: str | None = None,
                region: str = "", hardware: str = "cpu") -> None:
    torch.set_num_threads(recipe.rollout.threads)
    pool = pool or recipe.rollout.pool
    plane = await Plane.connect(nats, run, worker_id)
    await plane.ensure_topology(recipe.topology())
    handles = {p: make_handle(recipe, p) for p in recipe.policy_names}
    syncs = {p: WeightSync(plane, p, h.engine) for p, h in handles.items()}
    workflow = get_workflow(recipe.workflow, get_reward(recipe.reward))
    stop = stop_event()
    stats = {"tasks": 0.0, "trajectories": 0.0, "gen_s": 0.0, "failed": 0.0}

    async def beat() -> None:
        await plane.beat(Heartbeat(role="rollout", worker_id=worker_id, pool=pool, region=region, hardware=hardware,
                                   policy=recipe.primary, version=syncs[recipe.primary].version,
                                   stats={**stats, **{f"{p}.{k}": v for p, s in syncs.items() for k, v in s.stats.items()}},
                                   state="draining" if stop.is_set() else "running"), "rollout")

    beats = asyncio.create_task(every(2.0, beat, stop))
    try:
        for sync in syncs.values():
            await sync.wait_for(0, timeout=600)
        sub = await plane.subscribe(plane.names.task_stream, plane.names.pool_consumer(pool))
        log.info("rollout node %s joined pool %s at %s", worker_id, pool, {p: s.version for p, s in syncs.items()})
        ack_wait = recipe.topology().task_ack_wait
        while not stop.is_set():
            got = await plane.pull(sub, Task, batch=recipe.rollout.tasks_per_generate, timeout=1.0)
            for sync in syncs.values():
                await sync.refresh()  # a safe point: between generations
            if not got:
                continue
            ready = [d for d in got if all(syncs[p].version >= v for p, v in d.msg.min_versions.items() if p in syncs)]
            for d in got:
                if d not in ready:
                    await d.nak(delay=1.0)
            if not ready:
                continue
            keeper = asyncio.create_task(_keep_in_progress(ready, ack_wait / 3))
            t0 = time.perf_counter()
            try:
                trajs = await asyncio.to_thread(workflow.run, [d.msg for d in ready], handles, worker_id)
            except Exception as e:
                log.exception("workflow failed on %d tasks", len(ready))
                stats["failed"] += len(ready)
                for d in ready:
                    if d.num_delivered >= recipe.topology().max_deliver - 1:
                        await plane.reject(d.raw.subject, d.raw.data, f"workflow failed {d.num_delivered}x: {e}")
                        await d.term()
                    else:
                        await d.nak(delay=2.0)
                continue
            finally:
                keeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await keeper
            stats["gen_s"] += time.perf_counter() - t0
            await plane.publish_many([(plane.names.traj(t.policy), t, t.traj_id) for t in trajs])
            await asyncio.gather(*(d.ack() for d in ready))  # only now: the trajectories are stored
            stats["tasks"] += len(ready)
            stats["trajectories"] += len(trajs)
    finally:
        stop.set()
        await asyncio.gather(beats, return_exceptions=True)
        await plane.close()
        log.info("rollout node %s left", worker_id)
