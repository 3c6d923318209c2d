"""The weight plane against a real nats-server with a real (tiny) transformers model and AdamW.

Trainer side: keyframe/delta decisions, keyframe requests, the announcement as the commit point,
retention. RaaS side: deltas applied only onto their exact base, in place into the hf engine;
late joiners, foreign bases, corrupt and missing chunks fall back to the keyframe chain.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import NoStreamResponseError
from weights_helpers import Trainer, engine_digest, node, tiny_model

from astraflow.rollout.engines.hf import HFEngine
from astraflow.streams.messages import ObjectRef, WeightVersion
from astraflow.streams.objects import (
    CorruptObject,
    MissingObject,
    chunk_subject,
    count_chunks,
    get_object,
    object_stream,
    owner_tag,
    put_object,
    read_one_chunk_object,
)
from astraflow.streams.plane import NatsOptions, Plane, PublishConflict, PublishRefused, Topology
from astraflow.streams.state import KeyframeRequest, VersionRecord
from astraflow.streams.weight_channel import WeightChannel
from astraflow.train.resume import adopt
from astraflow.weights.delta import to_bf16_state
from astraflow.weights.publish import WeightPublisher, request_keyframe, written
from astraflow.weights.retention import chain_of, key_of, plan_retention, walk_chain
from astraflow.weights.sync import WeightSync, WeightSyncError


async def publish_steps(pub: WeightPublisher, trainer: Trainer, versions: range) -> list[WeightVersion]:
    return [await pub.publish(trainer.step() if v else trainer.model.state_dict(), v) for v in versions]


async def rewrite_chunks(plane: Plane, ref: ObjectRef, corrupt: int | None = None, drop: int | None = None) -> None:
    """Tamper with an object on the server: flip a byte of chunk ``corrupt``, leave out chunk ``drop``."""
    bucket = plane.names.object_bucket
    data = bytes(await plane.objects().get(ref))
    subject = chunk_subject(bucket, ref.nuid)
    await plane._jsm.purge_stream(object_stream(bucket), subject=subject)
    for i in range(len(ref.digests)):
        chunk = bytearray(data[i * ref.chunk_size : (i + 1) * ref.chunk_size])
        if i == corrupt:
            chunk[len(chunk) // 2] ^= 0xFF
        if i != drop:
            await plane._js.publish(subject, bytes(chunk))


# ------------------------------------------------------------------------------ trainer side


async def test_keyframe_delta_decisions_and_announcements(plane: Plane):
    trainer = Trainer()
    pub = WeightPublisher(plane, "solver", keyframe_every=4)
    anns = await publish_steps(pub, trainer, range(6))
    assert [a.encoding for a in anns] == ["keyframe", "delta", "delta", "delta", "keyframe", "delta"]
    assert [a.keyframe_version for a in anns] == [0, 0, 0, 0, 4, 4]
    for prev, a in itertools.pairwise(anns):
        if a.encoding == "delta":
            assert (a.base_version, a.base_digest) == (prev.version, prev.state_digest)
        else:
            assert a.base_version is None and a.base_digest is None
    assert anns[-1].state_digest == trainer.digest
    for a in anns:  # the announced refs describe what the server holds, chunk by chunk
        (ref,) = a.objects
        data = await plane.objects().get(ref)
        assert len(data) == ref.size and hashlib.sha256(data).hexdigest() == ref.digest
    assert sum(a.objects[0].size for a in anns[1:4]) < anns[0].objects[0].size  # deltas are small
    assert (await plane.state.get(VersionRecord, "solver")).version == 5
    # a version that does not follow the image is a keyframe, whatever the schedule says
    assert (await pub.publish(trainer.step(), 7)).encoding == "keyframe"


async def test_delta_larger_than_the_fraction_becomes_a_keyframe(plane: Plane):
    trainer = Trainer(lr=1e-2)  # a big step: most values change
    pub = WeightPublisher(plane, "solver", keyframe_every=100, max_delta_fraction=0.05)
    anns = await publish_steps(pub, trainer, range(3))
    assert [a.encoding for a in anns] == ["keyframe", "keyframe", "keyframe"]
    pub.max_delta_fraction = 1.0
    assert (await pub.publish(trainer.step(), 3)).encoding == "delta"


async def test_keyframe_on_request(plane: Plane):
    trainer = Trainer()
    pub = WeightPublisher(plane, "solver", keyframe_every=100)
    await request_keyframe(plane, "solver", "stale request from before the trainer started")
    anns = await publish_steps(pub, trainer, range(3))  # v0 is a keyframe and serves it
    assert [a.encoding for a in anns] == ["keyframe", "delta", "delta"]
    await request_keyframe(plane, "solver", "node n1 lost its chain")
    assert (await plane.state.get(KeyframeRequest, "solver")).reason == "node n1 lost its chain"
    assert (await pub.publish(trainer.step(), 3)).encoding == "keyframe"
    assert (await pub.publish(trainer.step(), 4)).encoding == "delta"  # served once
    await request_keyframe(plane, "solver")
    assert (await pub.publish(trainer.step(), 5)).encoding == "keyframe"


async def test_announcement_is_the_commit_point(plane: Plane):
    trainer = Trainer()
    pub = WeightPublisher(plane, "solver")
    await publish_steps(pub, trainer, range(2))
    stream = object_stream(plane.names.object_bucket)
    before = await plane.stored.stream_msgs(stream)
    await plane._jsm.delete_stream(plane.names.weights_stream)  # the announcement cannot be stored
    with pytest.raises(PublishRefused):
        await pub.publish(trainer.step(), 2)
    assert await plane.stored.stream_msgs(stream) == before  # the unannounced chunks and metadata were purged
    assert pub.image_version == 1 and (await plane.state.get(VersionRecord, "solver")).version == 1


async def test_an_announcement_whose_ack_is_lost_keeps_its_payload(plane: Plane, monkeypatch: pytest.MonkeyPatch):
    """The server stored the announcement but its ack never came back (a timeout): the payload it names must stay, or
    every node would be stuck below that version (a joining node could not join at all)."""
    trainer = Trainer()
    pub = WeightPublisher(plane, "solver", keyframe_every=100)
    await publish_steps(pub, trainer, range(2))
    publish = plane.publish  # the announcement's (the payload's chunks go through the object store)

    async def stored_but_ack_lost(*args, **kwargs):
        await publish(*args, **kwargs)
        raise asyncio.TimeoutError

    monkeypatch.setattr(plane, "publish", stored_but_ack_lost)
    state = trainer.step()
    with pytest.raises(asyncio.TimeoutError):
        await pub.publish(state, 2)
    monkeypatch.undo()
    late = node(plane)
    await late.wait_for(2, timeout=10)
    assert late.version == 2 and engine_digest(late) == trainer.digest
    # a retry by the same publisher is refused (v2 is there already, after the sequence it knew): its own payload goes
    async def chunks() -> dict[str, int]:
        info = await plane._jsm.stream_info(object_stream(plane.names.object_bucket), subjects_filter=f"$O.{plane.names.object_bucket}.C.>")
        return dict(info.state.subjects or {})

    before = await chunks()
    with pytest.raises(PublishConflict):
        await pub.publish(state, 2)
    assert await chunks() == before  # the retry's chunks purged, the announced ones kept
    again = node(plane)
    await again.wait_for(2, timeout=10)
    assert engine_digest(again) == trainer.digest


async def test_a_keyframe_request_is_answered_while_no_version_is_coming(plane: Plane):
    """v2's payload is gone and no v3 is coming (no node can serve a task, so the trainer gets no batch): the request
    of a node that cannot join is answered by announcing v2 again as a keyframe, and the node joins on it."""
    trainer = Trainer()
    pub = WeightPublisher(plane, "solver", keyframe_every=100)
    anns = await publish_steps(pub, trainer, range(3))
    assert await pub.answer_keyframe_request() is None  # nothing asked
    await plane.objects().delete(anns[2].objects[0])
    late = node(plane)
    with pytest.raises(TimeoutError):
        await late.wait_for(2, timeout=3)
    assert late.version == 1 and late.stats["keyframe_requests"] >= 1  # below the version tasks need, and it asked
    again = await pub.answer_keyframe_request()
    assert again is not None and (again.version, again.encoding, again.state_digest) == (2, "keyframe", anns[2].state_digest)
    assert await pub.answer_keyframe_request() is None  # served once
    await late.wait_for(2, timeout=10)
    assert engine_digest(late) == trainer.digest
    evaluator = node(plane)
    await evaluator.goto(2)  # by number: the first announcement of v2 names the gone payload, the state's latest does not
    assert engine_digest(evaluator) == trainer.digest
    assert (await pub.publish(trainer.step(), 3)).encoding == "delta"  # the next version follows on as usual
    await late.wait_for(3, timeout=10)
    assert engine_digest(late) == trainer.digest


# ------------------------------------------------------------------------------ RaaS side


async def test_node_applies_deltas_onto_its_base_in_place(plane: Plane):
    trainer = Trainer()
    pub = WeightPublisher(plane, "solver", keyframe_every=100)
    sync = node(plane)
    params = {n: t.data_ptr() for n, t in sync.engine.model.state_dict().items()}
    model_id = id(sync.engine.model)
    for v in range(4):
        ann = await pub.publish(trainer.step() if v else trainer.model.state_dict(), v)
        assert await sync.refresh(wait=2.0)
        assert sync.version == v and engine_digest(sync) == ann.state_digest == trainer.digest
    assert sync.stats["keyframes"] == 1 and sync.stats["deltas"] == 3 and sync.stats["fallbacks"] == 0
    assert id(sync.engine.model) == model_id  # same model, same storage: patched, not reloaded
    assert {n: t.data_ptr() for n, t in sync.engine.model.state_dict().items()} == params


class RecordingHF(HFEngine):
    """The real hf engine, noting which tensors each ``load_state`` hands it from outside its own storage."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.foreign: list[set[str]] = []

    def load_state(self, state, version: int) -> None:
        own = {n: t.data_ptr() for n, t in self.model.state_dict().items()}
        self.foreign.append({n for n, t in state.items() if t.data_ptr() != own[n]})
        super().load_state(state, version)


