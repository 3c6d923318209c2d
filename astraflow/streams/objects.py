"""Fast chunked object writer/reader for weight payloads, mirror-aware; region mirrors.

Layout is the JetStream object-store layout (stream ``OBJ_{bucket}``, chunks on
``$O.{bucket}.C.{nuid}``, metadata on ``$O.{bucket}.M.{name}``), so standard tooling can list
and read what we write. We do not use nats-py's ``ObjectStore.get``: it re-copies the buffer on
every chunk and finds the stream by subject, which fails on a mirror (a mirror has no
subjects). Here:

* the writer pipelines chunk publishes (``publish_async``), writes the metadata last and
  purges its chunks if anything fails; the caller's announcement is the commit point (STYLE 7);
* the reader binds a stream by name (the bucket's own, or a mirror's in another JetStream
  domain through a domain-scoped ``js``), counts the chunks on the server first (a missing
  chunk is reported at once, not after a timeout), then streams them through an ordered push
  consumer with flow control (no request round trip per window) and checks each chunk's
  sha256 and length, and the whole payload's sha256, against the :class:`ObjectRef` of the
  announcement. Hashing runs on one helper thread, overlapping the network reads.

A region (a leafnode with its own JetStream domain) mirrors the object stream and the weights
announcement stream of the hub: :func:`ensure_region_mirrors`.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext, api
from nats.js.errors import BadRequestError, NotFoundError

from astraflow.streams.messages import ObjectRef
from astraflow.streams.subjects import Names

if TYPE_CHECKING:
    from astraflow.streams.plane import Plane

DEFAULT_CHUNK = 2 * 1024 * 1024  # measured (benchmarks/bench_weight_transfer.py): 2-4 MiB read fastest
_HASHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="af-objects-sha")  # one thread: chunks hash in order


class ObjectError(RuntimeError):
    """An object could not be read back whole."""


class MissingObject(ObjectError):
    """Chunks of the object are not on the stream (deleted, never written, or a mirror lagging)."""


class CorruptObject(ObjectError):
    """A chunk or the whole payload does not match its digest or size: never apply it."""


def object_stream(bucket: str) -> str:
    return f"OBJ_{bucket}"


def chunk_subject(bucket: str, nuid: str) -> str:
    return f"$O.{bucket}.C.{nuid}"


def _meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


def chunk_size_for(max_payload: int, wanted: int = DEFAULT_CHUNK) -> int:
    """Chunks stay well under the server's max_payload (headers and framing need room)."""
    return max(64 * 1024, min(wanted, max_payload - 64 * 1024))


# ------------------------------------------------------------------------------ write


async def put_object(js: JetStreamContext, bucket: str, name: str, data: bytes | bytearray | memoryview, chunk_size: int = DEFAULT_CHUNK,
                     timeout: float = 60.0) -> ObjectRef:
    """Write ``data`` under a fresh nuid (chunks pipelined, metadata last); purge the chunks on
    failure, including chunk acks not all back within ``timeout`` seconds."""
    view = memoryview(data).cast("B")
    nuid = uuid.uuid4().hex
    subject = chunk_subject(bucket, nuid)
    digests: list[str] = []
    whole = hashlib.sha256()
    futs = []
    try:
        for off in range(0, max(len(view), 1), chunk_size):
            chunk = bytes(view[off : off + chunk_size])
            digests.append(hashlib.sha256(chunk).hexdigest())
            whole.update(chunk)
            futs.append(await js.publish_async(subject, chunk, stream=object_stream(bucket)))
        await asyncio.wait_for(asyncio.gather(*futs), timeout)
        meta = {
            "name": name, "bucket": bucket, "nuid": nuid, "size": len(view), "chunks": len(digests),
            "mtime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "digest": "SHA-256=" + base64.urlsafe_b64encode(whole.digest()).decode(),
            "options": {"max_chunk_size": chunk_size},
        }
        await js.publish(_meta_subject(bucket, name), json.dumps(meta).encode(), headers={"Nats-Rollup": "sub"})
    except BaseException:
        try:  # let in-flight chunks land (briefly), then purge them
            await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 5.0)
        except asyncio.TimeoutError:
            pass
        try:
            await js.purge_stream(object_stream(bucket), subject=subject)
        except Exception:  # best effort: the caller sees the original error
            pass
        raise
    return ObjectRef(name=name, nuid=nuid, size=len(view), chunk_size=chunk_size, digests=digests, digest=whole.hexdigest())


