"""The trainer worker: pull batches for one policy, vet, step, publish the new version behind the next step, checkpoint in
groups, ack.

One trainer per policy; each has its own durable consumer (``trainer-{policy}``) and weight
subject, and none waits for another. Per batch, in this order:

1. vet (``train/vetting.py``): a redelivered batch whose id is already trained is acked
   without training; a manifest the dataflow did not plan (no plan record, or another content)
   is dead-lettered with its reason, untrained; then the trajectories it names are fetched from
   the TRAJ stream by sequence (batched, offloaded arrays resolved), each checked to be the one
   its reference names; one gone, another than named, with values the model cannot take, or
   too stale makes the batch dead-lettered too (a failed read is retried: the batch is nak'ed);
2. step; a step whose loss or gradient norm is not finite made no update: the batch is
   dead-lettered (``non_finite``) and counted (``skipped_steps``);
3. the bf16 image of the new weights is taken (a copy: the next step cannot change it) and checked finite (never
   checkpointed or announced otherwise: the trainer stops, and its restart resumes from the last checkpoint);
4. every ``checkpoint_every`` versions, once the announcement of v has landed, an in-memory snapshot, written in the
   background (``train/group_commit.py``);
5. publish version v+1 once v's has landed (the announcement is the version's commit point): behind the next step, stored
   and announced while the loop goes on with the next batch, or in line on a CPU trainer, where the two would share its
   cores (``trainer.publish``);
6. once v+1's announcement has landed, hold the batch unacked (kept alive) until a durable checkpoint covers v+1, then
   ack it. A publish that failed stops the trainer at the next turn of the loop, its batch unacked.

While no batch comes, a keyframe request is looked for every ``KEYFRAME_CHECK_S`` and answered at once (the current
version announced again as a keyframe): when every node has lost its chain, no node serves a task and no version
would come to serve it.

A crash between any two of these resumes exactly: the restart restores the last durable checkpoint
and retrains the announced batches after it (still in the BATCH stream: unacked), checking each
replayed version against its announced digest (see ``train/resume.py``, ``train/replay.py``). The
time spent waiting for a batch is measured: it is the input of autoscaling, exported to Prometheus
and in heartbeats with the loss parts, diagnostics, gradient norm and tokens/s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

import torch

from astraflow.config import Recipe
from astraflow.metrics import Metrics, serving, start_metrics_server
from astraflow.models import build_model, load_tokenizer
from astraflow.runtime import crash_point, every, stop_event, watch_server
from astraflow.streams.codec import DecodeError
from astraflow.streams.direct import MissingMessages
from astraflow.streams.messages import Batch, BatchRefusal, Heartbeat, Refusal, TrainerStats
from astraflow.streams.plane import Delivery, NatsOptions, Plane
from astraflow.streams.state import DoneRecord, StateReadError
from astraflow.streams.trajectories import PayloadUnavailable, TrainingBatch, fetch_trajectories
from astraflow.tasks import load_split
from astraflow.train.backend import build_backend
from astraflow.train.checkpoint import Checkpointer, CheckpointMeta
from astraflow.train.distributed import Collective, barrier_for
from astraflow.train.group_commit import GroupCommit
from astraflow.train.resume import start
from astraflow.train.sft import sft
from astraflow.train.threads import pin, threads_for
from astraflow.train.vetting import allowed_lag, check_batch, check_manifest, check_plan
from astraflow.weights.finite import non_finite
from astraflow.weights.publish import WeightPublisher

log = logging.getLogger(__name__)
KEYFRAME_CHECK_S = 2.0  # while waiting for batches, how often a keyframe request is looked for


def embedding_rows(model: torch.nn.Module) -> int:
    """Rows of the model's input embedding: token ids a batch may hold are below this."""
    embeddings = model.get_input_embeddings()  # type: ignore[operator]
    return int(embeddings.num_embeddings)


async def serve(recipe: Recipe, nats: NatsOptions, run: str, worker_id: str = "trainer", policy: str | None = None,
                checkpoint_dir: str | Path | None = None, metrics_port: int | None = None, fresh_lineage: bool = False) -> None:
    policy = policy or recipe.primary
    if policy not in recipe.policies:
        raise ValueError(f"policy {policy!r} is not in the recipe ({list(recipe.policies)})")
    pcfg = recipe.policies[policy]
    cfg = pcfg.trainer
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(pcfg.model.tokenizer)
    model = build_model(pcfg.model, tokenizer)
    resuming = not fresh_lineage and checkpoint_dir is not None and any(Path(checkpoint_dir).glob("v*/meta.json"))
    if pcfg.sft.steps and not resuming:
        train, _ = load_split(recipe.data)
        torch.set_num_threads(threads_for(pcfg.sft.threads))
        log.info("SFT warm start begins: %d steps on %d threads", pcfg.sft.steps, torch.get_num_threads())
        t0 = time.perf_counter()
        loss = await asyncio.to_thread(sft, model, tokenizer, train, pcfg.sft, cfg.seed)
        log.info("SFT warm start: %d steps in %.0f s on %d threads, last loss %.3f", pcfg.sft.steps, time.perf_counter() - t0,
                 torch.get_num_threads(), loss)
    torch.set_num_threads(threads_for(cfg.threads))
    if isinstance(cfg.cores, list) and pin(cfg.cores):  # after the warm start, which takes every core
        log.info("training on %d torch threads, on CPUs %s", torch.get_num_threads(), cfg.cores)
    else:
        log.info("training on %d torch threads", torch.get_num_threads())
    backend = build_backend(cfg.backend, model, tokenizer, cfg, temperature=recipe.rollout.temperature)
    ckpt = None
    if checkpoint_dir is not None:
        ckpt = Checkpointer(Path(checkpoint_dir), keep=cfg.checkpoint_keep, rank=backend.rank, barrier=barrier_for(backend))
    run_op = Collective(backend, ckpt, peer_timeout=cfg.peer_timeout)
    if backend.rank != 0:  # data-parallel ranks follow rank 0, which alone talks to the plane
        await asyncio.to_thread(run_op.follow)
        return
    try:
        vocab = embedding_rows(model)
        await _lead(recipe, nats, run, worker_id, policy, run_op, ckpt, metrics_port, vocab, fresh_lineage)
    finally:
        run_op.stop()


