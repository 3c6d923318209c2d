"""Where a trainer starts: version 0, exactly where its checkpoint and the plane say it stopped, or
a new weight lineage after the plane's newest version. Never under a version number already used.

The plane's last announcement of the policy (``weights.{policy}``) is the truth about which
versions exist; the checkpoint holds the weights, optimizer, RNG, trained batch ids and the
lineage. The worker snapshots a checkpoint every ``checkpoint_every`` versions *before* announcing
that version (and after the announcement of the one before has landed) and writes it in the
background (``train/group_commit.py``), so after a crash:

* checkpoint v, last announcement v-1 (crashed between the two): announce v now, from the
  checkpoint, as a keyframe; its batch is acked when redelivered;
* checkpoint v, last announcement v: the publisher takes the checkpoint's bf16 image (same
  digest as announced) as the base of the next delta;
* checkpoint c, last announcement u > c (versions announced since the last durable checkpoint):
  their batches are still unacked in the BATCH stream; the trainer retrains them in the announced
  order from checkpoint c, announcing nothing, and checks each replayed version against its
  announced digest (``train/replay.py``). All match: the resume is exact, and the replayed image is
  the publisher's base. One does not (or a batch is gone): the announced bf16 weights of u are read
  back from the plane onto the optimizer state replayed so far, and a warning says the resume is
  approximate. Either way a checkpoint of u is written before training goes on, so the redelivered
  batches of c+1..u can be acked untrained.

**Refusals** (:class:`LineageError`; the process exits and says what to do). A trainer whose
weights would not be the announced ones never announces after them:

* no checkpoint, but the plane has versions of the policy (a trainer started without its
  ``--checkpoint-dir``, or with a lost one): starting at v0 would announce v0, v1, … again
  with other weights;
* a checkpoint of another lineage than the plane's newest version, or one of the same version
  whose weights hash to another digest than announced (another trainer announced it).

And while it runs, each announcement must follow the one it read at start, then its own last
(``WeightPublisher.follows``): a second trainer of the policy announcing meanwhile makes the
publish fail (``PublishConflict``), so two trainers never put two states under one number.

**A fresh lineage** is the explicit way out (``astraflow worker trainer --fresh-lineage``): the
trainer starts over from its initial weights (checkpoints ignored) under a new lineage id,
announced as a keyframe at ``newest + 1 + skip`` (``skip``: the trainer's allowed lag, so every
sample rolled out on the abandoned lineage is stale to the new one and dropped, never trained
into it). Versions keep rising; ``trainer.steps`` count from the lineage's first version.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from astraflow.streams.messages import WeightVersion
from astraflow.streams.plane import Plane
from astraflow.streams.weight_channel import WeightChannel
from astraflow.train.checkpoint import Checkpointer, CheckpointMeta
from astraflow.train.distributed import Collective
from astraflow.train.replay import replay
from astraflow.weights.checks import in_order
from astraflow.weights.delta import state_digest
from astraflow.weights.publish import WeightPublisher
from astraflow.weights.sync import WeightSync

log = logging.getLogger(__name__)


class LineageError(RuntimeError):
    """Starting here would announce other weights under version numbers the plane already has."""


@dataclass
class Start:
    version: int  # the version the trainer holds (already announced)
    trained: list[str]  # batch ids already in these weights, in order
    lineage: str  # the weight lineage it continues
    base: int = 0  # the lineage's first version


def new_lineage() -> str:
    return uuid.uuid4().hex[:12]


async def announcements(plane: Plane, publisher: WeightPublisher, policy: str) -> list[WeightVersion]:
    """The ``weights.{policy}`` announcements a node would follow (``checks.in_order``: what a foreign writer put there
    that no trainer could have made does not count), oldest first; the publisher's next announcement must follow
    exactly the subject's last message (a second trainer of the policy that announced meanwhile makes that publish fail)."""
    channel = WeightChannel(plane, policy)
    last = await channel.last_position()
    publisher.follows(last)
    if not last:
        return []
    return in_order(await channel.history(), policy)


def adopt(publisher: WeightPublisher, state: dict[str, torch.Tensor], last: WeightVersion) -> None:
    """Make ``state`` (the image of ``last``) the publisher's base for a delta; refuse if it is not that image."""
    digest = state_digest(state)
    if digest != last.state_digest:
        raise LineageError(f"{last.policy}: the restored v{last.version} does not hash to the announced digest (another trainer "
                           f"announced v{last.version}): resume from that trainer's checkpoints, or start a --fresh-lineage")
    publisher.image, publisher.image_digest, publisher.image_version = state, digest, last.version
    publisher.keyframe_version = last.keyframe_version


