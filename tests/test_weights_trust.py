"""The weight plane at its trust boundary, against a real nats-server: a trainer never publishes
non-finite weights, and a node dead-letters announcements that are impossible on their face
(with their original bytes and the reason), keeps its weights, and still follows the real ones."""

from __future__ import annotations

import math

import pytest
from weights_helpers import Trainer, engine_digest, node

from astraflow.streams.codec import decode
from astraflow.streams.messages import Rejected, WeightVersion
from astraflow.streams.plane import Plane, PublishConflict
from astraflow.streams.weight_channel import WeightChannel
from astraflow.weights.publish import NonFiniteWeights, WeightPublisher


async def test_non_finite_weights_are_never_published(plane: Plane):
    trainer = Trainer()
    pub = WeightPublisher(plane, "solver")
    await pub.publish(trainer.model.state_dict(), 0)
    state = {k: v.clone() for k, v in trainer.step().items()}
    next(iter(state.values()))[0] = math.nan
    with pytest.raises(NonFiniteWeights, match="hold NaN or inf"):
        await pub.publish(state, 1)
    assert [a.version for a in await plane.history(plane.names.weights("solver"), WeightVersion)] == [0]
    assert pub.image_version == 0
    assert await plane.stored.stream_msgs(f"OBJ_{plane.names.object_bucket}") == 2  # v0's chunk and metadata only


async def test_a_node_dead_letters_impossible_announcements_and_follows_the_real_ones(plane: Plane):
    trainer = Trainer()
    pub = WeightPublisher(plane, "solver", keyframe_every=100)
    v = [await pub.publish(trainer.step() if i else trainer.model.state_dict(), i) for i in range(4)]
    sync = node(plane)
    await sync.wait_for(2, timeout=10)
    ref = v[2].objects[0]
    forged = {  # published after v3 (by someone with the trainer's rights), while the node still holds v2
        "announced again with another state": v[3].model_copy(update={"state_digest": v[1].state_digest}),
        "v1 announced after v3": v[1],
        "applies onto v4, not an earlier version": v[2].model_copy(update={"version": 4, "base_version": 4}),
        "names keyframe_version 9": v[0].model_copy(update={"version": 5, "keyframe_version": 9}),
        "1 chunk digests for": v[2].model_copy(update={"version": 6, "objects": [ref.model_copy(update={"size": ref.chunk_size * 3})]}),
        "of policy 'critic'": v[2].model_copy(update={"version": 7, "policy": "critic"}),
    }
    for ann in forged.values():
        await plane.publish(plane.names.weights("solver"), ann)
    await sync.wait_for(3, timeout=10)
    for _ in range(50):  # every forged one arrives and is judged
        if sync.stats["rejected"] == len(forged):
            break
        await sync.refresh(wait=0.2)
    assert sync.version == 3 and engine_digest(sync) == trainer.digest and sync.stats["rejected"] == len(forged)
    rejected = await plane.history(plane.names.dlq("weights"), Rejected)
    assert len(rejected) == len(forged)
    for (expected, ann), rej in zip(forged.items(), rejected, strict=True):
        assert expected in rej.reason and rej.subject == plane.names.weights("solver")
        assert decode(rej.payload, WeightVersion) == ann  # the original bytes, kept for the operator
    ann = await pub.publish(trainer.step(), 4)  # the trainer steps over what no trainer could have made (a rival stops it:
    assert ann.version == 4 and ann.base_version == 3  # test_two_trainers_of_one_policy_never_announce_one_version_twice)
    await sync.wait_for(4, timeout=10)
    assert engine_digest(sync) == trainer.digest


async def test_two_trainers_of_one_policy_never_announce_one_version_twice(plane: Plane):
    first, second = WeightPublisher(plane, "solver"), WeightPublisher(plane, "solver")
    a, b = Trainer(seed=1), Trainer(seed=2)
    await first.publish(a.model.state_dict(), 0)
    first.follows(await WeightChannel(plane, "solver").last_position())
    second.follows(await WeightChannel(plane, "solver").last_position())  # both resume from v0
    v1 = await first.publish(a.step(), 1)
    with pytest.raises(PublishConflict):
        await second.publish(b.step(), 1)
    third = WeightPublisher(plane, "solver")  # a rival that holds v1's weights too (same checkpoint)
    third.image, third.image_digest, third.image_version = first.image, first.image_digest, 1
    third.follows(await WeightChannel(plane, "solver").last_position())
    await first.publish(a.step(), 2)
    with pytest.raises(PublishConflict):  # a possible newer version is another trainer's: never stepped over
        await third.publish(b.step(), 2)
    anns = await plane.history(plane.names.weights("solver"), WeightVersion)
    assert [x.version for x in anns] == [0, 1, 2] and anns[1] == v1 and anns[2].state_digest == a.digest


async def test_the_history_skips_impossible_announcements_when_planning(plane: Plane):
    trainer = Trainer()
    pub = WeightPublisher(plane, "solver", keyframe_every=100)
    v = [await pub.publish(trainer.step() if i else trainer.model.state_dict(), i) for i in range(2)]
    await plane.publish(plane.names.weights("solver"), v[1].model_copy(update={"version": 2, "base_version": 5}))
    late = node(plane)
    await late.goto(1)  # a late joiner plans from the history: the impossible one is skipped, not applied
    assert late.version == 1 and late.stats["skipped_history"] == 1 and engine_digest(late) == trainer.digest
