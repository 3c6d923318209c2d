"""The plane against a real nats-server: codec, topology, dedup, redelivery, DLQ, objects."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from factories import a_keyframe_announcement, a_trajectory
from nats.aio.msg import Msg
from nats.errors import NotJSMessageError
from nats.js import api
from nats.js.errors import ServiceUnavailableError

from astraflow.streams.acks import AcksLost
from astraflow.streams.codec import DecodeError, MessageTooLarge, decode, encode
from astraflow.streams.consuming import Delivery, IncompleteHistory, read_history
from astraflow.streams.messages import Rejected, Task, Trajectory, WeightVersion
from astraflow.streams.objects import MAX_CONSUMERS, CorruptObject, WriteInterrupted, get_object, object_stream, put_object
from astraflow.streams.plane import NatsOptions, Plane, Topology
from astraflow.streams.server import EmbeddedServer
from astraflow.streams.state import VersionRecord


def make_traj(i: int = 0, n: int = 5) -> Trajectory:
    return a_trajectory("t0", i, traj_id=f"tr{i}", prompt_id="p0", group_size=4, n=n, prompt_ids=np.arange(7),
                        completion_ids=np.arange(n), logprobs=-np.linspace(0.1, 1, n))


def test_codec_round_trip_and_packed_arrays():
    t = make_traj(n=10_000)  # large enough to be zstd-compressed
    data = encode(t)
    assert data[:1] == b"\x02"
    back = decode(data, Trajectory)
    assert back == t
    assert back.completion().dtype == np.dtype("<i4") and back.completion()[-1] == 9_999
    assert len(t.completion_ids) == 4 * 10_000  # packed little-endian, not a list of ints


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b"", "empty payload"),
        (b"\x07junk", "unknown encoding flag"),
        (b"\x01\xc1", "undecodable"),
        (encode(Task(task_id="a", workflow="w", policy="p", prompt_id="x", prompt="1+1", group_size=2)), "expected trajectory"),
    ],
)
def test_codec_rejections(payload: bytes, reason: str):
    with pytest.raises(DecodeError, match=reason):
        decode(payload, Trajectory)


def test_misaligned_arrays_are_rejected():
    with pytest.raises(ValueError, match="align"):
        Trajectory(**{**make_traj().model_dump(), "logprobs": np.zeros(3, np.float32)})


def test_size_check_before_publishing():
    with pytest.raises(MessageTooLarge):
        encode(make_traj(n=100_000), max_payload=1024)


async def test_topology_twice_is_idempotent(nats_server, run_id):
    p = await Plane.connect(NatsOptions(url=nats_server.url), run_id, "a")
    topo = Topology(policies=("solver", "verifier"))
    await p.ensure_topology(topo)
    await p.publish(
        p.names.task("math"), Task(task_id="k", workflow="math", policy="solver", prompt_id="x", prompt="1+1", group_size=2), "k"
    )
    await p.ensure_topology(topo)  # second time: nothing changes, nothing lost
    assert await p.stored.stream_msgs(p.names.task_stream) == 1
    assert (await p.stored.lag(p.names.task_stream, "raas")).pending == 1
    await p.close()


async def test_a_history_read_that_falls_behind_raises_rather_than_returning_part(nats_server, run_id):
    p = await Plane.connect(NatsOptions(url=nats_server.url), run_id, "a")
    await p.ensure_topology(Topology(policies=("solver",)))
    subject = p.names.dlq("task")
    for i in range(50):
        await p.publish(subject, Rejected(subject=subject, reason=f"r{i}", worker_id="w", payload=b"x"))
    whole = await read_history(p._js, p.names.dlq_stream, subject, Rejected)
    assert [r.reason for r in whole] == [f"r{i}" for i in range(50)]
    with pytest.raises(IncompleteHistory):  # no time to read them all: not handed over as if it were the whole history
        await read_history(p._js, p.names.dlq_stream, subject, Rejected, timeout=0.0)
    assert await read_history(p._js, p.names.dlq_stream, p.names.dlq("batch"), Rejected, timeout=0.0) == []  # nothing there
    await p.close()


async def test_a_consumer_the_server_forgot_is_made_again_by_its_owner_only(nats_server, run_id):
    owner = await Plane.connect(NatsOptions(url=nats_server.url), run_id, "owner")
    other = await Plane.connect(NatsOptions(url=nats_server.url), run_id, "other")
    await owner.ensure_topology(Topology(policies=("solver",)))
    pool, stream = owner.names.pool_consumer("raas"), owner.names.task_stream
    await owner._jsm.delete_consumer(stream, pool)  # as a restart without its store would leave it
    with pytest.raises(ServiceUnavailableError):  # a role that did not make it cannot make it again: it says so
        await other.consumer(stream, pool, Task).pull(timeout=0.3)
    sub = owner.consumer(stream, pool, Task)
    assert await sub.pull(timeout=0.3) == []  # made again
    task = Task(task_id="after", workflow="math", policy="solver", prompt_id="x", prompt="1+1", group_size=2)
    await owner.publish(owner.names.task("math"), task, task.task_id)
    got = await sub.pull(timeout=2)
    assert [d.msg.task_id for d in got] == ["after"]
    await got[0].ack()
    await owner.close()
    await other.close()


async def test_dedup_of_republished_message(plane: Plane):
    task = Task(task_id="dup", workflow="math", policy="solver", prompt_id="x", prompt="1+1", group_size=2)
    for _ in range(3):
        await plane.publish(plane.names.task("math"), task, msg_id=task.task_id)
    assert await plane.stored.stream_msgs(plane.names.task_stream) == 1


@pytest.mark.parametrize("reply", [
    "$JS.ACK.TRAJ_r.dataflow.1.12345.678.1700000000000000000.3",  # v1: no domain, no account hash
    "$JS.ACK._.ACCHASH.TRAJ_r.dataflow.2.999.5.1700000000000000000.0.tok",  # v2
    "$JS.ACK.hub.ACCHASH.TRAJ_r.dataflow.2.999.5.1700000000000000000.0",  # v2 without its random token
])
def test_a_deliverys_stream_sequence_is_read_from_its_ack_subject_as_nats_py_reads_it(reply: str):
    raw = Msg(None, subject="traj.r.solver", reply=reply, data=b"")
    assert Delivery(None, raw, None).position == raw.metadata.sequence.stream  # type: ignore[arg-type]
    with pytest.raises(NotJSMessageError):
        _ = Delivery(None, Msg(None, subject="s", reply="_INBOX.x.y", data=b""), None).position  # type: ignore[arg-type]


async def test_stream_sequences_of_live_deliveries(plane: Plane):
    tasks = [Task(task_id=f"s{i}", workflow="math", policy="solver", prompt_id="x", prompt="1+1", group_size=2) for i in range(3)]
    seqs = [await plane.publish(plane.names.task("math"), t, msg_id=t.task_id) for t in tasks]
    sub, got = plane.consumer(plane.names.task_stream, plane.names.pool_consumer("raas"), Task), []
    for _ in range(20):  # a pull may return with the first arrivals
        got += await sub.pull(batch=3 - len(got), timeout=0.5)
        if len(got) == 3:
            break
    assert sorted(d.position for d in got) == sorted(seqs)


async def test_redelivery_when_consumer_dies_without_ack(nats_server, plane: Plane, run_id):
    task = Task(task_id="r1", workflow="math", policy="solver", prompt_id="x", prompt="1+1", group_size=2)
    await plane.publish(plane.names.task("math"), task, task.task_id)
    dying = await Plane.connect(NatsOptions(url=nats_server.url), run_id, "dying")
    sub = dying.consumer(dying.names.task_stream, "raas", Task)
    got = await sub.pull(timeout=2)
    assert [d.msg.task_id for d in got] == ["r1"]
    await dying._nc.close()  # dies holding the task, never acks
    sub2 = plane.consumer(plane.names.task_stream, "raas", Task)
    again: list = []
    for _ in range(10):  # ack_wait is 2 s in the fixture
        again = await sub2.pull(timeout=1)
        if again:
            break
    assert [d.msg.task_id for d in again] == ["r1"] and again[0].num_delivered == 2
    await again[0].ack()


async def test_malformed_message_goes_to_dlq_and_worker_keeps_running(plane: Plane):
    subj = plane.names.task("math")
    await plane._js.publish(subj, b"\x01not msgpack \xc1")
    await plane.publish(subj, Task(task_id="ok", workflow="math", policy="solver", prompt_id="x", prompt="1+1", group_size=2), "ok")
    sub = plane.consumer(plane.names.task_stream, "raas", Task)
    got = await sub.pull(batch=2, timeout=2)
    assert [d.msg.task_id for d in got] == ["ok"]
    await got[0].ack()
    dlq = await plane._js.pull_subscribe(plane.names.dlq("task"), stream=plane.names.dlq_stream)
    (raw,) = await dlq.fetch(1, timeout=2)
    rej = decode(raw.data, Rejected)
    assert rej.subject == subj and "undecodable" in rej.reason and rej.payload == b"\x01not msgpack \xc1"
    assert (await plane.stored.lag(plane.names.task_stream, "raas")).pending == 0  # bad one was termed, not redelivered


async def test_object_round_trip_and_corrupt_chunk_refused(plane: Plane):
    bucket = plane.names.object_bucket
    data = os.urandom(3 * 1024 * 1024 + 123)
    ref = await put_object(plane._js, bucket, "w/v1", data, chunk_size=256 * 1024)
    assert len(ref.digests) == 13
    assert ref.digests == [hashlib.sha256(data[i * 256 * 1024:(i + 1) * 256 * 1024]).hexdigest() for i in range(13)]
    assert ref.digest == hashlib.sha256(data).hexdigest()
    assert bytes(await get_object(plane._js, bucket, ref)) == data
    one = await put_object(plane._js, bucket, "w/v2", iter([data[:1000], data[1000:5000]]), chunk_size=256 * 1024)
    assert one.digests == [hashlib.sha256(data[:5000]).hexdigest()] == [one.digest]  # its one chunk is the whole
    assert bytes(await get_object(plane._js, bucket, one)) == data[:5000]
    # corrupt one chunk: rewrite the chunk subject with a flipped byte and a wrong order
    bad = ref.model_copy(update={"digests": ref.digests[:5] + ["0" * 64] + ref.digests[6:]})
    with pytest.raises(CorruptObject, match="chunk 5"):
        await get_object(plane._js, bucket, bad)
    # a tampered payload on the server is refused too
    await plane._jsm.purge_stream(object_stream(bucket), subject=f"$O.{bucket}.C.{ref.nuid}")
    for i in range(len(ref.digests)):
        chunk = bytearray(data[i * ref.chunk_size : (i + 1) * ref.chunk_size])
        if i == 3:
            chunk[10] ^= 0xFF
        await plane._js.publish(f"$O.{bucket}.C.{ref.nuid}", bytes(chunk))
    with pytest.raises(CorruptObject, match="chunk 3"):
        await get_object(plane._js, bucket, ref)


async def test_object_readable_by_standard_object_store(plane: Plane):
    data = os.urandom(300_000)
    await put_object(plane._js, plane.names.object_bucket, "compat", data, chunk_size=128 * 1024)
    obs = await plane._js.object_store(plane.names.object_bucket)
    res = await obs.get("compat")
    assert res.data == data


async def test_publications_and_writes_a_servers_restart_cut_off_fail_at_once_or_go_through_again(tmp_path, run_id):
    """A publication, an object chunk or a run-state request sent into a connection that then drops is never answered.
    The sender sees the reconnect at once rather than at its timeout (10 s, 60 s): what lands once however often it is
    sent (publications that all carry a Nats-Msg-Id, run-state reads and writes) is sent again and goes through;
    the rest fails (AcksLost, WriteInterrupted) for its caller to decide. Published again, messages land once and the
    object whole."""
    server = EmbeddedServer(tmp_path).start()
    plane = await Plane.connect(NatsOptions(url=server.url), run_id, "test")

    async def cut_off(request: Callable[[], Awaitable[Any]]) -> tuple[Any, float]:
        """``request``'s result (or error) when the server stops answering it, is killed and restarts; and the seconds
        from the restart to that outcome."""
        assert server.proc is not None
        server.proc.send_signal(signal.SIGSTOP)  # what is sent goes into the socket; no answer comes back
        sending = asyncio.ensure_future(request())
        await asyncio.sleep(0.5)
        server.proc.kill()
        server.proc.wait()
        server.restart()  # same port, same store: the client reconnects
        t0 = time.monotonic()
        try:
            outcome = await sending
        except Exception as e:
            outcome = e
        return outcome, time.monotonic() - t0

    try:
        await plane.ensure_topology(Topology(policies=("solver",)))
        store = plane.objects()
        payload = os.urandom(1 << 20)
        tasks = [(plane.names.task("single_turn"), Task(task_id=f"t{i}", workflow="single_turn", policy="solver", prompt_id="p",
                                                          prompt="1+1=", group_size=1), f"t{i}") for i in range(3)]
        seqs, took = await cut_off(lambda: plane.publish_many(tasks))
        assert took < 5 and await plane.publish_many(tasks) == seqs and len(set(seqs)) == 3
        for request, error in ((lambda: plane.publish_many([(s, t, None) for s, t, _ in tasks]), AcksLost),
                               (lambda: store.put("w", payload), WriteInterrupted)):
            outcome, took = await cut_off(request)
            assert isinstance(outcome, error) and took < 5
        ref = await store.put("w", payload)
        assert await store.get(ref) == payload
        await plane.state.put(VersionRecord(policy="solver", version=3))
        got, took = await cut_off(lambda: plane.state.get(VersionRecord, "solver"))
        assert took < 5 and got is not None and got.version == 3
        _, took = await cut_off(lambda: plane.state.put(VersionRecord(policy="solver", version=4)))
        got = await plane.state.get(VersionRecord, "solver")
        assert took < 5 and got is not None and got.version == 4
        tasks_consumer = plane.consumer(plane.names.task_stream, plane.names.pool_consumer("raas"), Task)
        settings, took = await cut_off(tasks_consumer.settings)  # what a role reads as it starts (a node: its ack_wait)
        assert took < 5 and settings == await tasks_consumer.settings(), settings
    finally:
        await plane.close()
        server.stop()


async def test_a_follower_resumes_as_soon_as_its_restarted_server_is_back_and_skips_nothing(tmp_path, run_id):
    """A killed server takes the followers' (ephemeral) consumers with it. Once the connection is back the follower
    makes its consumer again at once, from the message after the last it handed in; not two missed heartbeats later
    (4-8 s), when a fast subject has run past what its stream keeps (here 4 announcements) and those are lost to it."""
    server = EmbeddedServer(tmp_path).start()
    plane = await Plane.connect(NatsOptions(url=server.url), run_id, "test")
    subject = plane.names.weights("solver")
    try:
        await plane.ensure_topology(Topology(policies=("solver",), weights_history=4))
        follower = plane.follower(subject, WeightVersion, start="all")
        seen: list[int] = []

        async def follow_until(n: int, within: float) -> None:
            deadline = time.monotonic() + within
            while len(seen) < n and time.monotonic() < deadline:
                seen.extend(a.version for a in await follower.fetch(0.1))

        for v in range(3):
            await plane.publish(subject, a_keyframe_announcement(v), msg_id=f"w{v}")
        await follow_until(3, 5.0)
        assert server.proc is not None
        server.proc.kill()
        server.proc.wait()
        server.restart()
        deadline = time.monotonic() + 10
        while plane.disconnected_for() > 0 or not plane._nc.is_connected:
            assert time.monotonic() < deadline, "the client did not reconnect"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        for v in range(3, 11):
            await plane.publish(subject, a_keyframe_announcement(v), msg_id=f"w{v}")
        await follow_until(11, 3.0)
        assert seen == list(range(11))
        await follower.close()
    finally:
        await plane.close()
        server.stop()


@pytest.mark.timeout(60)  # a wait that spun on a finished request would hold the event loop, and its own timeout, forever
async def test_a_request_the_plane_did_not_answer_is_asked_again_for_a_bounded_time(monkeypatch, plane: Plane):
    """``ask_again``: a request lost with its server (a timeout, no responders) is asked again, and answered once the
    plane is back; one that never is fails once its patience is spent; any other error is not asked again."""
    from nats.errors import TimeoutError as NatsTimeoutError

    from astraflow.streams import retry

    monkeypatch.setattr(retry, "PAUSE_S", 0.01)
    calls: list[int] = []

    async def lost_twice() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise NatsTimeoutError
        return "answered"

    assert await retry.ask_again(lost_twice, "a read") == "answered" and len(calls) == 3
    calls.clear()

    async def never() -> str:
        calls.append(1)
        raise NatsTimeoutError

    for js in (None, plane._js):  # watching the connection for reconnects, a request's own timeout still ends it
        with pytest.raises(NatsTimeoutError):
            await asyncio.wait_for(retry.ask_again(never, "a read", js, patience=0.2), 5.0)
        assert 2 <= len(calls) <= 6  # pauses of 0.01, 0.02, 0.04, ... within 0.2 s
        calls.clear()

    async def refused() -> str:
        calls.append(1)
        raise ValueError("not a lost request")

    with pytest.raises(ValueError):
        await retry.ask_again(refused, "a read")
    assert len(calls) == 1


async def test_the_run_streams_take_more_consumers_than_the_servers_default_cap(plane: Plane):
    """nats-server 2.15 allows 1,000 consumers to a stream that names no limit. Every rollout node follows the
    announcements with a consumer and streams a many-chunk version through another, so a pool of about 500 nodes reached
    the cap and its nodes stopped getting weights. The run's streams and its object stores' name their own limit
    (``plane.max_consumers``), and a run's setting reaches streams that exist already."""
    jsm, names = plane._jsm, plane.names
    for stream in (names.weights_stream, object_stream(names.object_bucket), object_stream(names.traj_object_bucket)):
        assert (await jsm.stream_info(stream)).config.max_consumers == MAX_CONSUMERS
    await plane.ensure_topology(Topology(policies=("solver",), max_consumers=2000))  # a run's setting reaches existing streams
    assert (await jsm.stream_info(names.weights_stream)).config.max_consumers == 2000
    followers = api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, inactive_threshold=60.0, mem_storage=True)
    made = await asyncio.gather(*(jsm.add_consumer(names.weights_stream, followers) for _ in range(1001)))
    assert len({c.name for c in made}) == 1001