async def delete_object(js: JetStreamContext, bucket: str, ref: ObjectRef, stream: str | None = None) -> None:
    """Purge the object's chunks and metadata from ``stream`` (default the bucket's own; a mirror works too)."""
    stream = stream or object_stream(bucket)
    try:
        await js.purge_stream(stream, subject=chunk_subject(bucket, ref.nuid))
        await js.purge_stream(stream, subject=_meta_subject(bucket, ref.name))
    except Exception as e:
        raise ObjectError(f"could not delete object {ref.name} from {stream}: {type(e).__name__}: {e}") from e


# ------------------------------------------------------------------------------ read


async def count_chunks(js: JetStreamContext, stream: str, subject: str) -> int:
    """How many messages ``stream`` holds on ``subject`` (one request; works on mirrors)."""
    info = await js.stream_info(stream, subjects_filter=subject)
    return int((info.state.subjects or {}).get(subject, 0))


def _place_chunk(out: np.ndarray, data: bytes, index: int, whole: Any, ref: ObjectRef) -> None:
    """Check chunk ``index`` (length, sha256) and copy it into place; runs on the hashing thread,
    off the event loop (hashlib and numpy release the GIL on large buffers)."""
    off = index * ref.chunk_size
    want_len = min(ref.chunk_size, ref.size - off)
    if len(data) != want_len:
        raise CorruptObject(f"object {ref.name}: chunk {index} has {len(data)} bytes, expected {want_len}")
    if hashlib.sha256(data).hexdigest() != ref.digests[index]:
        raise CorruptObject(f"object {ref.name}: chunk {index} fails its digest")
    whole.update(data)
    out[off : off + want_len] = np.frombuffer(data, dtype=np.uint8)


