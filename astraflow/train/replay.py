"""Deterministic replay: retrain the announced versions a restored checkpoint does not hold.

With group commit (``train/group_commit.py``) a trainer may have announced versions c+1..u past its
last durable checkpoint c; their batches are still in the BATCH stream, because a batch is acked only
once a durable checkpoint covers it. On restart, after restoring c, the trainer retrains those batches
in the announced order (each version's ``batch_ids``: the manifest read from the BATCH stream by id,
its trajectories by reference as the loop fetches them) and checks that each replayed version's bf16
state hashes to the announced ``state_digest``. Nothing is announced again.

It stops at the first version it cannot reproduce: an announcement out of the plane's history, a batch
gone from the stream or its trajectories expired, a step that made no update, another digest
(non-deterministic kernels, another thread count, a changed recipe). The caller then falls back to the
announced bf16 weights on the optimizer state replayed so far, and says so (``train/resume.py``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from astraflow.streams.batch_queue import BatchQueue
from astraflow.streams.codec import DecodeError
from astraflow.streams.direct import MissingMessages
from astraflow.streams.messages import Batch, WeightVersion
from astraflow.streams.plane import Plane
from astraflow.streams.trajectories import PayloadUnavailable, TrainingBatch, fetch_trajectories
from astraflow.train.distributed import Collective
from astraflow.weights.delta import state_digest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replayed:
    version: int  # the newest version reproduced exactly (the checkpoint's when none)
    problem: str | None  # why the replay stopped short of the last announcement; None: every digest matched


async def replay(plane: Plane, run_op: Collective, policy: str, restored: int, announced: list[WeightVersion]) -> Replayed:
    """Retrain the batches of ``announced`` (the versions after ``restored``, oldest first) onto the trainer restored at
    ``restored``, checking each version's digest. A failed read of the plane raises (the restart tries again)."""
    manifests: dict[str, Batch] = {}
    for b in await BatchQueue(plane, policy).kept():
        manifests.setdefault(b.batch_id, b)
    version = restored
    for ann in announced:
        if ann.version != version + 1:
            return Replayed(version, f"v{version + 1} is no longer in the plane's announcement history")
        if len(ann.batch_ids) != 1:
            return Replayed(version, f"v{ann.version} names {len(ann.batch_ids)} batches, a trained version has one")
        batch_id = ann.batch_ids[0]
        manifest = manifests.get(batch_id)
        if manifest is None:
            return Replayed(version, f"{batch_id} (v{ann.version}) is no longer in the BATCH stream")
        try:
            batch = TrainingBatch(manifest, await fetch_trajectories(plane, manifest))
        except (MissingMessages, PayloadUnavailable, DecodeError) as e:
            return Replayed(version, f"the trajectories of {batch_id} (v{ann.version}) cannot be read back: {e}")
        step = await asyncio.to_thread(run_op.step, batch)
        if step.get("skipped"):
            return Replayed(version, f"the replayed step of v{ann.version} ({batch_id}) made no update")
        digest = state_digest(await asyncio.to_thread(run_op.state))
        if digest != ann.state_digest:
            return Replayed(version, f"v{ann.version} replayed hashes to {digest[:16]}, announced {ann.state_digest[:16]}")
        version = ann.version
        log.info("%s: replayed v%d (%s): the announced digest", policy, version, batch_id)
    return Replayed(version, None)
