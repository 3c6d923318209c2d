"""Fast chunked object writer/reader for weight payloads, mirror-aware.

Layout is the JetStream object-store layout (stream ``OBJ_{bucket}``, chunks on
``$O.{bucket}.C.{nuid}``, metadata on ``$O.{bucket}.M.{name}``), so standard tooling can list
and read what we write. We do not use nats-py's ``ObjectStore.get``: it re-copies the buffer on
every chunk and finds the stream by subject, which fails on a mirror. Here the reader binds a
stream by name (the bucket's own, or a mirror's in another JetStream domain), pulls chunks in
windows and checks a sha256 per chunk and for the whole object against the :class:`ObjectRef`
of the announcement. The writer pipelines chunk publishes and writes the metadata last; the
caller's announcement is the commit point (STYLE 7).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import time
import uuid
from typing import Any

from nats.errors import TimeoutError as NatsTimeout
from nats.js import api

from astraflow.streams.messages import ObjectRef

DEFAULT_CHUNK = 1024 * 1024
FETCH_WINDOW = 32


class ObjectError(RuntimeError):
    """An object could not be read back whole."""


class CorruptObject(ObjectError):
    """A chunk or the whole payload does not match its digest: never apply it."""


def object_stream(bucket: str) -> str:
    return f"OBJ_{bucket}"


def _meta_subject(bucket: str, name: str) -> str:
    return f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"


def chunk_size_for(max_payload: int, wanted: int = DEFAULT_CHUNK) -> int:
    """Chunks stay well under the server's max_payload (headers and framing need room)."""
    return max(64 * 1024, min(wanted, max_payload - 64 * 1024))


async def put_object(js: Any, bucket: str, name: str, data: bytes | bytearray | memoryview, chunk_size: int = DEFAULT_CHUNK) -> ObjectRef:
    view = memoryview(data).cast("B")
    nuid = uuid.uuid4().hex
    subject = f"$O.{bucket}.C.{nuid}"
    digests: list[str] = []
    whole = hashlib.sha256()
    futs = []
    try:
        for off in range(0, max(len(view), 1), chunk_size):
            chunk = bytes(view[off : off + chunk_size])
            digests.append(hashlib.sha256(chunk).hexdigest())
            whole.update(chunk)
            futs.append(await js.publish_async(subject, chunk, stream=object_stream(bucket)))
        await asyncio.gather(*futs)
        meta = {
            "name": name, "bucket": bucket, "nuid": nuid, "size": len(view), "chunks": len(digests),
            "mtime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "digest": "SHA-256=" + base64.urlsafe_b64encode(whole.digest()).decode(),
            "options": {"max_chunk_size": chunk_size},
        }
        await js.publish(_meta_subject(bucket, name), json.dumps(meta).encode(), headers={"Nats-Rollup": "sub"})
    except BaseException:
        await _purge(js, bucket, subject)
        raise
    return ObjectRef(name=name, nuid=nuid, size=len(view), chunk_size=chunk_size, digests=digests, digest=whole.hexdigest())


async def _purge(js: Any, bucket: str, subject: str) -> None:
    try:
        await js._jsm.purge_stream(object_stream(bucket), subject=subject)
    except Exception:
        pass


async def delete_object(js: Any, bucket: str, ref: ObjectRef) -> None:
    await _purge(js, bucket, f"$O.{bucket}.C.{ref.nuid}")
    await _purge(js, bucket, _meta_subject(bucket, ref.name))


async def get_object(js: Any, bucket: str, ref: ObjectRef, stream: str | None = None, timeout: float = 10.0) -> bytearray:
    """Read ``ref`` whole from ``stream`` (default: the bucket's own; pass a mirror's name to read a mirror)."""
    n = len(ref.digests)
    out = bytearray(ref.size)
    whole = hashlib.sha256()
    cfg = api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.ALL, inactive_threshold=30.0, mem_storage=True, num_replicas=1)
    sub = await js.pull_subscribe(f"$O.{bucket}.C.{ref.nuid}", stream=stream or object_stream(bucket), config=cfg)
    try:
        i = 0
        while i < n:
            try:
                msgs = await sub.fetch(batch=min(FETCH_WINDOW, n - i), timeout=timeout)
            except (NatsTimeout, asyncio.TimeoutError):
                raise ObjectError(f"object {ref.name}: chunk {i} of {n} missing (timed out)") from None
            for msg in msgs:
                if hashlib.sha256(msg.data).hexdigest() != ref.digests[i]:
                    raise CorruptObject(f"object {ref.name}: chunk {i} fails its digest")
                off = i * ref.chunk_size
                if off + len(msg.data) > ref.size:
                    raise CorruptObject(f"object {ref.name}: chunk {i} overruns the declared size")
                out[off : off + len(msg.data)] = msg.data
                whole.update(msg.data)
                i += 1
    finally:
        try:
            await sub.unsubscribe()
        except Exception:
            pass
    if whole.hexdigest() != ref.digest:
        raise CorruptObject(f"object {ref.name}: whole-payload digest mismatch")
    return out