async def test_hf_engine_receives_only_changed_tensors(plane: Plane):
    trainer = Trainer(lr=1e-2, only="model.norm.weight")
    pub = WeightPublisher(plane, "solver")
    sync = WeightSync(plane, "solver", RecordingHF(tiny_model(seed=123), tokenizer=None))
    await pub.publish(trainer.model.state_dict(), 0)
    await sync.refresh(wait=2.0)
    assert len(sync.engine.foreign[-1]) == len(sync.engine.model.state_dict())  # a keyframe: everything
    ann = await pub.publish(trainer.step(), 1)
    assert ann.encoding == "delta"
    await sync.refresh(wait=2.0)
    assert engine_digest(sync) == ann.state_digest
    assert sync.engine.foreign[-1] == {"model.norm.weight"}  # the rest are the engine's own tensors: nothing copied


async def test_late_joiner_gets_the_keyframe_and_the_deltas_after_it(plane: Plane):
    trainer = Trainer()
    pub = WeightPublisher(plane, "solver", keyframe_every=4)
    await publish_steps(pub, trainer, range(7))  # keyframes at v0 and v4
    late = node(plane)
    await late.wait_for(6, timeout=10)
    assert late.version == 6 and engine_digest(late) == trainer.digest
    assert dict(late.stats) | {"bytes": 0} == {"joins": 1, "keyframes": 1, "deltas": 2, "bytes": 0}


