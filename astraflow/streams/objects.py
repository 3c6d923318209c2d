"""Fast chunked object writer/reader for weight payloads, mirror-aware; region mirrors.

Layout is the JetStream object-store layout (stream ``OBJ_{bucket}``, chunks on
``$O.{bucket}.C.{nuid}``, metadata on ``$O.{bucket}.M.{name}``), so standard tooling can list
and read what we write. We do not use nats-py's ``ObjectStore.get``: it re-copies the buffer on
every chunk and finds the stream by subject, which fails on a mirror (a mirror has no
subjects). Here:

* the writer takes the payload whole or piece by piece as an encoder produces it, pipelines chunk
  publishes (``publish_async``, a bounded number unacknowledged), hashes as it goes, writes the
  metadata last and purges its chunks if anything fails (the encoder's error included); the
  caller's announcement is the commit point (STYLE 7);
* the reader binds a stream by name (the bucket's own, or a mirror's in another JetStream
  domain through a domain-scoped ``js``). A one-chunk payload comes in one batched direct get
  (:func:`read_one_chunk_object`: one round trip, no consumer). For a larger one it counts the
  chunks on the server first (a missing chunk is reported at once, not after a timeout), then
  streams them through an ordered push consumer with flow control (no request round trip per window) and checks each chunk's
  sha256 and length, and the whole payload's sha256, against the :class:`ObjectRef` of the
  announcement. Hashing runs on one helper thread, overlapping the network reads. Chunks are
  yielded in order as they check (:func:`iter_object`), so a node decodes or applies while it
  fetches; the last one only after the whole payload's sha256 checks.

A region (a leafnode with its own JetStream domain) mirrors the object stream and the weights
announcement stream of the hub: :func:`ensure_region_mirrors`.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import inspect
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext, JetStreamManager, api
from nats.js.errors import BadRequestError, NotFoundError

from astraflow.runtime import cancel_and_wait
from astraflow.streams.acks import AcksLost, acked, reconnects_of
from astraflow.streams.direct import DirectGetError, read_subject
from astraflow.streams.messages import ObjectRef
from astraflow.streams.subjects import Names

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from astraflow.streams.plane import Plane

DEFAULT_CHUNK = 2 * 1024 * 1024  # measured (benchmarks/bench_weight_transfer.py): 2-4 MiB read fastest
IN_FLIGHT = 32  # chunks a writer has unacknowledged at most (64 MiB at the default size)
READ_AHEAD = 16  # chunks a reader checks ahead of its consumer
_HASHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="af-objects-sha")  # one thread: chunks hash in order


class ObjectError(RuntimeError):
    """An object could not be read back whole."""


class WriteInterrupted(ObjectError):
    """The connection to the server was lost while a write waited for its chunks' acks: a chunk published into the
    dropped connection is never acknowledged, so the write is abandoned (its chunks purged) at once, not after the
    timeout; writing it again is safe (a fresh nuid)."""


class MissingObject(ObjectError):
    """Chunks of the object are not on the stream (deleted, never written, or a mirror lagging)."""


class CorruptObject(ObjectError):
    """A chunk or the whole payload does not match its digest or size: never apply it."""


def object_stream(bucket: str) -> str:
    return f"OBJ_{bucket}"


MAX_CONSUMERS = 100_000
"""Consumers each of a run's streams allows. nats-server 2.15 caps a stream that names no limit at 1,000 (and takes
0 or -1 for "its default"), while every rollout node follows the announcements with a consumer of its own and streams a
many-chunk version through another: a pool of about 500 nodes reached the cap (``benchmarks/bench_pool_scale.py``)."""


def chunk_subject(bucket: str, nuid: str) -> str:
    return f"$O.{bucket}.C.{nuid}"


def _meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


def chunk_size_for(max_payload: int, wanted: int = DEFAULT_CHUNK) -> int:
    """Chunks stay well under the server's max_payload (headers and framing need room)."""
    return max(64 * 1024, min(wanted, max_payload - 64 * 1024))


# ------------------------------------------------------------------------------ write


