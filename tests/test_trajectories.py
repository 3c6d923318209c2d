"""Trajectories at any size on a real nats-server: batched reads by sequence (streams/direct.py), and a
trajectory over max_payload travelling with its arrays in the trajectory bucket (streams/trajectories.py)."""

from __future__ import annotations

import asyncio
import random
import struct

import msgpack
import nats
import numpy as np
import pytest
import zstandard
from factories import a_trajectory

from astraflow.streams.codec import DecodeError, encode
from astraflow.streams.direct import MissingMessages, read_seqs, runs
from astraflow.streams.messages import PER_TOKEN, Batch, ObjectRef, Trajectory, TrajRef
from astraflow.streams.plane import Plane, Topology
from astraflow.streams.trajectories import (
    MAX_ARRAYS,
    PayloadUnavailable,
    decode_named,
    decode_traj,
    fetch_trajectories,
    pack_arrays,
    publish_trajectories,
    resolve,
    resolve_all,
    unpack_arrays,
)


def traj(task: str, i: int, n: int = 8, policy: str = "solver", seed: int = 0) -> Trajectory:
    rng = np.random.default_rng(seed)
    return a_trajectory(task, i, policy=policy, group_size=8, n=n, prompt_ids=rng.integers(3, 259, 16),
                        completion_ids=rng.integers(3, 259, n), logprobs=-rng.exponential(1.0, n).astype(np.float32))


def test_runs_are_consecutive_sequences():
    assert runs([7, 3, 4, 5, 9, 4, 10, 1]) == [(1, 1), (3, 3), (7, 1), (9, 2)]
    assert runs([]) == []


class Requests:
    """Counts the direct-get requests made on a stream (a plain subscriber sees every request)."""

    def __init__(self) -> None:
        self.n = 0

    async def watch(self, url: str, stream: str) -> Requests:
        self.nc = await nats.connect(url)

        async def count(msg: object) -> None:
            self.n += 1

        await self.nc.subscribe(f"$JS.API.DIRECT.GET.{stream}", cb=count)
        await self.nc.flush()
        return self

    async def close(self) -> None:
        """Once the server has sent every request seen so far, and the callback has counted each (a close alone drops
        what the subscription has not handed to it yet: a loaded machine counted 12 of 20)."""
        await self.nc.flush()
        await self.nc.drain()


async def test_many_messages_by_sequence_in_a_few_requests(plane: Plane, nats_server):
    n = plane.names
    items = [(n.traj("solver" if k % 3 else "verifier"), traj(f"t{k}", 0, seed=k, policy="solver" if k % 3 else "verifier"), None)
             for k in range(60)]
    seqs = await plane.publish_many(items)
    wanted = [s for s, (_, t, _) in zip(seqs, items, strict=True) if t.policy == "solver"]  # runs of 2 between verifier ones
    random.Random(0).shuffle(wanted)
    requests = await Requests().watch(nats_server.url, n.traj_stream)
    got = await plane.stored.get_many(n.traj_stream, wanted, Trajectory)
    await requests.close()
    by_seq = {s: t for s, (_, t, _) in zip(seqs, items, strict=True)}
    assert got == [by_seq[s] for s in wanted]  # in the order asked
    assert requests.n == len(runs(wanted)) == 20  # one request per run of consecutive sequences, never one per message

    cut = await read_seqs(plane._nc, "$JS.API", n.traj_stream, seqs[:10], max_bytes=1)  # each answer cut after one message
    assert sorted(cut) == seqs[:10] and all(cut[s].subject == items[s - seqs[0]][0] for s in cut)


async def test_reads_on_one_connection_share_one_reply_subscription(plane: Plane):
    """Direct gets answer to one subscription per connection, made at the first read and kept: no read subscribes or
    unsubscribes (each a write to the server of its own); reads at once each get their own answers."""
    n = plane.names
    seqs = await plane.publish_many([(n.traj("solver"), traj(f"t{k}", 0, seed=k), None) for k in range(24)])
    nc = plane._nc
    await read_seqs(nc, "$JS.API", n.traj_stream, seqs[:1])
    subscribed = nc._sid  # the client's count of subscriptions ever made
    parts = [seqs[::2], seqs[1::2], seqs[5:17]] * 3
    got = await asyncio.gather(*(read_seqs(nc, "$JS.API", n.traj_stream, p, max_bytes=4096) for p in parts))
    assert [sorted(g) for g in got] == [sorted(p) for p in parts]
    whole = await read_seqs(nc, "$JS.API", n.traj_stream, seqs)
    assert all(g[s].data == whole[s].data for g in got for s in g)  # each answer went to the read that asked for it
    assert nc._sid == subscribed