async def test_delta_onto_a_base_the_node_does_not_hold_falls_back(plane: Plane):
    first, second = Trainer(seed=0), Trainer(seed=1)
    sync = node(plane)
    await publish_steps(WeightPublisher(plane, "solver"), first, range(3))
    await sync.wait_for(2, timeout=10)
    # a restarted trainer announces its own v2 (same number, another state) and a delta onto it
    restarted = WeightPublisher(plane, "solver")
    await restarted.publish(second.model.state_dict(), 2)
    ann = await restarted.publish(second.step(), 3)
    assert ann.encoding == "delta" and ann.base_version == sync.version and ann.base_digest != sync.held.digest
    await sync.wait_for(3, timeout=10)  # a fetch returns what arrived: the v2 copy may come one fetch before v3
    assert sync.version == 3 and engine_digest(sync) == second.digest
    assert sync.stats["fallbacks"] == 1 and sync.stats["failures"] == 0
    assert sync.stats["corrupt"] == 0  # refused before applying (base digest), not caught after


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
async def test_damaged_chunk_is_never_applied(plane: Plane, damage: str):
    trainer = Trainer()
    pub = WeightPublisher(plane, "solver", keyframe_every=100)
    sync = node(plane)
    await publish_steps(pub, trainer, range(2))
    await sync.wait_for(1, timeout=10)
    good = sync.held.digest
    ann = await pub.publish(trainer.step(), 2)
    await rewrite_chunks(plane, ann.objects[0], **({"corrupt": 0} if damage == "corrupt" else {"drop": 0}))
    assert not await sync.refresh(wait=2.0)
    # fetched, fetched again, fell back to the keyframe chain (which needs v2 too), failed, asked for a keyframe
    assert sync.version == 1 and sync.held.digest == good == engine_digest(sync)
    assert sync.stats[damage] == 4 and sync.stats["refetches"] == 2
    assert sync.stats["fallbacks"] == 1 and sync.stats["failures"] == 1 and sync.stats["keyframe_requests"] == 1
    assert "cannot reach v2" in (await plane.state.get(KeyframeRequest, "solver")).reason
    ann = await pub.publish(trainer.step(), 3)
    assert ann.encoding == "keyframe"  # the trainer served the request
    assert await sync.refresh(wait=2.0)
    assert sync.version == 3 and engine_digest(sync) == trainer.digest