Data = bytes | bytearray | memoryview
Pieces = Iterable[Data]  # a payload handed over piece by piece, e.g. by an encoder while it encodes


def _in_chunks(data: Data | Pieces, chunk_size: int) -> Iterator[bytes]:
    """``data`` (whole, or pieces split anywhere) cut into chunks of ``chunk_size`` bytes, the last shorter."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        view = memoryview(data).cast("B")
        yield from (bytes(view[off : off + chunk_size]) for off in range(0, len(view), chunk_size))
        return
    buf = bytearray()
    for piece in data:
        buf += piece
        if len(buf) >= chunk_size:
            view = memoryview(buf)
            whole = len(buf) - len(buf) % chunk_size
            chunks = [bytes(view[off : off + chunk_size]) for off in range(0, whole, chunk_size)]
            view.release()
            del buf[:whole]
            yield from chunks
    if buf:
        yield bytes(buf)


def _next_chunk(chunks: Iterator[bytes], whole: Any, first: bool) -> tuple[bytes, str] | None:
    """The next chunk and its sha256 (the whole payload's hash updated), or None at the end; runs on a worker
    thread: pulling a piece may run its encoder, and hashlib releases the GIL. The first chunk's hash is the whole's
    so far: it is hashed once (a one-chunk payload, a small model's delta, is all of it)."""
    chunk = next(chunks, None)
    if chunk is None:
        return None
    whole.update(chunk)
    return chunk, (whole.copy() if first else hashlib.sha256(chunk)).hexdigest()


def owner_tag(owner: str) -> str:
    """The prefix of the object ids ``owner`` writes, so its objects can be told from others' by id alone."""
    return hashlib.sha256(owner.encode()).hexdigest()[:16] + "-"


async def put_object(js: JetStreamContext, bucket: str, name: str | Awaitable[str], data: Data | Pieces,
                     chunk_size: int = DEFAULT_CHUNK, timeout: float = 60.0, in_flight: int = IN_FLIGHT,
                     owner: str = "") -> ObjectRef:
    """Write ``data`` under a fresh nuid (chunks pipelined, metadata last); purge the chunks on
    failure, including chunk acks not all back within ``timeout`` seconds.

    ``data`` is the whole payload or an iterable of pieces split anywhere (an encoder's output):
    each chunk goes out as soon as its bytes are in, with at most ``in_flight`` chunks unacknowledged,
    so memory stays bounded; pulling pieces runs on a worker thread. An exception raised by the
    iterable aborts the write (chunks purged) and propagates. ``name`` may be awaitable, for a name
    known only once the data is written (it goes into the metadata, written last). ``owner``: the writer, whose tag
    prefixes the object id (:func:`owner_tag`; :func:`sweep_orphans` goes by it).
    """
    chunks = _in_chunks(data, chunk_size)
    nuid = (owner_tag(owner) if owner else "") + uuid.uuid4().hex
    subject = chunk_subject(bucket, nuid)
    digests: list[str] = []
    whole = hashlib.sha256()
    size = 0
    futs: list[asyncio.Future[Any]] = []
    reconnects = reconnects_of(js)
    pulling = asyncio.ensure_future(asyncio.to_thread(_next_chunk, chunks, whole, True))
    try:
        while True:
            nxt = await pulling
            if nxt is not None:  # the next chunk is encoded and hashed while this one goes out
                pulling = asyncio.ensure_future(asyncio.to_thread(_next_chunk, chunks, whole, False))
            elif digests:
                break
            chunk, digest = nxt or (b"", hashlib.sha256(b"").hexdigest())  # an empty payload is one empty chunk
            digests.append(digest)
            size += len(chunk)
            futs.append(await js.publish_async(subject, chunk, stream=object_stream(bucket)))
            if len(futs) > in_flight:  # bounded memory: wait for the oldest unacknowledged chunk
                await _acked(js, futs[-in_flight - 1], timeout, reconnects)
            if nxt is None:
                break
        await _acked(js, asyncio.gather(*futs), timeout, reconnects)
        name = name if isinstance(name, str) else await name
        meta = {
            "name": name, "bucket": bucket, "nuid": nuid, "size": size, "chunks": len(digests),
            "mtime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "digest": "SHA-256=" + base64.urlsafe_b64encode(whole.digest()).decode(),
            "options": {"max_chunk_size": chunk_size},
        }
        await js.publish(_meta_subject(bucket, name), json.dumps(meta).encode(), headers={"Nats-Rollup": "sub"})
    except BaseException as e:
        await asyncio.gather(pulling, return_exceptions=True)  # the pieces' producer is not left running
        if inspect.iscoroutine(name):  # never awaited: the write ended before its metadata
            name.close()
        try:  # let in-flight chunks land (briefly; those sent into a lost connection never will), then purge them
            await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 0.0 if isinstance(e, WriteInterrupted) else 5.0)
        except asyncio.TimeoutError:
            pass
        try:
            await js.purge_stream(object_stream(bucket), subject=subject)
        except Exception:  # best effort: the caller sees the original error
            pass
        raise
    return ObjectRef(name=name, nuid=nuid, size=size, chunk_size=chunk_size, digests=digests, digest=whole.hexdigest())


async def _acked(js: JetStreamContext, acks: Awaitable[Any], timeout: float, reconnects: int) -> None:
    try:
        await acked(js, acks, timeout, reconnects)
    except AcksLost as e:
        raise WriteInterrupted(f"the connection was lost during the write: {e}") from None


async def delete_object(js: JetStreamContext, bucket: str, ref: ObjectRef, stream: str | None = None) -> None:
    """Purge the object's chunks and metadata from ``stream`` (default the bucket's own; a mirror works too). The metadata
    is kept when it names another object: a later put under the same name (the same state stored again) owns it now."""
    stream = stream or object_stream(bucket)
    meta = _meta_subject(bucket, ref.name)
    try:  # the chunks purged while the metadata is read: one round trip, then the metadata's purge if it is this object's
        purged, last = await asyncio.gather(js.purge_stream(stream, subject=chunk_subject(bucket, ref.nuid)),
                                            js.get_last_msg(stream, meta), return_exceptions=True)
        if isinstance(purged, BaseException):
            raise purged
        if isinstance(last, NotFoundError):
            return
        if isinstance(last, BaseException) and not isinstance(last, Exception):  # cancelled: not a fact about the object
            raise last
        try:  # unreadable (a failed read, not JSON): purged, as before the check (a reader needs only the chunks)
            named = None if isinstance(last, Exception) else json.loads(last.data or b"{}")
        except ValueError:
            named = None
        if not isinstance(named, dict) or named.get("nuid") in (None, ref.nuid):
            await js.purge_stream(stream, subject=meta)
    except Exception as e:
        raise ObjectError(f"could not delete object {ref.name} from {stream}: {type(e).__name__}: {e}") from e


async def sweep_orphans(js: JetStreamContext, bucket: str, stream: str, owner: str, keep: set[str],
                        stale: Callable[[str], bool]) -> int:
    """Purge from ``stream`` (the bucket's own, or a mirror) the objects ``owner`` left behind; how many.

    A writer killed in the middle of a put leaves chunks and no metadata (the metadata goes last); one killed between
    its put and the announcement that would have named it leaves both. No announcement reaches them and retention,
    which works from announcements, never deletes them, so a restarted writer sweeps its own before it writes again (a
    trainer killed while a large model's keyframe was being stored leaves gigabytes). The candidates are the chunks
    whose id carries ``owner_tag(owner)`` and that no id in ``keep`` names; without any (a clean restart) nothing
    else is read. Otherwise the metadata is read: a candidate no metadata names is purged, and one whose metadata's
    name ``stale(name)`` says no announcement can come to name any more is purged with it. Objects without the tag
    (another writer's, or written before tags) are never touched."""
    tag = owner_tag(owner)
    candidates = {nuid for subject in await _subjects(js, stream, f"$O.{bucket}.C.>")
                  if (nuid := subject.rsplit(".", 1)[-1]).startswith(tag) and nuid not in keep}
    purged = 0
    for subject in await _subjects(js, stream, f"$O.{bucket}.M.>") if candidates else []:
        try:
            meta = json.loads((await js.get_last_msg(stream, subject)).data or b"{}")
        except Exception as e:  # purged meanwhile, or not JSON: not ours to judge
            log.debug("sweep: %s unreadable: %s", subject, e)
            continue
        nuid = str(meta.get("nuid", "")) if isinstance(meta, dict) else ""  # a foreign writer's junk names nothing
        if nuid in candidates:
            candidates.discard(nuid)  # it has metadata: kept unless stale
            if stale(str(meta.get("name", ""))):
                await js.purge_stream(stream, subject=chunk_subject(bucket, nuid))
                await js.purge_stream(stream, subject=subject)
                purged += 1
    for nuid in candidates:  # no metadata: a put that died before its end
        await js.purge_stream(stream, subject=chunk_subject(bucket, nuid))
        purged += 1
    return purged


async def _subjects(js: JetStreamContext, stream: str, subjects: str) -> list[str]:
    info = await js.stream_info(stream, subjects_filter=subjects)
    return list(info.state.subjects or {})


# ------------------------------------------------------------------------------ read


async def count_chunks(js: JetStreamContext, stream: str, subject: str) -> int:
    """How many messages ``stream`` holds on ``subject`` (one request; works on mirrors)."""
    info = await js.stream_info(stream, subjects_filter=subject)
    return int((info.state.subjects or {}).get(subject, 0))


def _check_chunk(data: bytes, index: int, whole: Any, ref: ObjectRef) -> bytes:
    """Check chunk ``index`` (length, sha256) and add it to the whole payload's hash; runs on the
    hashing thread, off the event loop (hashlib releases the GIL on large buffers)."""
    _require_chunk(data, index, ref)
    whole.update(data)
    return data


def _require_chunk(data: bytes, index: int, ref: ObjectRef) -> None:
    """Chunk ``index`` has its length and its sha256, or :class:`CorruptObject`."""
    want_len = min(ref.chunk_size, ref.size - index * ref.chunk_size)
    if len(data) != want_len:
        raise CorruptObject(f"object {ref.name}: chunk {index} has {len(data)} bytes, expected {want_len}")
    if hashlib.sha256(data).hexdigest() != ref.digests[index]:
        raise CorruptObject(f"object {ref.name}: chunk {index} fails its digest")


def _check_one(data: bytes, ref: ObjectRef) -> bytes:
    """Check a one-chunk object: the chunk's length and sha256, which is the whole payload's too."""
    _require_chunk(data, 0, ref)  # hashed once: the chunk's sha256 is the whole payload's
    if ref.digests[0] != ref.digest:
        raise CorruptObject(f"object {ref.name}: whole-payload digest mismatch")
    return data


async def read_one_chunk_object(js: JetStreamContext, bucket: str, ref: ObjectRef, stream: str | None = None,
                                timeout: float = 10.0, wait_missing: float = 0.0) -> bytes:
    """The payload of a one-chunk ``ref`` (a small model's delta), checked like :func:`iter_object`'s, in one direct
    get: one round trip where an ordered consumer takes a stream-info request, a consumer creation and a deletion.
    Raises :class:`MissingObject` (after waiting up to ``wait_missing`` seconds for the chunk to arrive),
    :class:`CorruptObject`, or ``DirectGetError`` when the stream does not answer direct gets (a mirror)."""
    stream = stream or object_stream(bucket)
    if _expected_chunks(ref) != 1:
        raise ValueError(f"object {ref.name} has {len(ref.digests)} chunks")
    deadline = time.monotonic() + wait_missing
    while not (msgs := await read_subject(js._nc, js._prefix, stream, chunk_subject(bucket, ref.nuid), 1, timeout=timeout)):
        if time.monotonic() >= deadline:
            raise MissingObject(f"object {ref.name}: 0 of 1 chunks on {stream}")
        await asyncio.sleep(0.05)
    return await asyncio.get_running_loop().run_in_executor(_HASHER, _check_one, msgs[0].data, ref)


def _expected_chunks(ref: ObjectRef) -> int:
    n = max(1, -(-ref.size // ref.chunk_size)) if ref.chunk_size > 0 else -1
    if n != len(ref.digests):
        raise CorruptObject(f"object {ref.name}: {len(ref.digests)} chunk digests for {ref.size} bytes in chunks of {ref.chunk_size}")
    return n


async def iter_object(js: JetStreamContext, bucket: str, ref: ObjectRef, stream: str | None = None, timeout: float = 10.0,
                      wait_missing: float = 0.0) -> AsyncGenerator[bytes, None]:
    """The chunks of ``ref`` in order, each yielded only once its length and sha256 check, the last
    one only once the whole payload's sha256 checks too: a consumer that reached the end holds
    exactly the announced payload. ``stream``: the bucket's own by default; pass a mirror's name,
    with a ``js`` of the mirror's domain, to read a mirror.

    Raises :class:`MissingObject` when chunks are absent (after waiting up to ``wait_missing``
    seconds for them to arrive, e.g. on a mirror that lags the announcement) and
    :class:`CorruptObject` when a chunk or the whole fails its digest or size. Chunks are read and
    checked ahead of the consumer (up to ``READ_AHEAD``; beyond that the server's flow control holds them).
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
    whole = hashlib.sha256()
    loop = asyncio.get_running_loop()
    checked: asyncio.Queue[asyncio.Future[bytes]] = asyncio.Queue(READ_AHEAD)
    sub = await js.subscribe(subject, stream=stream, ordered_consumer=True, deliver_policy=api.DeliverPolicy.ALL,
                             pending_bytes_limit=max(256 << 20, 4 * ref.chunk_size))

    async def read() -> None:
        for i in range(n):
            try:
                msg = await sub.next_msg(timeout=timeout if have >= n else max(timeout, wait_missing))
            except (NatsTimeout, asyncio.TimeoutError):
                failed: asyncio.Future[bytes] = loop.create_future()
                failed.set_exception(MissingObject(f"object {ref.name}: chunk {i} of {n} did not arrive from {stream}"))
                await checked.put(failed)
                return
            await checked.put(loop.run_in_executor(_HASHER, _check_chunk, msg.data, i, whole, ref))

    reader = asyncio.create_task(read())
    try:
        for i in range(n):
            chunk = await (await checked.get())
            if i == n - 1 and whole.hexdigest() != ref.digest:
                raise CorruptObject(f"object {ref.name}: whole-payload digest mismatch")
            yield chunk
    finally:
        await cancel_and_wait(reader)
        while not checked.empty():  # checks the consumer did not wait for: their errors are this one's
            await asyncio.gather(checked.get_nowait(), return_exceptions=True)
        try:
            await sub.unsubscribe()
        except Exception:
            pass


async def get_object(js: JetStreamContext, bucket: str, ref: ObjectRef, stream: str | None = None, timeout: float = 10.0,
                     wait_missing: float = 0.0) -> bytearray:
    """Read ``ref`` whole (:func:`iter_object`'s chunks, checked, in one buffer)."""
    out = bytearray(ref.size)
    off = 0
    async for chunk in iter_object(js, bucket, ref, stream, timeout, wait_missing):
        out[off : off + len(chunk)] = chunk
        off += len(chunk)
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
        self._direct = True  # until the stream refuses a direct get

    async def put(self, name: str | Awaitable[str], data: Data | Pieces, owner: str = "") -> ObjectRef:
        """Write ``data``, whole or piece by piece as it is produced (:func:`put_object`)."""
        return await put_object(self._js, self.bucket, name, data, self.chunk_size, owner=owner)

    async def sweep(self, owner: str, keep: set[str], stale: Callable[[str], bool]) -> int:
        """Purge what ``owner`` left behind here (:func:`sweep_orphans`); how many objects."""
        return await sweep_orphans(self._js, self.bucket, self.stream, owner, keep, stale)

    async def get(self, ref: ObjectRef, timeout: float = 10.0) -> bytearray:
        return await get_object(self._js, self.bucket, ref, stream=self.stream, timeout=timeout, wait_missing=self.wait_missing)

    async def iter_chunks(self, ref: ObjectRef, timeout: float = 10.0) -> AsyncGenerator[bytes, None]:
        """``ref``'s chunks in order, each checked before it is yielded: a one-chunk object in one direct get
        (:func:`read_one_chunk_object`), a larger one streamed so its reader works while it arrives
        (:func:`iter_object`), and every object streamed once this domain's stream refused a direct get (a mirror)."""
        if self._direct and len(ref.digests) == 1:
            try:
                data = await read_one_chunk_object(self._js, self.bucket, ref, self.stream, timeout, self.wait_missing)
            except DirectGetError:
                self._direct = False
            else:
                yield data
                return
        async with aclosing(iter_object(self._js, self.bucket, ref, stream=self.stream, timeout=timeout,
                                        wait_missing=self.wait_missing)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def delete(self, ref: ObjectRef) -> None:
        await delete_object(self._js, self.bucket, ref, stream=self.stream)

    async def chunks(self, ref: ObjectRef) -> int:
        """How many chunks of ``ref`` the stream holds (0 when the stream is gone)."""
        try:
            return await count_chunks(self._js, self.stream, chunk_subject(self.bucket, ref.nuid))
        except NotFoundError:
            return 0


async def allow_consumers(jsm: JetStreamManager, stream: str, limit: int) -> None:
    """Set ``stream``'s consumer limit to ``limit`` unless it has it (streams nats-py makes, object stores', name none)."""
    cfg = (await jsm.stream_info(stream)).config
    if cfg.max_consumers != limit:
        cfg.max_consumers = limit
        await jsm.update_stream(cfg)


# ------------------------------------------------------------------------------ regions


@dataclass(frozen=True)
class RegionStreams:
    """Where a region's node reads weights: the JetStream domain of its leaf and the mirror names there."""

    domain: str | None
    object_stream: str
    weights_stream: str

    def __str__(self) -> str:
        return f"{self.weights_stream}, {self.object_stream} in {self.domain or 'the leaf'}"


def region_streams(run: str, domain: str | None) -> RegionStreams:
    """Mirrors carry the hub streams' own names inside the leaf's domain."""
    names = Names(run)
    return RegionStreams(domain, object_stream(names.object_bucket), names.weights_stream)


async def ensure_region_mirrors(plane_on_leaf: Plane, run: str, hub_domain: str, leaf_domain: str | None = None,
                                weights_history: int = 64, max_consumers: int = MAX_CONSUMERS) -> RegionStreams:
    """Create (idempotently) on the leaf the mirrors of the hub's weights object stream and
    announcement stream, sourced through ``$JS.{hub_domain}.API`` over the leafnode link.

    ``plane_on_leaf`` is a :class:`~astraflow.streams.plane.Plane` connected to the leaf server;
    ``leaf_domain`` (default: the leaf server's own JetStream) is where the mirrors are made; each allows
    ``max_consumers`` (the region's nodes each read through their own).
    """
    jsm = plane_on_leaf._jsm_for(leaf_domain)
    streams = region_streams(run, leaf_domain)
    external = api.ExternalStream(api=f"$JS.{hub_domain}.API")
    for name, per_subject in ((streams.object_stream, -1), (streams.weights_stream, weights_history)):
        cfg = api.StreamConfig(name=name, mirror=api.StreamSource(name=name, external=external), storage=api.StorageType.FILE,
                               max_msgs_per_subject=per_subject, max_consumers=max_consumers)
        try:
            await jsm.add_stream(cfg)
        except BadRequestError:
            info = await jsm.stream_info(name)
            mirror = info.config.mirror
            if mirror is None or mirror.name != name or mirror.external is None or mirror.external.api != external.api:
                raise RuntimeError(f"stream {name} exists on the leaf but is not a mirror of {name} in domain {hub_domain}; "
                                   "delete it or use another leaf domain") from None
            await allow_consumers(jsm, name, max_consumers)  # a mirror made before the limit was named
    return streams
