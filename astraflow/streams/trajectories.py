"""Trajectories on the plane at any size: published (by reference when too large), fetched by sequence, resolved.

**Too large for one message.** A trajectory whose encoding exceeds the server's ``max_payload``
(a long multi-turn episode) is published as a small :class:`Trajectory` whose ``payload_ref``
names one object in the run's trajectory bucket (``af_{run}_traj_objects``) holding its
per-token arrays, and whose arrays are empty (:func:`publish_trajectories`). The object is written
first (chunked, a sha256 per chunk and for the whole, ``streams/objects.py``) and the message last,
so a message never names an object that is not whole. Its layout (:func:`pack_arrays`): zstd of
five little-endian lengths (``<5Q``, in bytes) then the five arrays end to end, in the order of
``messages.PER_TOKEN``.

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
(:func:`fetch_trajectories`); :class:`TrainingBatch` is the manifest with its trajectories in hand.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import zstandard

from astraflow.streams.codec import MessageTooLarge
from astraflow.streams.messages import PER_TOKEN, Batch, Message, Trajectory
from astraflow.streams.objects import ObjectError, ObjectStore

if TYPE_CHECKING:
    from astraflow.streams.plane import Plane

_LENGTHS = struct.Struct("<5Q")
MAX_ARRAYS = 1 << 30  # bytes of arrays one trajectory may unpack to (~80M tokens): a bound on what a node can make us hold
_zc = zstandard.ZstdCompressor(level=3)
_zd = zstandard.ZstdDecompressor()


class PayloadUnavailable(RuntimeError):
    """A trajectory's arrays cannot be read whole from the object store (gone, corrupt, or malformed)."""


def pack_arrays(t: Trajectory) -> bytes:
    """The per-token arrays of ``t`` as one object: zstd(``<5Q`` lengths + the arrays end to end)."""
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


async def publish_trajectories(plane: Plane, trajs: list[Trajectory]) -> list[int]:
    """Publish ``trajs`` (``Nats-Msg-Id`` = ``traj_id``, pipelined); one too large for a message goes with its arrays
    in the trajectory bucket. Returns their TRAJ stream sequences."""
    store = plane.trajectory_objects()

    async def by_reference(msg: Message) -> Message:
        if not isinstance(msg, Trajectory):
            raise MessageTooLarge(f"{msg.kind} exceeds max_payload and only trajectories travel by reference")
        return await offload(store, msg)

    return await plane.publish_many([(plane.names.traj(t.policy), t, t.traj_id) for t in trajs], oversize=by_reference)


@dataclass(frozen=True)
class TrainingBatch:
    """A batch manifest with its trajectories in hand, whole and in manifest order: what a trainer steps on."""

    manifest: Batch
    trajectories: list[Trajectory]

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
    """The trajectories ``batch`` names, whole, in its order: read by TRAJ stream sequence in a few batched
    requests, offloaded arrays resolved. Raises ``MissingMessages`` (sequences gone), :class:`PayloadUnavailable`,
    or the transient error of the read. The caller checks each one's ids against its reference."""
    stubs = await plane.get_many(plane.names.traj_stream, [r.seq for r in batch.refs], Trajectory)
    out = await resolve_all(plane.trajectory_objects(), stubs)
    for t in out:
        if isinstance(t, PayloadUnavailable):
            raise t
    return [t for t in out if isinstance(t, Trajectory)]
