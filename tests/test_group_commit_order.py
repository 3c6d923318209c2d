"""The order the group commit keeps while version v is published behind the step of v+1, in one process on a real
nats-server with a real model: the announced weights are those after step v, a batch is held only once its version's
announcement has landed, a snapshot waits for the announcement in flight, and a failed publish surfaces, holds nothing
and announces nothing after it."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
from test_train_support import make_batches, publish_batches, write_recipe

from astraflow.models import build_model, load_tokenizer
from astraflow.streams.messages import Batch, WeightVersion
from astraflow.streams.objects import chunk_subject, object_stream
from astraflow.streams.plane import Delivery, NatsOptions, Plane, PublishConflict
from astraflow.streams.trajectories import TrainingBatch
from astraflow.streams.weight_channel import WeightChannel
from astraflow.train.checkpoint import Checkpointer, CheckpointMeta
from astraflow.train.distributed import Collective
from astraflow.train.group_commit import GroupCommit
from astraflow.train.threads import background_executor
from astraflow.train.torch_backend import TorchBackend
from astraflow.weights.delta import state_digest
from astraflow.weights.publish import NonFiniteWeights, WeightPublisher, request_keyframe

pytestmark = pytest.mark.timeout(120)


class Trainer:
    """The parts of a trainer the group commit works with: a backend, its checkpoints, a publisher at v0, its batches."""

    def __init__(self, plane: Plane, tmp_path, steps: int = 3) -> None:
        _, self.recipe = write_recipe(tmp_path / "recipe.yaml", steps=steps)
        pcfg = self.recipe.policies["solver"]
        tok = load_tokenizer(pcfg.model.tokenizer)
        self.backend = TorchBackend(build_model(pcfg.model, tok), tok, pcfg.trainer)
        self.ckpt = Checkpointer(tmp_path / "ckpt")
        self.publisher = WeightPublisher(plane, "solver")
        self.writer = background_executor(None, "checkpoint-writer")
        self.commits = GroupCommit(Collective(self.backend, self.ckpt), self.ckpt, self.publisher, durable=0, writer=self.writer)
        self.writes: list[str] = []  # the threads checkpoints were written on
        write = self.ckpt.write
        self.ckpt.write = lambda snap: (self.writes.append(threading.current_thread().name), write(snap))[1]  # type: ignore[method-assign]
        self.plane, self.steps = plane, steps
        self.trained: dict[str, TrainingBatch] = {}

    async def start(self) -> Trainer:
        await self.plane.ensure_topology(self.recipe.topology())
        self.ckpt.save(self.backend, CheckpointMeta(version=0, policy="solver", trained=[]))
        await self.publisher.publish(self.backend.state_dict_bf16(), 0, force_keyframe=True)
        for b in await publish_batches(self.plane, make_batches(self.recipe, "solver", self.steps)):
            self.trained[b.batch_id] = b
        self.batches = self.plane.consumer(self.plane.names.batch_stream, self.plane.names.trainer_consumer("solver"), Batch)
        return self

    async def step(self) -> tuple[Delivery[Batch], asyncio.Task[None], dict]:
        """Pull the next batch and step it; (delivery, its keep-alive, the bf16 image after the step)."""
        (d,) = await self.batches.pull(batch=1, timeout=10.0)
        self.backend.step(self.trained[d.msg.batch_id])
        return d, asyncio.create_task(keep_alive(d)), self.backend.state_dict_bf16()

    async def announced(self) -> list[int]:
        return [a.version for a in await self.plane.history(self.plane.names.weights("solver"), WeightVersion)]

    async def unacked(self) -> set[str]:
        return {b.batch_id for _, b in await self.plane.stored.held(self.plane.names.batch_stream, self.plane.names.batch("solver"), Batch)}


async def keep_alive(d: Delivery[Batch]) -> None:
    while True:
        await asyncio.sleep(0.5)
        await d.in_progress()


@pytest.fixture
async def run_plane(nats_server, run_id):
    plane = await Plane.connect(NatsOptions(url=nats_server.url), run_id, "test")
    yield plane
    await plane.close()


async def test_a_version_is_published_behind_the_next_step_in_order(run_plane: Plane, tmp_path):
    t = await Trainer(run_plane, tmp_path).start()
    c = t.commits
    d1, keep1, image1 = await t.step()
    await c.publish(image1, 1, [d1.msg.batch_id], {}, d1, keep1)
    assert c.held == 0  # not before its announcement has landed
    d2, keep2, image2 = await t.step()  # the live weights move on while v1 is published
    meta2 = CheckpointMeta(version=2, policy="solver", trained=[d1.msg.batch_id, d2.msg.batch_id])
    await c.checkpoint(meta2)  # a snapshot of v2 waits for the announcement of v1
    assert await t.announced() == [0, 1] and c.held == 1
    await c.publish(image2, 2, [d2.msg.batch_id], {}, d2, keep2)
    await c.finish(meta2)  # the publish in flight lands, the snapshot of v2 is durable: both batches acked
    assert await t.announced() == [0, 1, 2] and c.held == 0 and c.durable == 2
    assert await t.unacked() == set(t.trained) - {d1.msg.batch_id, d2.msg.batch_id}
    v1, v2 = (await run_plane.history(run_plane.names.weights("solver"), WeightVersion))[1:]
    assert v1.state_digest == state_digest(image1) != state_digest(image2) == v2.state_digest  # the weights after each step
    assert v2.encoding == "delta" and v2.base_digest == v1.state_digest
    latest = t.ckpt.latest()
    assert latest is not None and latest[1].version == 2
    assert len(t.writes) == 1 and t.writes[0].startswith("checkpoint-writer")  # off the loop's threads


async def test_an_inline_publish_returns_with_the_version_announced_and_its_batch_held(run_plane: Plane, tmp_path):
    """``trainer.publish: inline`` (a CPU trainer): nothing of the publish is left to run beside the next step."""
    t = await Trainer(run_plane, tmp_path).start()
    c = t.commits
    c.behind = False
    for v in (1, 2):
        d, keep, image = await t.step()
        await c.publish(image, v, [d.msg.batch_id], {}, d, keep)
        assert await t.announced() == list(range(v + 1)) and c.held == v and c._publishing is None
    meta = CheckpointMeta(version=2, policy="solver", trained=[])
    await c.finish(meta)
    assert c.held == 0 and c.durable == 2


async def test_a_failed_publish_surfaces_holds_nothing_and_announces_nothing_after_it(run_plane: Plane, tmp_path):
    t = await Trainer(run_plane, tmp_path).start()
    c = t.commits
    d1, keep1, image1 = await t.step()
    rival = WeightPublisher(run_plane, "solver")  # another trainer of the policy announces v1 first
    rival.follows(await WeightChannel(run_plane, "solver").last_position())
    await rival.publish(image1, 1, force_keyframe=True)
    await c.publish(image1, 1, [d1.msg.batch_id], {}, d1, keep1)
    d2, keep2, image2 = await t.step()
    with pytest.raises(PublishConflict):
        await c.publish(image2, 2, [d2.msg.batch_id], {}, d2, keep2)  # v1's failure stops it before v2 is stored
    await asyncio.sleep(0)  # let the cancelled keep-alive finish
    assert keep1.cancelled() and c.held == 0 and t.publisher.image_version == 0
    assert await t.announced() == [0, 1] and d1.msg.batch_id in await t.unacked()  # the rival's v1 only; batch unacked

    poisoned = {k: v.clone() for k, v in image2.items()}
    next(iter(poisoned.values())).view(-1)[0] = math.nan
    fresh = WeightPublisher(run_plane, "solver")  # a restarted trainer, behind the rival's v1
    fresh.follows(await WeightChannel(run_plane, "solver").last_position())
    c = GroupCommit(Collective(t.backend, t.ckpt), t.ckpt, fresh, durable=0)
    await c.publish(poisoned, 2, [d2.msg.batch_id], {}, d2, keep2)
    with pytest.raises(NonFiniteWeights):
        async with asyncio.timeout(30):  # the loop's settle takes the outcome once the publish ended
            while True:
                await c.settle()
                await asyncio.sleep(0.01)
    await asyncio.sleep(0)
    assert keep2.cancelled() and c.held == 0 and await t.announced() == [0, 1]


async def test_answering_a_keyframe_request_while_idle_never_hides_a_failed_publish(run_plane: Plane, tmp_path):
    """The idle trainer answers a keyframe request (v0 announced again as a keyframe, its first payload deleted, the new
    one kept), and the answer first takes the outcome of the publish in flight: a failure raises, as from ``settle``
    (swallowed, the version's batch would be acked as trained with the version never announced)."""
    t = await Trainer(run_plane, tmp_path).start()
    c = t.commits
    assert await c.answer_keyframe_request() is None  # nothing asked
    await request_keyframe(run_plane, "solver", "a node lost its chain")
    first = (await run_plane.history(run_plane.names.weights("solver"), WeightVersion))[0]
    again = await c.answer_keyframe_request()
    assert again is not None and (again.version, again.encoding, again.state_digest) == (0, "keyframe", first.state_digest)
    assert again.objects[0].name == first.objects[0].name and again.objects[0].nuid != first.objects[0].nuid
    await t.publisher.keeper.wait()
    bucket = run_plane.names.object_bucket
    info = await run_plane._jsm.stream_info(object_stream(bucket), subjects_filter=f"$O.{bucket}.>")
    held = set(info.state.subjects or {})
    assert chunk_subject(bucket, again.objects[0].nuid) in held and chunk_subject(bucket, first.objects[0].nuid) not in held
    assert any(".M." in s for s in held)  # the name's metadata stays: it names the new payload
    assert await c.answer_keyframe_request() is None  # served once

    d1, keep1, image1 = await t.step()
    rival = WeightPublisher(run_plane, "solver")
    rival.follows(await WeightChannel(run_plane, "solver").last_position())
    await rival.publish(image1, 1, force_keyframe=True)
    await c.publish(image1, 1, [d1.msg.batch_id], {}, d1, keep1)
    with pytest.raises(PublishConflict):
        await c.answer_keyframe_request()
    assert c.held == 0 and d1.msg.batch_id in await t.unacked()