class _Image:
    """A WeightSync target that just holds the rebuilt bf16 state."""

    def __init__(self) -> None:
        self.version = -1
        self.state: Mapping[str, torch.Tensor] | None = None

    def load_state(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        self.state, self.version = state, version

    def load_adapter(self, adapters: Mapping[str, torch.Tensor], version: int, spec: object) -> None:
        self.load_state(adapters, version)  # a LoRA version's adapters, as the trainer holds them


async def start(plane: Plane, publisher: WeightPublisher, run_op: Collective, ckpt: Checkpointer | None, policy: str,
                fresh_lineage: bool = False, skip: int = 0, lora_scale: float | None = None, built_digest: str | None = None) -> Start:
    """Publish the first version of a lineage, or resume from the newest checkpoint; returns where the trainer stands.
    ``lora_scale``: a LoRA model's, whose versions may be its adapters (``run_op.base()`` is then their base, whose digest
    is ``built_digest`` when it is the model the recipe builds)."""
    history = await announcements(plane, publisher, policy)

    async def adapt() -> None:  # once the weights are those the trainer starts from
        base = run_op.base() if lora_scale is not None else None
        if base is not None and lora_scale is not None:
            spec = await publisher.adapt(base, lora_scale, built_digest, history)
            log.info("%s: versions are LoRA adapters over base %s (%s)", policy, spec.base_digest[:12],
                     "nodes build it" if spec.base is None else f"stored, {spec.base.size} B")
    found = None if fresh_lineage else (ckpt.latest() if ckpt else None)
    if found is None:
        return await _first(publisher, run_op, ckpt, policy, history[-1] if history else None, fresh_lineage, skip, adapt)
    return await _resume(plane, publisher, run_op, policy, found, history, adapt)


async def _first(publisher: WeightPublisher, run_op: Collective, ckpt: Checkpointer | None, policy: str, last: WeightVersion | None,
                 fresh_lineage: bool, skip: int, adapt: Callable[[], Awaitable[None]]) -> Start:
    """No checkpoint to resume from: v0 of the run, or (``fresh_lineage``) a new lineage after the plane's newest."""
    if last is not None and not fresh_lineage:
        raise LineageError(f"{policy} is at v{last.version} on the plane (lineage {last.lineage or '-'}) and this trainer has no "
                           "checkpoint of it: starting at v0 would announce those versions again with other weights. Pass "
                           "the --checkpoint-dir it ran with to resume, or --fresh-lineage to start a new lineage after "
                           f"v{last.version}")
    base = 0 if last is None else last.version + 1 + skip
    lineage = publisher.lineage = new_lineage()
    if last is not None:
        log.warning("%s: a fresh lineage %s at v%d, after v%d of lineage %s", policy, lineage, base, last.version, last.lineage or "-")
    if ckpt is not None:
        run_op.save(CheckpointMeta(version=base, policy=policy, trained=[], lineage=lineage, lineage_base=base))
    await adapt()
    await publisher.publish(run_op.state(), base, force_keyframe=True)
    return Start(base, [], lineage, base)


async def _resume(plane: Plane, publisher: WeightPublisher, run_op: Collective, policy: str, found: tuple[Path, CheckpointMeta],
                  history: list[WeightVersion], adapt: Callable[[], Awaitable[None]]) -> Start:
    """From the checkpoint ``found``: announced again if the plane never got it, adopted if it is the plane's newest, or
    caught up to the newest (:func:`_catch_up`)."""
    path, meta = found
    last = history[-1] if history else None
    lineage = publisher.lineage = meta.lineage or (last.lineage if last is not None else "")
    if last is not None and meta.lineage and last.lineage and last.lineage != meta.lineage:
        raise LineageError(f"{policy}: the checkpoint is v{meta.version} of lineage {meta.lineage}, the plane's newest is "
                           f"v{last.version} of lineage {last.lineage}: resume with that lineage's checkpoints, or start a "
                           "--fresh-lineage")
    run_op.load(path)
    await adapt()
    log.info("%s: restored checkpoint v%d of lineage %s (%d batches trained); last announced: %s", policy, meta.version,
             lineage or "-", len(meta.trained), "none" if last is None else f"v{last.version}")
    at = Start(meta.version, list(meta.trained), lineage, meta.lineage_base)
    if last is None or last.version < meta.version:  # died between checkpoint and announcement
        if last is not None and last.version < meta.version - 1:
            log.error("%s: the plane's last version is v%d, the checkpoint v%d: versions in between are missing",
                      policy, last.version, meta.version)
        await publisher.publish(run_op.state(), meta.version, meta.last_batch_ids, meta.last_metrics, force_keyframe=True)
        return at
    if last.version == meta.version:
        adopt(publisher, run_op.state(), last)
        return at
    return await _catch_up(plane, publisher, run_op, policy, meta, history, last, lineage)


async def _catch_up(plane: Plane, publisher: WeightPublisher, run_op: Collective, policy: str, meta: CheckpointMeta,
                    history: list[WeightVersion], last: WeightVersion, lineage: str) -> Start:
    """Announced past the checkpoint: retrain those versions' batches, checking every digest; where one differs, the
    announced bf16 weights of the newest version go onto the optimizer state reached."""
    announced = [a for a in history if a.version > meta.version and a.lineage == last.lineage]
    done = await replay(plane, run_op, policy, meta.version, announced)
    if done.problem is None:
        log.info("%s: replayed v%d..v%d onto checkpoint v%d: every digest is the announced one, the resume is exact",
                 policy, meta.version + 1, last.version, meta.version)
    else:
        log.warning("%s: the resume is approximate: %s. Replayed to v%d; the announced bf16 weights of v%d now sit on that "
                    "optimizer state", policy, done.problem, done.version, last.version)
        image = _Image()
        await WeightSync(plane, policy, image).goto(last.version)
        assert image.state is not None
        run_op.load_weights(dict(image.state))
    adopt(publisher, run_op.state(), last)
    known = set(meta.trained)
    trained = list(meta.trained) + [b for a in announced for b in a.batch_ids if b not in known]
    run_op.save(CheckpointMeta(version=last.version, policy=policy, trained=trained, last_batch_ids=list(last.batch_ids),
                                  last_metrics=dict(last.metrics), lineage=lineage, lineage_base=meta.lineage_base))
    return Start(last.version, trained, lineage, meta.lineage_base)
