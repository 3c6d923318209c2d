"""Where a trainer starts: version 0, or exactly where its checkpoint and the plane say it stopped.

The plane's last announcement of the policy (``weights.{policy}``) is the truth about which
versions exist; the checkpoint holds the weights, optimizer, RNG and trained batch ids. The
worker writes a checkpoint *before* announcing its version, so after a crash:

* checkpoint v, last announcement v-1 (crashed between the two): announce v now, from the
  checkpoint, as a keyframe; its batch is acked when redelivered;
* checkpoint v, last announcement v: the publisher takes the checkpoint's bf16 image (same
  digest as announced) as the base of the next delta;
* checkpoint v, last announcement u > v (``checkpoint_every`` > 1): the weights of u are read
  back from the plane (bf16), on top of checkpoint v's optimizer state. No version is reused,
  but the fp32 and optimizer progress since v is approximated: only ``checkpoint_every: 1`` is exact.

No announced version is ever published again, and the announcements stay monotonic.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

import torch

from astraflow.streams.messages import WeightVersion
from astraflow.streams.plane import Plane
from astraflow.train.checkpoint import Checkpointer, CheckpointMeta
from astraflow.train.distributed import Collective
from astraflow.weights.delta import state_digest
from astraflow.weights.publish import WeightPublisher
from astraflow.weights.sync import WeightSync

log = logging.getLogger(__name__)


@dataclass
class Start:
    version: int  # the version the trainer holds (already announced)
    trained: list[str]  # batch ids already in these weights, in order


async def last_announcement(plane: Plane, policy: str) -> WeightVersion | None:
    """The newest ``weights.{policy}`` announcement on the plane, or None."""
    return await plane.last(plane.names.weights_stream, plane.names.weights(policy), WeightVersion)


def adopt(publisher: WeightPublisher, state: dict[str, torch.Tensor], last: WeightVersion) -> bool:
    """Make ``state`` (the image of ``last``) the publisher's base for a delta; False if it is not that image."""
    digest = state_digest(state)
    if digest != last.state_digest:
        log.warning("weights %s: restored v%d does not hash to the announced digest; the next version is a keyframe",
                    last.policy, last.version)
        return False
    publisher.image, publisher.image_digest, publisher.image_version = state, digest, last.version
    publisher.keyframe_version = last.keyframe_version
    return True


class _Image:
    """A WeightSync target that just holds the rebuilt bf16 state."""

    def __init__(self) -> None:
        self.version = -1
        self.state: Mapping[str, torch.Tensor] | None = None

    def load_state(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        self.state, self.version = state, version


async def start(plane: Plane, publisher: WeightPublisher, run_op: Collective, ckpt: Checkpointer | None, policy: str) -> Start:
    """Publish version 0, or resume from the newest checkpoint; returns where the trainer stands."""
    found = ckpt.latest() if ckpt else None
    last = await last_announcement(plane, policy)
    if found is None:
        if last is not None:
            log.warning("%s already has v%d on the plane but no checkpoint here: starting again at v0 (pass the same "
                        "--checkpoint-dir to resume)", policy, last.version)
        if ckpt is not None:
            run_op("save", CheckpointMeta(version=0, policy=policy, trained=[]))
        await publisher.publish(run_op("state"), 0, force_keyframe=True)
        return Start(0, [])

    path, meta = found
    run_op("load", path)
    log.info("%s: restored checkpoint v%d (%d batches trained); last announced: %s", policy, meta.version,
             len(meta.trained), "none" if last is None else f"v{last.version}")
    if last is None or last.version < meta.version:  # died between checkpoint and announcement
        if last is not None and last.version < meta.version - 1:
            log.error("%s: the plane's last version is v%d, the checkpoint v%d: versions in between are missing",
                      policy, last.version, meta.version)
        await publisher.publish(run_op("state"), meta.version, meta.last_batch_ids, meta.last_metrics, force_keyframe=True)
        return Start(meta.version, list(meta.trained))
    if last.version == meta.version:
        adopt(publisher, run_op("state"), last)
        return Start(meta.version, list(meta.trained))
    # announced past the checkpoint: take those weights back from the plane
    log.warning("%s: checkpoint v%d is behind the announced v%d (checkpoint_every > 1): resuming from the announced "
                "bf16 weights and the checkpoint's optimizer state", policy, meta.version, last.version)
    image = _Image()
    await WeightSync(plane, policy, image).goto(last.version)
    assert image.state is not None
    run_op("load_weights", dict(image.state))
    adopt(publisher, run_op("state"), last)
    trained = list(meta.trained) + [b for b in last.batch_ids if b not in set(meta.trained)]
    return Start(last.version, trained)
