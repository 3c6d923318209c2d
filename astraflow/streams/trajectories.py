"""Trajectories on the plane at any size: published (by reference when too large), fetched by sequence, resolved.

**As few messages as fit.** The samples a node publishes together (:func:`publish_trajectories`:
the tasks it finished together) go as one :class:`TrajectoryBundle` per policy, the task groups
of that policy, when there are several tasks and the lot fits in ``max_payload``; else a
:class:`TrajectoryGroup` per task (its samples for one policy) when it fits; else one message per
trajectory. Every message costs a publication, a store, a delivery and an ack on the server and
the dataflow whatever its size, and a bundle compresses better than its groups apart: fewer
messages and about half the stored bytes (``bench_plane.py``: 5–10 % more trajectories a second).

**Too large for one message.** A trajectory whose encoding exceeds the server's ``max_payload``
(a long multi-turn episode) is published as a small :class:`Trajectory` whose ``payload_ref``
names one object in the run's trajectory bucket (``af_{run}_traj_objects``) holding its
per-token arrays, and whose arrays are empty (:func:`publish_trajectories`). The object is written
first (chunked, a sha256 per chunk and for the whole, ``streams/objects.py``) and the message last,
so a message never names an object that is not whole. Its layout (:func:`pack_arrays`): zstd of
six little-endian lengths (``<6Q``, in bytes) then the six arrays end to end, in the order of
``messages.PER_TOKEN`` (``routing`` empty unless the engine recorded it).

**Resolving.** Readers that need the arrays (the dataflow's value checks, the trainer) call
:func:`resolve`: a trajectory with a ``payload_ref`` comes back whole (``payload_ref`` None), its
object checked against every digest; others are returned as they are, at no cost. An object that
is gone or fails a digest is :class:`PayloadUnavailable` (the trajectory can never be read whole).

**Retention.** The trajectory bucket's stream has the TRAJ stream's max age (``Topology.traj_max_age``):
an object lives as long as the trajectory that names it may be read (replay, audit, a
trainer's fetch), and a node's half-written object (its put failed) expires with it; nobody
deletes one earlier, so a node needs no permission to delete anything.

**Fetching a batch.** A trainer reads the trajectories its manifest names by TRAJ stream sequence
in a few batched requests (``Plane.get_many``), then resolves the offloaded ones
(:func:`fetch_batch`); :class:`TrainingBatch` is the manifest with its trajectories in hand, and the node each one's
subject names (the trainer reports the ones its token check leaves out against them).
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import zstandard

from astraflow.streams.codec import MessageTooLarge, decode_any, encode, envelope, validate
from astraflow.streams.messages import MAX_BUNDLE, MAX_GROUP, PER_TOKEN, Batch, Message, Trajectory, TrajectoryBundle, TrajectoryGroup
from astraflow.streams.objects import ObjectError, ObjectStore
from astraflow.streams.subjects import Names

if TYPE_CHECKING:
    from astraflow.streams.plane import Plane

_LENGTHS = struct.Struct(f"<{len(PER_TOKEN)}Q")
MAX_ARRAYS = 1 << 30  # bytes of arrays one trajectory may unpack to (~80M tokens): a bound on what a node can make us hold
INLINE_DECODE_BYTES = 1 << 20  # a batch's messages up to this size are decoded on the event loop, larger ones on a thread
_zc = zstandard.ZstdCompressor(level=3)
_zd = zstandard.ZstdDecompressor()


class PayloadUnavailable(RuntimeError):
    """A trajectory's arrays cannot be read whole from the object store (gone, corrupt, or malformed)."""


def pack_arrays(t: Trajectory) -> bytes:
    """The per-token arrays of ``t`` as one object: zstd(``<6Q`` lengths + the arrays end to end)."""
    arrays = [getattr(t, k) for k in PER_TOKEN]
    return _zc.compress(b"".join([_LENGTHS.pack(*(len(a) for a in arrays)), *arrays]))