async def test_goto_steps_to_chosen_versions(plane: Plane):
    trainer = Trainer()
    anns = await publish_steps(WeightPublisher(plane, "solver", keyframe_every=3), trainer, range(6))
    sync = node(plane)
    for v in (4, 1, 5, 5, 0):
        await sync.goto(v)
        assert sync.version == v and engine_digest(sync) == anns[v].state_digest
    with pytest.raises(WeightSyncError, match="never announced"):
        await sync.goto(9)


# ------------------------------------------------------------------------------ objects


async def test_missing_chunk_is_reported_at_once_and_a_lagging_one_is_awaited(plane: Plane):
    bucket = plane.names.object_bucket
    data = os.urandom(3 * 100_000 + 7)
    ref = await put_object(plane._js, bucket, "lag", data, chunk_size=100_000)
    await rewrite_chunks(plane, ref, drop=3)
    t0 = time.monotonic()
    with pytest.raises(MissingObject, match="3 of 4 chunks"):
        await get_object(plane._js, bucket, ref)
    assert time.monotonic() - t0 < 2.0
    # a mirror that lags: the last chunk lands while the reader waits for it
    consumers = (await plane._jsm.stream_info(object_stream(bucket))).state.consumer_count
    reader = asyncio.create_task(get_object(plane._js, bucket, ref, wait_missing=10.0))
    while (await plane._jsm.stream_info(object_stream(bucket))).state.consumer_count == consumers:  # it counted 3 of 4, then subscribed
        assert not reader.done(), reader
        await asyncio.sleep(0.01)
    await plane._js.publish(chunk_subject(bucket, ref.nuid), data[3 * 100_000 :])
    assert bytes(await reader) == data


