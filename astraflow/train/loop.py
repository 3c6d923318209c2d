"""The trainer's loop on rank 0 (``TrainerLoop``): pull batches for one policy, vet, step, publish the new version behind
the next step, checkpoint in groups, ack.

One trainer per policy; each has its own durable consumer (``trainer-{policy}``) and weight
subject, and none waits for another. Per batch, in this order:

1. vet (``train/vetting.py``): a redelivered batch whose id is already trained is acked
   without training; a manifest the dataflow did not plan (no plan record, or another content)
   is dead-lettered with its reason, untrained; the trajectories a well-formed one names are read from
   the TRAJ stream by sequence (batched, offloaded arrays resolved) while its plan record is, each checked to be the one
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
from concurrent.futures import Executor

import torch

from astraflow.config import Recipe
from astraflow.metrics import Metrics, serving
from astraflow.role import Role
from astraflow.runtime import cancel_and_wait, crash_point
from astraflow.streams.batch_queue import BatchQueue
from astraflow.streams.codec import DecodeError
from astraflow.streams.direct import MissingMessages
from astraflow.streams.messages import HEARTBEAT_PERIOD_S, Batch, BatchRefusal, Heartbeat, Refusal, Suspect, TrainerStats
from astraflow.streams.plane import Delivery, Plane
from astraflow.streams.state import DoneRecord, StateReadError
from astraflow.streams.trajectories import PayloadUnavailable, TrainingBatch, fetch_batch
from astraflow.train.checkpoint import Checkpointer, CheckpointMeta
from astraflow.train.distributed import Collective
from astraflow.train.group_commit import GroupCommit
from astraflow.train.resume import start
from astraflow.train.vetting import allowed_lag, check_batch, check_manifest, check_plan, suspects_of
from astraflow.weights.finite import FiniteState, checked
from astraflow.weights.publish import WeightPublisher

log = logging.getLogger(__name__)
KEYFRAME_CHECK_S = 2.0  # while waiting for batches, how often a keyframe request is looked for


class TrainerLoop:
    """Rank 0's loop for one policy, in the order above: ``run`` starts (resume or a fresh v0), then per batch
    ``_pull``, ``_vet``, ``_train``; then finishes (everything trained durable and acked)."""

    def __init__(self, recipe: Recipe, policy: str, role: Role, run_op: Collective, ckpt: Checkpointer | None, vocab: int,
                 fresh_lineage: bool, built_digest: str | None = None, writer: Executor | None = None) -> None:
        self.recipe, self.policy, self.role, self.run_op, self.ckpt = recipe, policy, role, run_op, ckpt
        self.writer = writer  # the thread checkpoints are written on (``GroupCommit``)
        self.cfg = recipe.policies[policy].trainer
        self.vocab, self.fresh_lineage = vocab, fresh_lineage
        self.built_digest = built_digest  # of the model as the recipe builds it (LoRA: nodes hold that base themselves)
        self.plane: Plane = role.plane
        self.metrics = role.metrics or Metrics("trainer", policy=policy, worker=role.worker_id)
        self.max_lag = allowed_lag(recipe)
        self.publisher = WeightPublisher(self.plane, policy, keyframe_every=self.cfg.keyframe_every,
                                         keep_versions=recipe.plane.weights_history, mirror_domains=tuple(recipe.plane.mirror_domains))
        self.version, self.trained, self.seen = 0, list[str](), set[str]()
        self.last: dict[str, float] = {}  # the last step's figures (heartbeats, checkpoints)
        self.last_ids: list[str] = []
        self.last_suspects: list[Suspect] = []  # what the last step's token check left out, announced with its version
        self.waited, self.started, self.asked_at = 0.0, time.monotonic(), time.monotonic()

    # ------------------------------------------------------------ start and finish
    async def run(self) -> None:
        lora = self.cfg.lora
        at = await start(self.plane, self.publisher, self.run_op, self.ckpt, self.policy, self.fresh_lineage, skip=self.max_lag,
                         lora_scale=lora.alpha / lora.rank if lora is not None else None, built_digest=self.built_digest)
        self.lineage, self.base, self.version, self.trained = at.lineage, at.base, at.version, list(at.trained)
        self.seen = set(self.trained)
        for key, (was, now) in self.run_op.retune().items():  # after the replay, which needs the values it was trained with
            log.warning("%s: trainer.%s is %g in the recipe, %g in the checkpoint: %g from the next step on", self.policy, key,
                        now, was, now)
        cfg = self.cfg
        behind = cfg.publish == "behind" or (cfg.publish == "auto" and self.run_op.backend.device.type != "cpu")
        self.commits = GroupCommit(self.run_op, self.ckpt, self.publisher, durable=at.version, behind=behind,  # start() left
                                   writer=self.writer)                                                          # a checkpoint of it
        self.metrics.set({"version": self.version})
        self.role.every(HEARTBEAT_PERIOD_S, self.beat)
        self.batches = BatchQueue(self.plane, self.policy).pull()
        self.keepalive_s = max((await self.batches.settings()).ack_wait / 3, 0.2)
        end = self.base + cfg.steps
        log.info("trainer %s at v%d of lineage %s, training to v%d (%s backend, %s loss, checkpoint every %d versions, publish %s)",
                 self.policy, self.version, self.lineage or "-", end, cfg.backend, cfg.loss.type, cfg.checkpoint_every,
                 "behind the next step" if behind else "inline")
        settled = False
        try:
            while self.version < end and not self.role.stop.is_set():
                await self.commits.settle()
                d = await self._pull()
                reading = await self._vet(d) if d is not None else None
                if d is not None and reading is not None:
                    await self._train(d, reading)
            await self.commits.finish(self.meta_now())  # finished or stopped: the publish in flight landed, all durable, all acked
            settled = True
            if self.version >= end:  # finished, not stopped
                await self.plane.state.put(DoneRecord(policy=self.policy, version=self.version))
        finally:
            if not settled:
                await self.commits.abandon()

    def meta_now(self) -> CheckpointMeta:
        """What a checkpoint of the current version holds (copies: the loop goes on while it is written)."""
        return CheckpointMeta(version=self.version, policy=self.policy, trained=list(self.trained), last_batch_ids=list(self.last_ids),
                              last_metrics=dict(self.last), lineage=self.lineage, lineage_base=self.base)

    async def beat(self) -> None:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        stats = TrainerStats(wait_s=self.waited, wait_frac=self.waited / elapsed, bytes_sent=self.publisher.bytes_sent, step=self.last)
        await self.plane.beat(Heartbeat(worker_id=self.role.worker_id, policy=self.policy, version=self.version, stats=stats,
                                        metrics=serving()))

    # ------------------------------------------------------------ one batch
    async def _pull(self) -> Delivery[Batch] | None:
        """The next batch, its wait measured; none within a second (then a keyframe request is answered, now and then:
        a node that lost its chain would wait for the next version forever)."""
        t0 = time.monotonic()
        got = await self.batches.pull(batch=1, timeout=1.0)
        self.wait = time.monotonic() - t0
        self.waited += self.wait
        self.metrics.inc({"wait_seconds": self.wait})
        if not got and time.monotonic() - self.asked_at >= KEYFRAME_CHECK_S:
            self.asked_at = time.monotonic()
            await self.commits.answer_keyframe_request()
        return got[0] if got else None

    async def _vet(self, d: Delivery[Batch]) -> asyncio.Task[TrainingBatch] | None:
        """The read of the manifest's trajectories when it is one to train: not trained already (then acked, or left to
        the group commit that holds it), planned and well-formed (else dead-lettered); a plan that cannot be read gives
        the batch back. A well-formed manifest's trajectories are read while its plan record is: one round trip on the
        way to the step, not two (a manifest the plan refuses has its read dropped, unused)."""
        manifest = d.msg
        if manifest.batch_id in self.seen:  # trained before a crash that came before its ack, or held here
            if not self.commits.redelivered(d, asyncio.create_task(_keep_alive(d, self.keepalive_s))):
                log.info("%s was trained before the restart: ack without training", manifest.batch_id)
                self.metrics.inc({"redelivered_trained_batches": 1})
                await d.ack()
            return None
        malformed = check_manifest(manifest, self.policy)
        reading = None if malformed else asyncio.create_task(fetch_batch(self.plane, manifest))
        try:
            refused = await check_plan(self.plane, self.policy, manifest) or malformed
        except StateReadError as e:  # the plan could not be read: neither train nor turn it away
            log.warning("%s: %s; trying again", manifest.batch_id, e)
            await _dropped(reading)
            await d.nak(delay=1.0)
            return None
        except BaseException:
            await _dropped(reading)
            raise
        if refused is not None:
            await _dropped(reading)
            self.metrics.inc({"rejected_batches": 1})
            await d.refuse(refused)
            return None
        assert reading is not None  # a manifest with no plan refusal is well-formed here
        return reading

    async def _train(self, d: Delivery[Batch], reading: asyncio.Task[TrainingBatch]) -> None:
        """The trajectories ``reading`` fetches, checked, a step; then the image of the new version, a checkpoint when one
        is due, and its publication, which takes the batch over (acked once a durable checkpoint covers it)."""
        keep = asyncio.create_task(_keep_alive(d, self.keepalive_s))
        handed = False  # to the group commit, which acks it or stops its keep-alive
        try:
            t_fetch = time.monotonic()
            batch = await _fetched(reading, d, self.metrics)
            if batch is None:
                return
            fetch_s = time.monotonic() - t_fetch
            self.metrics.inc({"fetch_seconds": fetch_s})
            step = await self._step(d, batch)
            if step is None:
                return
            state = await self._new_version(d, batch, step, fetch_s)
            if self.ckpt is not None and self.version % self.cfg.checkpoint_every == 0:
                await self.commits.checkpoint(self.meta_now())  # after the announcement of v-1 has landed
            await self.commits.publish(state, self.version, self.last_ids, self.last, d, keep,  # in the background, after v-1's
                                       suspects=self.last_suspects)
            handed = True
        finally:
            if not handed:
                keep.cancel()
        log.info("v%d %s loss %.4f reward %.3f wait %.0f%% (v%s announced, %d held)", self.version, batch.batch_id, step["loss"],
                 step["reward_mean"], 100 * self.last["wait_frac"], self.publisher.image_version, self.commits.held)

    async def _step(self, d: Delivery[Batch], batch: TrainingBatch) -> dict[str, float] | None:
        """The batch's trajectories checked, then one optimizer step; None when the batch was turned away instead (a
        check failed, the step raised, or its loss or gradient norm was not finite: the backend made no update)."""
        refused = check_batch(batch, self.vocab, self.version, self.max_lag)
        if refused is not None:
            self.metrics.inc({"rejected_batches": 1})
            await d.refuse(refused)
            return None
        try:
            step = await asyncio.to_thread(self.run_op.step, batch)
        except Exception as e:
            log.exception("step on %s failed", batch.batch_id)
            await d.refuse(Refusal(BatchRefusal.STEP_FAILED, str(e)))
            return None
        if step.get("skipped"):
            self.metrics.inc({"skipped_steps": 1})
            await d.refuse(Refusal(BatchRefusal.NON_FINITE, f"loss {step['loss']}, gradient norm {step['grad_norm']}: no update made"))
            return None
        return step

    async def _new_version(self, d: Delivery[Batch], batch: TrainingBatch, step: dict[str, float],
                           fetch_s: float) -> dict[str, torch.Tensor]:
        """Count the step as version v+1 and take its bf16 image (a copy: what gets announced); weights that turned
        non-finite stop the trainer before anything is written (not the data's doing: the step was finite and clipped)."""
        crash_point("after_step", self.version + 1)
        self.version += 1
        self.trained.append(batch.batch_id)
        self.seen.add(batch.batch_id)
        self.last = {**step, "wait_frac": self.waited / (time.monotonic() - self.started), "batch_wait_s": self.wait, "fetch_s": fetch_s}
        self.metrics.set({**self.last, "version": self.version})  # with the heartbeat's figures, before the version is published
        self.metrics.inc({"trained_tokens": step["tokens"], "trained_batches": 1})
        self.last_ids = [batch.batch_id]
        self.last_suspects = suspects_of(batch, self.run_op.backend.suspects)
        state, bad = await asyncio.to_thread(_checked_image, self.run_op)
        if bad:
            await d.refuse(Refusal(BatchRefusal.NON_FINITE, f"the weights after the step hold NaN or inf ({', '.join(bad[:3])})"))
            raise RuntimeError(f"{self.policy} weights turned non-finite after {batch.batch_id}; nothing was checkpointed or "
                               "announced: a restart resumes from the last checkpoint")
        assert state is not None  # found finite
        return state


async def _fetched(reading: asyncio.Task[TrainingBatch], d: Delivery[Batch], metrics: Metrics) -> TrainingBatch | None:
    """The trajectories the manifest names, whole, in its order (``reading``: :func:`fetch_batch`); None when the batch
    was dead-lettered (one is gone or does not decode) or given back to be tried again (a read failed for a reason that
    says nothing about it)."""
    try:
        return await reading
    except (MissingMessages, PayloadUnavailable, DecodeError) as e:
        metrics.inc({"rejected_batches": 1})
        await d.refuse(Refusal(BatchRefusal.INVALID if isinstance(e, DecodeError) else BatchRefusal.MISSING, str(e)))
    except Exception as e:  # a timeout, a lost connection
        log.warning("fetching the trajectories of %s failed (%s: %s); trying again", d.msg.batch_id, type(e).__name__, e)
        await d.nak(delay=1.0)
    return None


async def _dropped(reading: asyncio.Task[TrainingBatch] | None) -> None:
    """A read of trajectories that will not be trained: stopped, whatever it had come to."""
    if reading is not None:
        await cancel_and_wait(reading)


def _checked_image(run_op: Collective) -> tuple[FiniteState | None, list[str]]:
    """The bf16 image of the current weights (a copy), as a ``FiniteState`` when every weight is finite (the publisher
    then stores it without checking it again), else None and the names of its tensors holding a NaN or an infinity."""
    return checked(run_op.state())


async def _keep_alive(d: Delivery[Batch], every_s: float) -> None:
    """Tell the server the batch is still being worked on (a long step must not be redelivered)."""
    while True:
        await asyncio.sleep(every_s)
        with contextlib.suppress(Exception):
            await d.in_progress()