def unpack_arrays(data: bytes | bytearray) -> dict[str, bytes]:
    """Inverse of :func:`pack_arrays`; ValueError when ``data`` is not such an object."""
    try:
        raw = _zd.decompress(bytes(data), max_output_size=MAX_ARRAYS)
    except zstandard.ZstdError as e:
        raise ValueError(f"not a zstd frame: {e}") from None
    if len(raw) < _LENGTHS.size:
        raise ValueError(f"{len(raw)} bytes, shorter than its header")
    lengths = _LENGTHS.unpack_from(raw)
    if _LENGTHS.size + sum(lengths) != len(raw):
        raise ValueError(f"header says {sum(lengths)} bytes of arrays, the object holds {len(raw) - _LENGTHS.size}")
    out, off = {}, _LENGTHS.size
    for name, n in zip(PER_TOKEN, lengths, strict=True):
        out[name] = raw[off : off + n]
        off += n
    return out


def object_name(t: Trajectory) -> str:
    return f"traj/{t.traj_id}"


async def offload(store: ObjectStore, t: Trajectory) -> Trajectory:
    """``t`` with its arrays put in ``store``: the message to publish in its place."""
    ref = await store.put(object_name(t), pack_arrays(t))
    return Trajectory.model_validate({**t.model_dump(), **dict.fromkeys(PER_TOKEN, b""), "payload_ref": ref})


async def resolve(store: ObjectStore, t: Trajectory) -> Trajectory:
    """``t`` whole: as it is, or with its arrays read back from ``store`` (every digest checked)."""
    if t.payload_ref is None:
        return t
    if t.payload_ref.size > MAX_ARRAYS:
        raise PayloadUnavailable(f"{t.traj_id}: its arrays' object claims {t.payload_ref.size} bytes, more than {MAX_ARRAYS}")
    try:
        arrays = unpack_arrays(await store.get(t.payload_ref))
        return Trajectory.model_validate({**t.model_dump(), **arrays, "payload_ref": None})
    except (ObjectError, ValueError) as e:  # a pydantic ValidationError is a ValueError: arrays that do not align
        raise PayloadUnavailable(f"{t.traj_id}: its arrays ({t.payload_ref.name}) cannot be read whole: {e}") from e


async def resolve_all(store: ObjectStore, trajs: list[Trajectory], at_once: int = 4) -> list[Trajectory | PayloadUnavailable]:
    """Every trajectory whole, or the reason it cannot be (``at_once`` objects read together). Other errors
    (a timeout, a lost connection) raise: they say nothing about the trajectory."""
    if not any(t.offloaded for t in trajs):  # the usual case: nothing to read, no task to start
        return list(trajs)
    slots = asyncio.Semaphore(at_once)

    async def one(t: Trajectory) -> Trajectory | PayloadUnavailable:
        if t.payload_ref is None:
            return t
        async with slots:
            try:
                return await resolve(store, t)
            except PayloadUnavailable as e:
                return e

    return list(await asyncio.gather(*(one(t) for t in trajs)))


def grouped(trajs: list[Trajectory]) -> list[list[Trajectory]]:
    """``trajs`` cut by (task, policy), in order of first appearance: the groups a node publishes one message each."""
    out: dict[tuple[str, str], list[Trajectory]] = {}
    for t in trajs:
        out.setdefault((t.task_id, t.policy), []).append(t)
    return list(out.values())


async def publish_trajectories(plane: Plane, trajs: list[Trajectory]) -> list[int]:
    """Publish ``trajs``, pipelined, in as few messages as fit: each policy's groups (the samples of one task for one
    policy) as one :class:`TrajectoryBundle` when there are several tasks and the lot fits in a message, else as
    bundles of half as many, and so on (``Nats-Msg-Id`` = its ``msg_id``); a group left alone as one
    :class:`TrajectoryGroup` when it has several samples and fits (``msg_id`` likewise); otherwise each trajectory
    alone (``Nats-Msg-Id`` = ``traj_id``), one too large for a message with its arrays in the trajectory bucket.
    Returns each trajectory's TRAJ stream sequence (that of the message that carries it)."""
    store = plane.trajectory_objects()

    async def by_reference(msg: Message) -> Message:
        if not isinstance(msg, Trajectory):
            raise MessageTooLarge(f"{msg.kind} exceeds max_payload and only trajectories travel by reference")
        return await offload(store, msg)

    items: list[tuple[str, Message | bytes, str | None]] = []
    carrier: dict[int, int] = {}  # id of each trajectory -> the item that carries it

    def add(subject: str, carried: list[Trajectory], msg: Message | bytes, msg_id: str) -> None:
        carrier.update((id(t), len(items)) for t in carried)
        items.append((subject, msg, msg_id))

    for policy, groups in by_policy(grouped(trajs)).items():
        subject = plane.names.traj(policy, plane.node)
        for run, bundle in _bundles(groups, plane.max_payload):
            if bundle is not None:
                add(subject, [t for g in run for t in g], *bundle)
                continue
            (group,) = run
            one = _one_message(group, plane.max_payload)
            if one is not None:
                add(subject, group, *one)
                continue
            for t in group:  # alone: a single sample, or a group too large (or unfit) for one message
                add(subject, [t], t, t.traj_id)
    seqs = await plane.publish_many(items, oversize=by_reference)
    return [seqs[carrier[id(t)]] for t in trajs]