class ApiCalls:
    """The JetStream API subjects a client publishes to while it watches (every API request, ``request`` and the
    batched direct gets alike, goes through ``publish``). Watched on the client: a second connection subscribed to
    ``$JS.API.>`` missed a request now and then in full-suite runs, even after a round trip."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc

    async def __aenter__(self) -> list[str]:
        self.seen: list[str] = []
        publish = self.nc.publish

        async def watched(subject: str, *args: Any, **kwargs: Any) -> Any:
            if subject.startswith("$JS."):
                self.seen.append(subject)
            return await publish(subject, *args, **kwargs)

        self.nc.publish = watched
        return self.seen

    async def __aexit__(self, *exc: object) -> None:
        del self.nc.publish  # the class's method again


async def test_a_one_chunk_object_comes_in_one_direct_get_and_a_larger_one_streams(plane: Plane):
    store = plane.objects()
    small = os.urandom(50_000)
    large = os.urandom(250_000)
    one = await put_object(plane._js, plane.names.object_bucket, "one", small, chunk_size=100_000)
    three = await put_object(plane._js, plane.names.object_bucket, "three", large, chunk_size=100_000)
    stream = object_stream(plane.names.object_bucket)
    async with ApiCalls(plane._nc) as calls:
        assert b"".join([c async for c in store.iter_chunks(one)]) == small
    assert [c for c in calls if stream in c] == [f"$JS.API.DIRECT.GET.{stream}"]  # no stream info, no consumer made or deleted
    async with ApiCalls(plane._nc) as calls:
        assert b"".join([c async for c in store.iter_chunks(three)]) == large
    assert f"$JS.API.STREAM.INFO.{stream}" in calls, calls  # it counts the chunks, then streams them: a consumer made
    assert any(c.startswith(f"$JS.API.CONSUMER.CREATE.{stream}") for c in calls), calls


async def test_a_one_chunk_object_is_checked_and_a_lagging_chunk_awaited(plane: Plane):
    bucket = plane.names.object_bucket
    data = os.urandom(50_000)
    ref = await put_object(plane._js, bucket, "one", data, chunk_size=100_000)
    await rewrite_chunks(plane, ref, corrupt=0)
    with pytest.raises(CorruptObject, match="chunk 0 fails its digest"):
        await read_one_chunk_object(plane._js, bucket, ref)
    lying = ref.model_copy(update={"digest": hashlib.sha256(b"another payload").hexdigest()})  # chunk digest right, whole wrong
    await plane._jsm.purge_stream(object_stream(bucket), subject=chunk_subject(bucket, ref.nuid))
    await plane._js.publish(chunk_subject(bucket, ref.nuid), data)
    with pytest.raises(CorruptObject, match="whole-payload digest"):
        await read_one_chunk_object(plane._js, bucket, lying)
    await rewrite_chunks(plane, ref, drop=0)
    t0 = time.monotonic()
    with pytest.raises(MissingObject, match="0 of 1 chunks"):
        await read_one_chunk_object(plane._js, bucket, ref)
    assert time.monotonic() - t0 < 2.0  # reported at once
    reader = asyncio.create_task(read_one_chunk_object(plane._js, bucket, ref, wait_missing=10.0))  # a mirror that lags
    await asyncio.sleep(0.2)
    assert not reader.done()
    await plane._js.publish(chunk_subject(bucket, ref.nuid), data)
    assert await reader == data


# ------------------------------------------------------------------------------ retention


def _ann(version: int, encoding: str, base: WeightVersion | None, kf: int, tag: str = "") -> WeightVersion:
    ref = ObjectRef(name=f"v{version}{tag}", nuid=f"n{version}{tag}", size=1, chunk_size=1, digests=["0"], digest="0")
    return WeightVersion(policy="solver", version=version, encoding=encoding, state_digest=f"d{version}{tag}", keyframe_version=kf,
                         base_version=base.version if base else None, base_digest=base.state_digest if base else None, objects=[ref])


def _history(keyframes: list[bool]) -> list[WeightVersion]:
    out: list[WeightVersion] = []
    kf = 0
    for v, is_key in enumerate(keyframes):
        if is_key or v == 0:
            kf = v
            out.append(_ann(v, "keyframe", None, v))
        else:
            out.append(_ann(v, "delta", out[-1], kf))
    return out


def test_retention_plan_keeps_chains():
    hist = _history([True, False, False, True, False, False, False, True, False])  # keyframes 0, 3, 7
    plan = plan_retention(hist, keep_last=3)  # v6, v7, v8: v6 needs 3..5
    assert [a.version for a in plan.keep] == [3, 4, 5, 6, 7, 8]
    assert [a.version for a in plan.delete] == [0, 1, 2]
    assert [a.version for a in plan_retention(hist, keep_last=1).keep] == [7, 8]  # the newest chain only
    with pytest.raises(ValueError, match="keep_last"):
        plan_retention(hist, keep_last=0)


@settings(max_examples=200, deadline=None)
@given(keyframes=st.lists(st.booleans(), min_size=1, max_size=40), keep_last=st.integers(1, 8))
def test_retention_property_every_kept_version_stays_reconstructible(keyframes: list[bool], keep_last: int):
    stored: dict = {}
    for ann in _history(keyframes):  # the publisher runs the plan after every publish
        stored[key_of(ann)] = ann
        plan = plan_retention(stored.values(), keep_last)
        for gone in plan.delete:
            del stored[key_of(gone)]
        newest = sorted(stored.values(), key=lambda a: a.version)
        last = [a for a in newest if a.version > ann.version - keep_last]
        assert len(last) == min(keep_last, ann.version + 1)  # the last N versions are all still stored...
        chains = [chain_of(a, stored) for a in last]
        assert all(c is not None for c in chains)  # ...and reconstructible
        needed = {key_of(x) for c in chains for x in c}
        assert set(stored) == needed  # and nothing else is kept


@settings(max_examples=200, deadline=None)
@given(keyframes=st.lists(st.booleans(), min_size=1, max_size=40), lost=st.sets(st.integers(0, 39), max_size=6),
       restart=st.integers(0, 40), keep_last=st.integers(1, 12))
def test_retention_plan_is_each_newest_chain_walked_whole(keyframes: list[bool], lost: set[int], restart: int, keep_last: int):
    """The plan walks each chain only as far as an earlier walk has not gone: it keeps, deletes and reports broken exactly
    what walking each of the newest versions' chains whole does, also with links lost and a restarted trainer's chain."""
    history = [a for a in _history(keyframes) if a.version not in lost]
    if restart < len(history):  # a restarted trainer's own chain from there, published after the first
        again = _history(keyframes[:restart + 3])[restart:]
        history += [a.model_copy(update={"state_digest": a.state_digest + "r", "base_digest": a.base_digest and a.base_digest + "r"})
                    for a in again]
    index = {key_of(a): a for a in history}
    kept: dict = {}
    broken = []
    for ann in list(index.values())[-keep_last:]:
        chain, complete = walk_chain(ann, index)
        kept.update((key_of(a), a) for a in chain)
        broken += [] if complete else [ann.version]
    plan = plan_retention(history, keep_last)
    assert [key_of(a) for a in plan.keep] == [k for k in index if k in kept]
    assert [key_of(a) for a in plan.delete] == [k for k in index if k not in kept]
    assert list(plan.broken) == broken


def test_retention_keeps_a_restarted_trainers_chain_apart():
    old = _history([True, False, False])
    new_key = _ann(2, "keyframe", None, 2, tag="b")
    new = [new_key, _ann(3, "delta", new_key, 2, tag="b")]
    plan = plan_retention(old + new, keep_last=2)  # the newest two are v2b and v3b
    assert {(a.version, a.state_digest) for a in plan.keep} == {(2, "d2b"), (3, "d3b")}


async def test_retention_purges_old_objects_and_a_late_joiner_still_syncs(plane: Plane):
    trainer = Trainer()
    pub = WeightPublisher(plane, "solver", keyframe_every=3, keep_versions=2)
    anns = await publish_steps(pub, trainer, range(9))  # keyframes 0, 3, 6; the last two versions (7, 8) need 6..8
    await pub.keeper.wait()
    bucket, stream = plane.names.object_bucket, object_stream(plane.names.object_bucket)
    counts = [await count_chunks(plane._js, stream, chunk_subject(bucket, a.objects[0].nuid)) for a in anns]
    assert counts == [0] * 6 + [1] * 3
    assert pub.keeper.deleted == 6 and sorted(v for v, _ in pub.keeper.history) == [6, 7, 8]
    late = node(plane)
    await late.wait_for(8, timeout=10)
    assert engine_digest(late) == trainer.digest and late.stats["failures"] == 0
    with pytest.raises(WeightSyncError, match="could not reach v2"):
        await late.goto(2)  # announced, but its objects are gone
    assert late.version == 8


async def test_a_restarted_trainer_collects_what_its_predecessor_left(plane: Plane):
    bucket, stream = plane.names.object_bucket, object_stream(plane.names.object_bucket)
    old = await publish_steps(WeightPublisher(plane, "solver", keyframe_every=100, keep_versions=None), Trainer(seed=0), range(5))
    trainer = Trainer(seed=1)
    pub = WeightPublisher(plane, "solver", keyframe_every=100, keep_versions=2)  # starts again at v0, lower numbers
    new = await publish_steps(pub, trainer, range(3))
    await pub.keeper.wait()
    counts = [await count_chunks(plane._js, stream, chunk_subject(bucket, a.objects[0].nuid)) for a in old + new]
    assert counts == [0] * 5 + [1] * 3  # "last" is by publication: the old v4 is older than the new v0
    late = node(plane)
    await late.wait_for(2, timeout=10)
    assert engine_digest(late) == trainer.digest


async def test_a_restarted_trainer_sweeps_the_payloads_its_predecessor_stored_and_never_announced(plane: Plane):
    """Killed between its put and its announcement (chunks and metadata left), or in the middle of a put (chunks, no
    metadata): the next publisher of the policy purges both before it writes; every announced object stays, and so
    do another policy's unannounced payload and an object written without an owner."""
    bucket, stream = plane.names.object_bucket, object_stream(plane.names.object_bucket)
    trainer = Trainer(seed=0)
    first = WeightPublisher(plane, "solver", keyframe_every=100, keep_versions=None)
    announced = await publish_steps(first, trainer, range(2))
    stored = await first.store(trainer.step(), 2)  # killed before the announcement
    midway = owner_tag("solver") + "f" * 32  # killed in the middle of a put: two chunks, no metadata
    for _ in range(2):
        await plane._js.publish(chunk_subject(bucket, midway), b"x" * 100)
    other = await WeightPublisher(plane, "verifier", keyframe_every=100).store(Trainer(seed=2).model.state_dict(), 0)
    ownerless = await put_object(plane._js, bucket, "misc/untagged", b"y" * 100)

    async def chunks(nuid: str) -> int:
        return await count_chunks(plane._js, stream, chunk_subject(bucket, nuid))

    assert await chunks(stored.ann.objects[0].nuid) == 1 and await chunks(midway) == 2
    again = WeightPublisher(plane, "solver", keyframe_every=100, keep_versions=None)
    await again.publish(trainer.model.state_dict(), 2)  # the restart's first publish sweeps first
    assert await chunks(stored.ann.objects[0].nuid) == 0 and await chunks(midway) == 0
    with pytest.raises(MissingObject):
        await get_object(plane._js, bucket, stored.ann.objects[0], timeout=1.0)
    for ref in [a.objects[0] for a in announced] + [other.ann.objects[0], ownerless]:
        assert await chunks(ref.nuid) == 1, ref.name
    late = node(plane)
    await late.wait_for(2, timeout=10)
    assert engine_digest(late) == trainer.digest