async def _lead(recipe: Recipe, nats: NatsOptions, run: str, worker_id: str, policy: str, run_op: Collective,
                ckpt: Checkpointer | None, metrics_port: int | None, vocab: int, fresh_lineage: bool) -> None:
    cfg = recipe.policies[policy].trainer
    metrics = Metrics("trainer", policy=policy, worker=worker_id)
    if metrics_port is not None:
        port = start_metrics_server(metrics_port)
        log.info("Prometheus metrics on :%d/metrics", port)
    plane = await Plane.connect(nats, run, worker_id)
    await plane.ensure_topology(recipe.topology(), create=False)
    publisher = WeightPublisher(plane, policy, keyframe_every=cfg.keyframe_every, keep_versions=recipe.plane.weights_history,
                                mirror_domains=tuple(recipe.plane.mirror_domains))
    stop = stop_event()
    max_lag = allowed_lag(recipe)
    at = await start(plane, publisher, run_op, ckpt, policy, fresh_lineage, skip=max_lag)
    for key, (was, now) in run_op.retune().items():  # after the replay, which needs the values it was trained with
        log.warning("%s: trainer.%s is %g in the recipe, %g in the checkpoint: %g from the next step on", policy, key, now, was, now)
    version, trained = at.version, list(at.trained)
    seen = set(trained)
    behind = cfg.publish == "behind" or (cfg.publish == "auto" and run_op.backend.device.type != "cpu")
    commits = GroupCommit(run_op, ckpt, publisher, durable=at.version, behind=behind)  # start() left a checkpoint of at.version
    waited, started = 0.0, time.monotonic()
    last: dict[str, float] = {}
    last_ids: list[str] = []
    metrics.set({"version": version})

    def meta_now() -> CheckpointMeta:
        """What a checkpoint of the current version holds (copies: the loop goes on while it is written)."""
        return CheckpointMeta(version=version, policy=policy, trained=list(trained), last_batch_ids=list(last_ids),
                              last_metrics=dict(last), lineage=at.lineage, lineage_base=at.base)

    async def beat() -> None:
        elapsed = max(time.monotonic() - started, 1e-9)
        stats = TrainerStats(wait_s=waited, wait_frac=waited / elapsed, bytes_sent=publisher.bytes_sent, step=last)
        await plane.beat(Heartbeat(worker_id=worker_id, policy=policy, version=version, stats=stats, metrics=serving()))

    beats = asyncio.create_task(every(2.0, beat, stop))
    watchdog = asyncio.create_task(watch_server(plane, stop, recipe.plane.server_gone_timeout))
    batches = plane.consumer(plane.names.batch_stream, plane.names.trainer_consumer(policy), Batch)
    keepalive_s = max((await batches.settings()).ack_wait / 3, 0.2)
    log.info("trainer %s at v%d of lineage %s, training to v%d (%s backend, %s loss, checkpoint every %d versions, publish %s)",
             policy, version, at.lineage or "-", at.base + cfg.steps, cfg.backend, cfg.loss.type, cfg.checkpoint_every,
             "behind the next step" if behind else "inline")
    settled = False
    asked_at = time.monotonic()
    try:
        while version < at.base + cfg.steps and not stop.is_set():
            await commits.settle()
            t0 = time.monotonic()
            got = await batches.pull(batch=1, timeout=1.0)
            wait = time.monotonic() - t0
            waited += wait
            metrics.inc({"wait_seconds": wait})
            if not got:
                if time.monotonic() - asked_at >= KEYFRAME_CHECK_S:  # no version is coming: a node that lost its chain
                    asked_at = time.monotonic()                    # would wait for the next one forever
                    await commits.answer_keyframe_request()
                continue
            d = got[0]
            manifest = d.msg
            if manifest.batch_id in seen:  # trained before a crash that came before its ack, or held here
                if commits.redelivered(d, asyncio.create_task(_keep_alive(d, keepalive_s))):
                    continue
                log.info("%s was trained before the restart: ack without training", manifest.batch_id)
                metrics.inc({"redelivered_trained_batches": 1})
                await d.ack()
                continue
            try:
                refused = await check_plan(plane, policy, manifest) or check_manifest(manifest, policy)
            except StateReadError as e:  # the plan could not be read: neither train nor turn it away
                log.warning("%s: %s; trying again", manifest.batch_id, e)
                await d.nak(delay=1.0)
                continue
            if refused is not None:
                metrics.inc({"rejected_batches": 1})
                await d.refuse(refused)
                continue
            keep = asyncio.create_task(_keep_alive(d, keepalive_s))
            handed = False  # to the group commit, which acks it or stops its keep-alive
            try:
                t_fetch = time.monotonic()
                batch = await _fetch(plane, d, metrics)
                if batch is None:
                    continue
                fetch_s = time.monotonic() - t_fetch
                metrics.inc({"fetch_seconds": fetch_s})
                refused = check_batch(batch, vocab, version, max_lag)
                if refused is not None:
                    metrics.inc({"rejected_batches": 1})
                    await d.refuse(refused)
                    continue
                try:
                    step = await asyncio.to_thread(run_op.step, batch)
                except Exception as e:
                    log.exception("step on %s failed", batch.batch_id)
                    await d.refuse(Refusal(BatchRefusal.STEP_FAILED, str(e)))
                    continue
                if step.get("skipped"):  # the loss or the gradient norm was not finite: the backend made no update
                    metrics.inc({"skipped_steps": 1})
                    why = f"loss {step['loss']}, gradient norm {step['grad_norm']}: no update made"
                    await d.refuse(Refusal(BatchRefusal.NON_FINITE, why))
                    continue
                crash_point("after_step", version + 1)
                version += 1
                trained.append(batch.batch_id)
                seen.add(batch.batch_id)
                elapsed = time.monotonic() - started
                last = {**step, "wait_frac": waited / elapsed, "batch_wait_s": wait, "fetch_s": fetch_s}
                last_ids = [batch.batch_id]
                state, bad = await asyncio.to_thread(_checked_image, run_op)  # the bf16 image of v: a copy, what gets announced
                if bad:  # not the data's doing (the step was finite and clipped): stop before anything is written
                    await d.refuse(Refusal(BatchRefusal.NON_FINITE, f"the weights after the step hold NaN or inf ({', '.join(bad[:3])})"))
                    raise RuntimeError(f"{policy} weights turned non-finite after {batch.batch_id}; nothing was checkpointed or "
                                       "announced: a restart resumes from the last checkpoint")
                if ckpt is not None and version % cfg.checkpoint_every == 0:
                    await commits.checkpoint(meta_now())  # after the announcement of v-1 has landed
                await commits.publish(state, version, last_ids, last, d, keep)  # in the background, after v-1's
                handed = True
            finally:
                if not handed:
                    keep.cancel()
            metrics.set({**last, "version": version})
            metrics.inc({"trained_tokens": step["tokens"], "trained_batches": 1})
            log.info("v%d %s loss %.4f reward %.3f wait %.0f%% (v%s announced, %d held)", version, batch.batch_id, step["loss"],
                     step["reward_mean"], 100 * last["wait_frac"], publisher.image_version, commits.held)
        await commits.finish(meta_now())  # finished or stopped: the publish in flight landed, all trained durable, all acked
        settled = True
        if version >= at.base + cfg.steps:  # finished, not stopped
            await plane.state.put(DoneRecord(policy=policy, version=version))
    finally:
        if not settled:
            await commits.abandon()
        stop.set()
        await asyncio.gather(beats, watchdog, return_exceptions=True)
        await plane.close()