async def test_sequences_that_are_gone_are_named(plane: Plane, nats_server):
    n = plane.names
    seqs = await plane.publish_many([(n.traj("solver"), traj(f"t{k}", 0), None) for k in range(8)])
    nc = await nats.connect(nats_server.url)
    for s in (seqs[2], seqs[3], seqs[7]):  # inside a run, two in a row, and the last one of the stream
        await nc.jsm().delete_msg(n.traj_stream, s)
    await nc.close()
    with pytest.raises(MissingMessages) as gone:
        await plane.stored.get_many(n.traj_stream, [*seqs, seqs[-1] + 100], Trajectory)
    assert gone.value.seqs == [seqs[2], seqs[3], seqs[7], seqs[-1] + 100]
    assert [t.traj_id for t in await plane.stored.get_many(n.traj_stream, seqs[4:7], Trajectory)] == [f"t{k}.solver.0" for k in range(4, 7)]


async def test_a_trajectory_over_max_payload_travels_by_reference(plane: Plane):
    big_n = plane.max_payload // 4  # completion tokens: at least 13 bytes each raw, over max_payload even compressed
    small, big = traj("t1", 0), traj("t1", 1, n=big_n, seed=1)
    assert len(pack_arrays(big)) > plane.max_payload // 2
    seqs = await publish_trajectories(plane, [small, big])
    stubs = await plane.stored.get_many(plane.names.traj_stream, seqs, Trajectory)
    assert stubs[0] == small and not small.offloaded  # a normal one goes as it is
    stub = stubs[1]
    assert stub.offloaded and stub.payload_ref is not None and stub.payload_ref.name == "traj/t1.solver.1"
    assert all(getattr(stub, k) == b"" for k in PER_TOKEN) and len(encode(stub)) < 4096  # a small message, the arrays elsewhere
    assert stub.model_dump(exclude={*PER_TOKEN, "payload_ref"}) == big.model_dump(exclude={*PER_TOKEN, "payload_ref"})
    assert await resolve_all(plane.trajectory_objects(), stubs) == [small, big]  # the dataflow reads it back whole
    manifest = Batch(batch_id="solver-b000001", policy="solver", advantages=np.zeros(2, np.float32), task_ids=["t1"],
                     refs=[TrajRef(seq=s, traj_id=t.traj_id, task_id="t1") for s, t in zip(seqs, (small, big), strict=True)])
    assert await fetch_trajectories(plane, manifest) == [small, big]  # so does the trainer
    assert await publish_trajectories(plane, [big]) == [seqs[1]]  # a retry is the same message to the server (its id)


def arrays_object(*arrays: bytes, claimed: tuple[int, ...] | None = None) -> bytes:
    """An object in the layout of ``pack_arrays``, with these arrays (and these lengths in its header)."""
    header = struct.pack(f"<{len(arrays)}Q", *(claimed or tuple(len(a) for a in arrays)))
    return zstandard.ZstdCompressor().compress(header + b"".join(arrays))


async def test_arrays_that_cannot_be_read_whole_are_named(plane: Plane):
    store = plane.trajectory_objects()
    t = traj("t1", 0)
    assert unpack_arrays(pack_arrays(t)) == {k: getattr(t, k) for k in PER_TOKEN}

    async def stub_of(data: bytes) -> Trajectory:
        ref = await store.put("traj/t1.solver.0", data)
        return Trajectory.model_validate({**t.model_dump(), **dict.fromkeys(PER_TOKEN, b""), "payload_ref": ref})

    garbage = await stub_of(b"not a zstd frame")
    with pytest.raises(PayloadUnavailable, match=r"t1\.solver\.0: its arrays .* not a zstd frame"):
        await resolve(store, garbage)
    unaligned = await stub_of(arrays_object(t.prompt_ids, t.completion_ids, t.logprobs[:-4], t.versions, t.loss_mask, t.routing))
    lying = await stub_of(arrays_object(*(getattr(t, k) for k in PER_TOKEN), claimed=(64, 32, 32, 32, 9, 0)))
    gone = garbage.model_copy(update={"payload_ref": garbage.payload_ref.model_copy(update={"nuid": "nothing-here"})})
    huge = garbage.model_copy(update={"payload_ref": ObjectRef(name="x", nuid="y", size=MAX_ARRAYS + 1, chunk_size=1 << 20,
                                                                digests=[], digest="")})
    results = await resolve_all(store, [unaligned, lying, gone, huge, t])
    assert [type(r).__name__ for r in results] == ["PayloadUnavailable"] * 4 + ["Trajectory"]
    assert [k in str(r) for k, r in zip(("align", "header says", "chunks", "more than"), results, strict=False)] == [True] * 4