async def test_an_unreachable_mirror_does_not_stop_publishing_or_hub_retention(plane: Plane):
    trainer = Trainer()
    pub = WeightPublisher(plane, "solver", keyframe_every=2, keep_versions=1, mirror_domains=("nowhere",))
    anns = await publish_steps(pub, trainer, range(5))  # keyframes 0, 2, 4
    await pub.keeper.wait()
    bucket, stream = plane.names.object_bucket, object_stream(plane.names.object_bucket)
    counts = [await count_chunks(plane._js, stream, chunk_subject(bucket, a.objects[0].nuid)) for a in anns]
    assert counts == [0, 0, 0, 0, 1]  # deleted from the hub all the same
    assert pub.keeper.deleted == 0 and len(pub.keeper.history) == 5  # but kept in the plan until the mirror is reachable again


async def test_payloads_whose_announcements_the_stream_trimmed_are_swept_once(nats_server, run_id):
    """The WEIGHTS stream keeps ``weights_history`` announcements per subject; the payloads below the keyframe of every one
    of them no chain can reach. A restarted trainer (retention on) purges them at its first publish, so the next restart
    finds nothing to read; every payload an announcement in the stream names, or its chain needs, stays, and a node
    still joins."""
    plane = await Plane.connect(NatsOptions(url=nats_server.url), run_id + "t", "trainer")
    try:
        await plane.ensure_topology(Topology(policies=("solver",), weights_history=3))
        bucket, stream = plane.names.object_bucket, object_stream(plane.names.object_bucket)
        trainer = Trainer()
        anns = await publish_steps(WeightPublisher(plane, "solver", keyframe_every=3, keep_versions=None), trainer, range(6))
        assert [a.keyframe_version for a in anns[3:]] == [3, 3, 3]  # the chains the stream still names start at v3

        async def chunks(a: WeightVersion) -> int:
            return await count_chunks(plane._js, stream, chunk_subject(bucket, a.objects[0].nuid))

        assert [await chunks(a) for a in anns] == [1] * 6  # v0..v2's announcements are trimmed, their payloads stay
        again = WeightPublisher(plane, "solver", keyframe_every=2, keep_versions=3)
        again.follows(await WeightChannel(plane, "solver").last_position())
        adopt(again, to_bf16_state(trainer.model.state_dict()), anns[5])  # as a resume from a checkpoint of v5 does
        await again.publish(trainer.step(), 6)
        assert [await chunks(a) for a in anns] == [0, 0, 0, 1, 1, 1]
        late = node(plane)
        await late.wait_for(6, timeout=10)
        assert engine_digest(late) == trainer.digest
    finally:
        await plane.close()


