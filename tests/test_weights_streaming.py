"""Weights encoded while they are published and applied while they are fetched, on a real nats-server.

Objects: a payload handed over in pieces split anywhere is stored chunk by chunk exactly as the
whole payload would be; the reader yields checked chunks in order; an encoder that fails midway
leaves nothing behind. Weight plane, with payloads of several chunks (a wider tiny Qwen2): a
delta that grows past its fraction while it is written is purged and a keyframe goes out; a
corrupt chunk in the middle of a delta is never applied (the engine keeps its version, the node
falls back and asks for a keyframe).
"""

from __future__ import annotations

import os

import pytest
from test_weights_plane import rewrite_chunks
from weights_helpers import WIDE, Trainer, engine_digest, node, tiny_model

from astraflow.streams.objects import get_object, iter_object, object_stream, put_object
from astraflow.streams.plane import Plane
from astraflow.streams.state import KeyframeRequest
from astraflow.weights.publish import WeightPublisher

CHUNK = 100_000


def split(data: bytes, sizes: list[int]) -> list[bytes]:
    """``data`` in pieces of the given sizes, cycled (pieces shorter and longer than a chunk)."""
    out, off, i = [], 0, 0
    while off < len(data):
        out.append(data[off : off + sizes[i % len(sizes)]])
        off, i = off + sizes[i % len(sizes)], i + 1
    return out


async def test_pieces_are_stored_as_the_whole_payload_and_read_back_chunk_by_chunk(plane: Plane):
    bucket = plane.names.object_bucket
    data = os.urandom(5 * CHUNK + 123)
    whole = await put_object(plane._js, bucket, "whole", data, chunk_size=CHUNK)
    streamed = await put_object(plane._js, bucket, "pieces", iter(split(data, [1, 250_000, 99_999, 7, 31_337])), chunk_size=CHUNK)
    assert (streamed.size, streamed.digests, streamed.digest) == (whole.size, whole.digests, whole.digest)
    chunks = [c async for c in iter_object(plane._js, bucket, streamed)]
    assert [len(c) for c in chunks] == [CHUNK] * 5 + [123] and b"".join(chunks) == data
    assert bytes(await get_object(plane._js, bucket, streamed)) == data
    empty = await put_object(plane._js, bucket, "empty", iter([]), chunk_size=CHUNK)
    assert empty.size == 0 and len(empty.digests) == 1 and bytes(await get_object(plane._js, bucket, empty)) == b""


async def test_an_encoder_failing_midway_leaves_no_chunks(plane: Plane):
    bucket = plane.names.object_bucket
    await put_object(plane._js, bucket, "before", b"x")
    before = await plane.stored.stream_msgs(object_stream(bucket))

    def encoder():
        yield os.urandom(3 * CHUNK)  # three chunks go out before the failure
        raise ValueError("encoder broke")

    with pytest.raises(ValueError, match="encoder broke"):
        await put_object(plane._js, bucket, "broken", encoder(), chunk_size=CHUNK)
    assert await plane.stored.stream_msgs(object_stream(bucket)) == before


async def test_a_delta_past_its_fraction_is_dropped_midway_for_a_keyframe(plane: Plane):
    pub = WeightPublisher(plane, "solver", keyframe_every=100, max_delta_fraction=0.5)
    first = await pub.publish(tiny_model(0, **WIDE).state_dict(), 0)
    other = tiny_model(1, **WIDE).state_dict()  # every value differs: the delta is as large as the state
    ann = await pub.publish(other, 1)
    assert ann.encoding == "keyframe" and len(ann.objects[0].digests) > 3  # the delta had chunks out before it passed the limit
    anns = (first, ann)
    # the stream holds the two keyframes' chunks and metadata, nothing of the dropped delta
    assert await plane.stored.stream_msgs(object_stream(plane.names.object_bucket)) == sum(len(a.objects[0].digests) + 1 for a in anns)
    sync = node(plane, WIDE)
    await sync.wait_for(1, timeout=20)
    assert engine_digest(sync) == ann.state_digest


async def test_a_corrupt_chunk_midway_through_a_delta_is_never_applied(plane: Plane):
    trainer = Trainer(lr=1e-3, **WIDE)
    pub = WeightPublisher(plane, "solver", keyframe_every=100, max_delta_fraction=1.0)
    sync = node(plane, WIDE)
    for v in range(2):
        await pub.publish(trainer.step() if v else trainer.model.state_dict(), v)
    await sync.wait_for(1, timeout=20)
    good = engine_digest(sync)
    assert sync.stats["deltas"] == 1 and good == sync.held.digest
    ann = await pub.publish(trainer.step(), 2)
    assert ann.encoding == "delta" and len(ann.objects[0].digests) >= 2
    await rewrite_chunks(plane, ann.objects[0], corrupt=1)  # chunk 0 is fed (and may be applied) before chunk 1 fails
    assert not await sync.refresh(wait=2.0)
    # the image may be half-applied: dropped, not fetched again; the engine keeps v1; the keyframe chain needs v2 too
    assert sync.version == 1 and engine_digest(sync) == good and sync.held.digest is None
    assert sync.stats["corrupt"] == 2 and sync.stats["refetches"] == 0
    assert sync.stats["fallbacks"] == 1 and sync.stats["failures"] == 1 and sync.stats["keyframe_requests"] == 1
    assert "cannot reach v2" in (await plane.state.get(KeyframeRequest, "solver")).reason
    ann = await pub.publish(trainer.step(), 3)
    assert ann.encoding == "keyframe"  # the trainer served the request
    assert await sync.refresh(wait=2.0)
    assert sync.version == 3 and engine_digest(sync) == trainer.digest and sync.stats["joins"] == 2  # at v0, and now
