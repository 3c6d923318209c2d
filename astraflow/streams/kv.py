"""The run's KV buckets as typed run state: :class:`RunState` reads and writes :mod:`records <astraflow.streams.state>`.

Two buckets per run: ``af_{run}_state`` (history 1, kept for the run) and ``af_{run}_fates``
(per-task fates, every value expiring after ``plane.fate_ttl``, so the bucket does not grow
with the run). Writes go through the plane's JetStream domain, so a node on a region's leaf
writes the hub's state (nats-py's own ``put`` uses ``$KV.…``, which is not forwarded across
domains).
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from astraflow.streams.retry import QUICK_S, ask_again
from astraflow.streams.state import Record, StateReadError
from astraflow.streams.subjects import Names

R = TypeVar("R", bound=Record)


class RunState:
    """Typed access to one run's state. ``get`` -> record or None (absent); raises :class:`StateReadError` when it failed."""

    def __init__(self, js: JetStreamContext, names: Names, domain: str | None) -> None:
        self._js, self._names, self._domain = js, names, domain
        self._buckets: dict[str, KeyValue] = {}

    def _bucket_name(self, cls: type[Record]) -> str:
        return self._names.fates_bucket if cls.fates else self._names.state_bucket

    async def _bucket(self, name: str) -> KeyValue:
        if name not in self._buckets:
            self._buckets[name] = await self._js.key_value(name)
        return self._buckets[name]

    def forget(self) -> None:
        """Bind the buckets again on the next call (after the topology was created)."""
        self._buckets.clear()

    async def _entry(self, cls: type[Record], key: str) -> tuple[bytes | None, int]:
        name = self._bucket_name(cls)

        async def read() -> KeyValue.Entry:
            return await (await self._bucket(name)).get(key)

        try:
            entry = await ask_again(read, f"reading {key} from {name}", self._js, attempt_s=QUICK_S)
        except KeyNotFoundError:  # never written, deleted or purged
            return None, 0
        except (BucketNotFoundError, NotFoundError) as e:
            raise StateReadError(f"run state bucket {name} does not exist (is the run id right?): {e}") from None
        except Exception as e:  # timeouts, no responders, connection loss: not "absent"
            raise StateReadError(f"reading {key} from {name} failed: {type(e).__name__}: {e}") from None
        return (entry.value or None), int(entry.revision or 0)

    async def get(self, cls: type[R], *parts: str | int) -> R | None:
        """The record at ``cls.key_for(*parts)``; None when absent."""
        key = cls.key_for(*parts)
        value, _ = await self._entry(cls, key)
        return None if value is None else cls.decode(key, value)

    async def revision(self, cls: type[Record], *parts: str | int) -> int:
        """The KV revision of the record (0 when absent): a new write has a higher one."""
        value, rev = await self._entry(cls, cls.key_for(*parts))
        return rev if value is not None else 0

    def _subject(self, record: Record) -> str:
        subject = f"$KV.{self._bucket_name(type(record))}.{record.key}"
        return f"$JS.{self._domain}.API.{subject}" if self._domain else subject

    async def put(self, record: Record) -> None:
        await ask_again(lambda: self._js.publish(self._subject(record), record.encode()), f"writing {record.key}", self._js,
                        attempt_s=QUICK_S)

    async def put_many(self, records: list[Record]) -> None:
        """Pipelined writes, each acknowledged by the server before this returns."""

        async def write() -> None:
            futs = [await self._js.publish_async(self._subject(r), r.encode()) for r in records]
            if futs:
                await asyncio.gather(*futs)

        await ask_again(write, f"writing {len(records)} records", self._js, attempt_s=QUICK_S)

    async def delete(self, cls: type[Record], *parts: str | int) -> None:
        await (await self._bucket(self._bucket_name(cls))).delete(cls.key_for(*parts))