def _expected_chunks(ref: ObjectRef) -> int:
    n = max(1, -(-ref.size // ref.chunk_size)) if ref.chunk_size > 0 else -1
    if n != len(ref.digests):
        raise CorruptObject(f"object {ref.name}: {len(ref.digests)} chunk digests for {ref.size} bytes in chunks of {ref.chunk_size}")
    return n


async def get_object(js: JetStreamContext, bucket: str, ref: ObjectRef, stream: str | None = None, timeout: float = 10.0, wait_missing: float = 0.0) -> bytearray:
    """Read ``ref`` whole from ``stream`` (default: the bucket's own; pass a mirror's name, with a
    ``js`` of the mirror's domain, to read a mirror).

    Raises :class:`MissingObject` when chunks are absent (after waiting up to ``wait_missing``
    seconds for them to arrive, e.g. on a mirror that lags the announcement) and
    :class:`CorruptObject` when a chunk or the whole fails its digest or size.
    """
    stream = stream or object_stream(bucket)
    subject = chunk_subject(bucket, ref.nuid)
    n = _expected_chunks(ref)
    try:
        have = await count_chunks(js, stream, subject)
    except NotFoundError:
        raise MissingObject(f"object {ref.name}: stream {stream} not found") from None
    if have < n and wait_missing <= 0:
        raise MissingObject(f"object {ref.name}: {have} of {n} chunks on {stream}")
    out = bytearray(ref.size)
    view = np.frombuffer(out, dtype=np.uint8)
    whole = hashlib.sha256()
    loop = asyncio.get_running_loop()
    checks = []
    sub = await js.subscribe(subject, stream=stream, ordered_consumer=True, deliver_policy=api.DeliverPolicy.ALL,
                             pending_bytes_limit=max(256 << 20, 4 * ref.chunk_size))
    try:
        for i in range(n):
            try:
                msg = await sub.next_msg(timeout=timeout if have >= n else max(timeout, wait_missing))
            except (NatsTimeout, asyncio.TimeoutError):
                raise MissingObject(f"object {ref.name}: chunk {i} of {n} did not arrive from {stream}") from None
            checks.append(loop.run_in_executor(_HASHER, _place_chunk, view, msg.data, i, whole, ref))
        await asyncio.gather(*checks)
    finally:
        await asyncio.gather(*checks, return_exceptions=True)
        try:
            await sub.unsubscribe()
        except Exception:
            pass
    if whole.hexdigest() != ref.digest:
        raise CorruptObject(f"object {ref.name}: whole-payload digest mismatch")
    return out


class ObjectStore:
    """The run's payload bucket as one JetStream domain sees it: the hub's own stream, or a
    region's mirror of it (``stream``: the mirror's name; ``wait_missing``: how long a chunk may
    lag its announcement there). Made by :meth:`Plane.objects`."""

    def __init__(self, js: JetStreamContext, bucket: str, stream: str | None = None, wait_missing: float = 0.0,
                 max_payload: int = 8 << 20) -> None:
        self._js, self.bucket = js, bucket
        self.stream = stream or object_stream(bucket)
        self.wait_missing = wait_missing
        self.chunk_size = chunk_size_for(max_payload)

    async def put(self, name: str, data: bytes | bytearray | memoryview) -> ObjectRef:
        return await put_object(self._js, self.bucket, name, data, self.chunk_size)

    async def get(self, ref: ObjectRef, timeout: float = 10.0) -> bytearray:
        return await get_object(self._js, self.bucket, ref, stream=self.stream, timeout=timeout, wait_missing=self.wait_missing)

    async def delete(self, ref: ObjectRef) -> None:
        await delete_object(self._js, self.bucket, ref, stream=self.stream)

    async def chunks(self, ref: ObjectRef) -> int:
        """How many chunks of ``ref`` the stream holds (0 when the stream is gone)."""
        try:
            return await count_chunks(self._js, self.stream, chunk_subject(self.bucket, ref.nuid))
        except NotFoundError:
            return 0


# ------------------------------------------------------------------------------ regions


@dataclass(frozen=True)
class RegionStreams:
    """Where a region's node reads weights: the JetStream domain of its leaf and the mirror names there."""

    domain: str | None
    object_stream: str
    weights_stream: str


def region_streams(run: str, domain: str | None) -> RegionStreams:
    """Mirrors carry the hub streams' own names inside the leaf's domain."""
    names = Names(run)
    return RegionStreams(domain, object_stream(names.object_bucket), names.weights_stream)


async def ensure_region_mirrors(plane_on_leaf: Plane, run: str, hub_domain: str, leaf_domain: str | None = None,
                                weights_history: int = 64) -> RegionStreams:
    """Create (idempotently) on the leaf the mirrors of the hub's weights object stream and
    announcement stream, sourced through ``$JS.{hub_domain}.API`` over the leafnode link.

    ``plane_on_leaf`` is a :class:`~astraflow.streams.plane.Plane` connected to the leaf server;
    ``leaf_domain`` (default: the leaf server's own JetStream) is where the mirrors are made.
    """
    jsm = plane_on_leaf._jsm_for(leaf_domain)
    streams = region_streams(run, leaf_domain)
    external = api.ExternalStream(api=f"$JS.{hub_domain}.API")
    for name, per_subject in ((streams.object_stream, -1), (streams.weights_stream, weights_history)):
        cfg = api.StreamConfig(name=name, mirror=api.StreamSource(name=name, external=external), storage=api.StorageType.FILE,
                               max_msgs_per_subject=per_subject)
        try:
            await jsm.add_stream(cfg)
        except BadRequestError:
            info = await jsm.stream_info(name)
            mirror = info.config.mirror
            if mirror is None or mirror.name != name or mirror.external is None or mirror.external.api != external.api:
                raise RuntimeError(f"stream {name} exists on the leaf but is not a mirror of {name} in domain {hub_domain}; "
                                   "delete it or use another leaf domain") from None
    return streams