def by_policy(groups: list[list[Trajectory]]) -> dict[str, list[list[Trajectory]]]:
    """``groups`` (each one task's samples for one policy) by policy, in order of first appearance."""
    out: dict[str, list[list[Trajectory]]] = {}
    for g in groups:
        out.setdefault(g[0].policy, []).append(g)
    return out


def _one_message(group: list[Trajectory], max_payload: int) -> tuple[bytes, str] | None:
    """``group`` encoded as one :class:`TrajectoryGroup` and its ``Nats-Msg-Id``; None when it should go as single
    messages: one sample, more than ``MAX_GROUP``, a traj_id twice, one by reference, or too large for a message."""
    if not 1 < len(group) <= MAX_GROUP:
        return None
    try:
        msg = TrajectoryGroup(task_id=group[0].task_id, policy=group[0].policy, trajectories=group)
    except ValueError:
        return None
    data = encode(msg)
    return (data, msg.msg_id) if len(data) <= max_payload else None


def _bundles(groups: list[list[Trajectory]], max_payload: int) -> list[tuple[list[list[Trajectory]], tuple[bytes, str] | None]]:
    """``groups`` (one policy's) cut into runs, each with its encoded :class:`TrajectoryBundle` and ``Nats-Msg-Id``: all
    of them in one when they fit in a message, else each half, and so on (a GPU node's settlement of hundreds of tasks
    goes in as few messages as fit); a run of one group comes with None (it goes as a group message, or alone)."""
    if len(groups) == 1:
        return [(groups, None)]
    if len(groups) <= MAX_BUNDLE:
        one = _bundle(groups, max_payload)
        if one is not None:
            return [(groups, one)]
    half = len(groups) // 2
    return _bundles(groups[:half], max_payload) + _bundles(groups[half:], max_payload)


def _bundle(groups: list[list[Trajectory]], max_payload: int) -> tuple[bytes, str] | None:
    """``groups`` (one policy's) encoded as one :class:`TrajectoryBundle` and its ``Nats-Msg-Id``; None when they should
    go group by group: one task, more than ``MAX_BUNDLE`` groups or ``MAX_GROUP`` trajectories, a group unfit for a
    :class:`TrajectoryGroup` (see :func:`_one_message`), or too large for a message."""
    if not 1 < len(groups) <= MAX_BUNDLE or sum(map(len, groups)) > MAX_GROUP:
        return None
    try:
        msg = TrajectoryBundle(policy=groups[0][0].policy,
                               groups=[TrajectoryGroup(task_id=g[0].task_id, policy=g[0].policy, trajectories=g) for g in groups])
    except ValueError:
        return None
    data = encode(msg)
    return (data, msg.msg_id) if len(data) <= max_payload else None


TrajMessage = Trajectory | TrajectoryGroup | TrajectoryBundle  # what a TRAJ stream message is


def decode_traj(data: bytes) -> TrajMessage:
    """A TRAJ stream message's bytes decoded (``DecodeError`` when it is none of its kinds)."""
    return cast(TrajMessage, decode_any(data, Trajectory, TrajectoryGroup, TrajectoryBundle))


def carried(msg: TrajMessage) -> list[Trajectory]:
    """The trajectories a TRAJ stream message carries: itself, or its group's, or its bundle's."""
    return [msg] if isinstance(msg, Trajectory) else msg.trajectories


def decode_carried(data: bytes) -> list[Trajectory]:
    """The trajectories of a TRAJ stream message's bytes (``DecodeError`` when it is none of its kinds)."""
    return carried(decode_traj(data))


