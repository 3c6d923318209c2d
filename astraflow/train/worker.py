"""The trainer worker: pull batches for one policy, step, publish the new weight version.

A batch is acked only after the optimizer step and the weight version are published, so a
trainer that dies mid-step leaves its batch to be redelivered. The time spent waiting for a
batch is measured: it is the input of autoscaling.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from astraflow.config import Recipe
from astraflow.models import build_model, load_tokenizer
from astraflow.runtime import every, stop_event
from astraflow.streams.messages import Batch, Heartbeat
from astraflow.streams.plane import NatsOptions, Plane
from astraflow.tasks import load_split
from astraflow.train.torch_backend import TorchBackend
from astraflow.weights.publish import WeightPublisher

log = logging.getLogger(__name__)


async def serve(recipe: Recipe, nats: NatsOptions, run: str, worker_id: str = "trainer", policy: str | None = None) -> None:
    policy = policy or recipe.primary
    if policy not in recipe.policies:
        raise ValueError(f"policy {policy!r} is not in the recipe ({list(recipe.policies)})")
    pcfg = recipe.policies[policy]
    cfg = pcfg.trainer
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    plane = await Plane.connect(nats, run, worker_id)
    await plane.ensure_topology(recipe.topology())
    tokenizer = load_tokenizer(pcfg.model.tokenizer)
    backend = TorchBackend(build_model(pcfg.model, tokenizer), tokenizer, cfg, temperature=recipe.rollout.temperature)
    publisher = WeightPublisher(plane, policy, keyframe_every=cfg.keyframe_every)
    stop = stop_event()

    if pcfg.sft.steps:
        train, _ = load_split(recipe.data)
        loss = await asyncio.to_thread(backend.sft, train, pcfg.sft, cfg.seed)
        log.info("SFT warm start: %d steps, last loss %.3f", pcfg.sft.steps, loss)
    await publisher.publish(backend.state_dict(), 0, force_keyframe=True)
    version, waited, started, last = 0, 0.0, time.monotonic(), {}

    async def beat() -> None:
        elapsed = max(time.monotonic() - started, 1e-9)
        stats = {"wait_frac": waited / elapsed, "bytes_sent": publisher.bytes_sent, **last}
        await plane.beat(Heartbeat(role="trainer", worker_id=worker_id, policy=policy, version=version, stats=stats), "trainer")

    beats = asyncio.create_task(every(2.0, beat, stop))
    sub = await plane.subscribe(plane.names.batch_stream, plane.names.trainer_consumer(policy))
    log.info("trainer %s up at v0, training %d steps", policy, cfg.steps)
    try:
        while version < cfg.steps and not stop.is_set():
            t0 = time.monotonic()
            got = await plane.pull(sub, Batch, batch=1, timeout=1.0)
            waited += time.monotonic() - t0
            if not got:
                continue
            d = got[0]
            try:
                metrics = await asyncio.to_thread(backend.step, d.msg)
            except Exception as e:
                log.exception("step on %s failed", d.msg.batch_id)
                await plane.reject(d.raw.subject, d.raw.data, f"training step failed: {e}")
                await d.term()
                continue
            version += 1
            elapsed = time.monotonic() - started
            last = {**metrics, "wait_frac": waited / elapsed}
            ann = await publisher.publish(backend.state_dict(), version, [d.msg.batch_id], last)
            await d.ack()
            log.info("v%d %s loss %.4f reward %.3f wait %.0f%% (%s)", version, d.msg.batch_id, metrics["loss"],
                     metrics["reward_mean"], 100 * last["wait_frac"], ann.encoding)
        await plane.state_put(f"done.{policy}", version)
    finally:
        stop.set()
        await asyncio.gather(beats, return_exceptions=True)
        await plane.close()