async def _fetch(plane: Plane, d: Delivery[Batch], metrics: Metrics) -> TrainingBatch | None:
    """The trajectories the manifest names, whole, in its order; None when the batch was dead-lettered (one is gone
    or does not decode) or given back to be tried again (a read failed for a reason that says nothing about it)."""
    try:
        return TrainingBatch(d.msg, await fetch_trajectories(plane, d.msg))
    except (MissingMessages, PayloadUnavailable, DecodeError) as e:
        metrics.inc({"rejected_batches": 1})
        await d.refuse(Refusal(BatchRefusal.INVALID if isinstance(e, DecodeError) else BatchRefusal.MISSING, str(e)))
    except Exception as e:  # a timeout, a lost connection
        log.warning("fetching the trajectories of %s failed (%s: %s); trying again", d.msg.batch_id, type(e).__name__, e)
        await d.nak(delay=1.0)
    return None


def _checked_image(run_op: Collective) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The bf16 image of the current weights (a copy) and the names of its tensors holding a NaN or an infinity."""
    state = run_op.state()
    return state, non_finite(state)


async def _keep_alive(d: Delivery[Batch], every_s: float) -> None:
    """Tell the server the batch is still being worked on (a long step must not be redelivered)."""
    while True:
        await asyncio.sleep(every_s)
        with contextlib.suppress(Exception):
            await d.in_progress()