def decode_named(data: bytes, wanted: set[str]) -> dict[str, Trajectory]:
    """The trajectories ``wanted`` (by ``traj_id``) of a TRAJ stream message's bytes, each validated as strictly as a
    message of its own; a group's or a bundle's other samples are not validated (a batch that names some of a bundle's
    groups reads those, where decoding the whole bundle cost each batch it feeds all of it). None wanted there: its
    first trajectory, which fails the caller's check of ids. ``DecodeError`` when a wanted one is invalid, or when the
    message is not the shape its kind has (then decoded whole, for the reason)."""
    kind, fields = envelope(data, Trajectory, TrajectoryGroup, TrajectoryBundle)
    if kind is Trajectory:
        t = validate(Trajectory, fields)
        return {t.traj_id: t}
    samples = _samples_of(fields if kind is TrajectoryGroup else fields.get("groups") if isinstance(fields, dict) else None,
                          kind is TrajectoryBundle)
    if samples is None:
        return {t.traj_id: t for t in decode_carried(data)}  # malformed: the whole decode names why (or it was fine)
    named = [f for f in samples if isinstance(i := f.get("traj_id"), str) and i in wanted] or samples[:1]
    return {t.traj_id: t for t in (validate(Trajectory, f) for f in named)}


def _samples_of(fields: Any, bundle: bool) -> list[dict[str, Any]] | None:
    """The unvalidated fields of each sample of a group's (or, ``bundle``, a bundle's ``groups``') fields, in order;
    None when they are not shaped as a message of that kind's, or hold more than ``MAX_GROUP`` samples."""
    groups = fields if bundle else [fields]
    if not isinstance(groups, list) or not groups:
        return None
    out: list[dict[str, Any]] = []
    for g in groups:
        trajs = g.get("trajectories") if isinstance(g, dict) else None
        if not isinstance(trajs, list) or not trajs or not all(isinstance(f, dict) for f in trajs):
            return None
        out += trajs
    return out if len(out) <= MAX_GROUP else None


@dataclass(frozen=True)
class TrainingBatch:
    """A batch manifest with its trajectories in hand, whole and in manifest order: what a trainer steps on."""

    manifest: Batch
    trajectories: list[Trajectory]
    senders: list[str | None] | None = None  # the node each one's TRAJ subject names (aligned); None: not known

    @property
    def batch_id(self) -> str:
        return self.manifest.batch_id

    @property
    def policy(self) -> str:
        return self.manifest.policy

    @property
    def task_ids(self) -> list[str]:
        return self.manifest.task_ids

    def advantage_array(self) -> np.ndarray:
        return self.manifest.advantage_array()


async def fetch_trajectories(plane: Plane, batch: Batch) -> list[Trajectory]:
    """The trajectories ``batch`` names, whole, in its order (:func:`fetch_batch`)."""
    return (await fetch_batch(plane, batch)).trajectories


async def fetch_batch(plane: Plane, batch: Batch) -> TrainingBatch:
    """The trajectories ``batch`` names, whole, in its order, with the node each one's subject names: read by TRAJ
    stream sequence in a few batched requests (a group's or bundle's message once for all of its trajectories), only the
    trajectories it names validated (:func:`decode_named`), offloaded arrays resolved. Raises ``MissingMessages`` (sequences gone),
    :class:`PayloadUnavailable`, or the transient error of the read. The caller checks each one's ids against its
    reference (a group without that id gives its first trajectory, which fails that check)."""
    stored = await plane.stored.read_stored(plane.names.traj_stream, [r.seq for r in batch.refs])
    raw = {seq: m.data for seq, m in stored.items()}

    wanted: dict[int, set[str]] = {}
    for r in batch.refs:
        wanted.setdefault(r.seq, set()).add(r.traj_id)

    def pick() -> list[Trajectory]:
        found = {seq: decode_named(data, wanted[seq]) for seq, data in raw.items()}
        return [found[r.seq].get(r.traj_id) or next(iter(found[r.seq].values())) for r in batch.refs]

    small = sum(map(len, raw.values())) <= INLINE_DECODE_BYTES  # a thread's hand-off costs more than a small batch's decode
    stubs = pick() if small else await asyncio.to_thread(pick)  # a large one decodes on a thread: the event loop keeps beating
    out = await resolve_all(plane.trajectory_objects(), stubs)
    for t in out:
        if isinstance(t, PayloadUnavailable):
            raise t
    return TrainingBatch(batch, [t for t in out if isinstance(t, Trajectory)], [Names.sender(stored[r.seq].subject) for r in batch.refs])