async def test_a_versions_write_the_plane_did_not_answer_is_written_again_within_patience():
    """A cluster electing the weights bucket's leader (a member killed) leaves a write unanswered: it is written again,
    after a pause, for up to the patience (the trainer rode through it; it exited on the timeout before); a write that
    keeps going unanswered raises its error once the patience is spent; a refusal is not retried."""
    calls: list[float] = []

    async def elected_after(n: int) -> str:
        calls.append(time.monotonic())
        if len(calls) <= n:
            raise (NatsTimeout if len(calls) % 2 else NoStreamResponseError)()
        return "stored"

    assert await written(lambda: elected_after(3), "weights solver v3") == "stored" and len(calls) == 4
    assert calls[-1] - calls[0] >= 0.25 + 0.5 + 1.0 - 0.05  # paused between, doubling
    calls.clear()
    t0 = time.monotonic()
    with pytest.raises(NatsTimeout):
        await written(lambda: elected_after(10**6), "weights solver v4", patience=1.0)
    assert time.monotonic() - t0 < 2.0 and len(calls) == 3
    refused = 0

    async def refuse() -> None:
        nonlocal refused
        refused += 1
        raise PublishRefused("maximum bytes exceeded")

    with pytest.raises(PublishRefused):
        await written(refuse, "weights solver v5")
    assert refused == 1