async def test_the_trajectory_bucket_keeps_objects_as_long_as_the_traj_stream(plane: Plane):
    info = await plane._jsm.stream_info(f"OBJ_{plane.names.traj_object_bucket}")
    traj_info = await plane._jsm.stream_info(plane.names.traj_stream)
    assert info.config.max_age == traj_info.config.max_age == Topology(policies=("solver",)).traj_max_age
    assert traj_info.config.allow_direct  # the trainers' batched reads


async def test_an_older_traj_stream_is_brought_to_allow_direct_gets(plane: Plane):
    cfg = (await plane._jsm.stream_info(plane.names.traj_stream)).config
    cfg.allow_direct = False
    await plane._jsm.update_stream(cfg)
    await plane.ensure_topology(Topology(policies=("solver",)))
    assert (await plane._jsm.stream_info(plane.names.traj_stream)).config.allow_direct


def tampered(data: bytes, change) -> bytes:
    """``data``'s envelope with ``change`` applied to its fields, packed again as the wire has it (a node that
    does not build its messages with our models)."""
    obj = msgpack.unpackb(zstandard.ZstdDecompressor().decompress(data[1:]) if data[:1] == b"\x02" else data[1:], raw=False)
    change(obj["d"])
    return b"\x01" + msgpack.packb(obj, use_bin_type=True)


async def test_a_batch_reads_only_the_samples_it_names_of_a_bundle(plane: Plane):
    """A bundle feeds two batches: each validates its own groups' samples, not the other's (a bad one there is not its
    to read); a bad sample a batch names is refused; a bundle not shaped as one is refused with the whole decode's reason."""
    groups = [[traj(f"t{k}", i, seed=10 * k + i) for i in range(4)] for k in range(4)]
    [seq] = set(await publish_trajectories(plane, [t for g in groups for t in g]))
    data = (await read_seqs(plane._nc, "$JS.API", plane.names.traj_stream, [seq]))[seq].data
    assert decode_traj(data).kind == "trajectory_bundle"

    def misaligned(fields: dict) -> None:  # the last group's first sample: logprobs one short of its completion
        fields["groups"][3]["trajectories"][0]["logprobs"] = fields["groups"][3]["trajectories"][0]["logprobs"][:-4]

    bad = tampered(data, misaligned)
    first = {t.traj_id for t in groups[0] + groups[1]}
    got = decode_named(bad, first)
    assert got == {t.traj_id: t for t in groups[0] + groups[1]}  # whole and equal, the bad sample of group 3 unread
    with pytest.raises(DecodeError, match="per-token arrays must align"):
        decode_named(bad, {groups[3][0].traj_id})
    none_here = decode_named(data, {"elsewhere"})
    assert none_here == {groups[0][0].traj_id: groups[0][0]}  # none named here: the first, which the caller's id check refuses
    with pytest.raises(DecodeError, match="invalid trajectory_bundle"):
        decode_named(tampered(data, lambda f: f.update(groups={"not": "a list"})), first)
    odd = decode_named(tampered(data, lambda f: f["groups"][0]["trajectories"][0].update(traj_id=["unhashable"])), first)
    assert groups[0][0].traj_id not in odd and len(odd) == 7  # an id of another type names nothing: that one is missing

    def manifest(ts: list[Trajectory], at: int = seq) -> Batch:
        return Batch(batch_id="solver-b1", policy="solver", refs=[TrajRef(seq=at, traj_id=t.traj_id, task_id=t.task_id) for t in ts],
                     advantages=np.zeros(len(ts), np.float32), task_ids=sorted({t.task_id for t in ts}))

    later = groups[3][1:] + groups[2]  # a batch's own order, not the bundle's
    assert await fetch_trajectories(plane, manifest(later)) == later
    at = (await plane._nc.jetstream().publish(plane.names.traj("solver"), bad)).seq
    assert await fetch_trajectories(plane, manifest(groups[1] + groups[0], at)) == groups[1] + groups[0]
    with pytest.raises(DecodeError):
        await fetch_trajectories(plane, manifest(groups[3], at))
