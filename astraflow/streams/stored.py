"""Messages a stream stores, read (and trimmed) by their stream sequence, and the state of its durable consumers: the
ports' view under the flows (``task_queue.py``, ``trajectory_log.py``, ``batch_queue.py``, ``weight_channel.py``,
``census.py``), reached as ``Plane.stored``. No role outside ``streams/`` names a stream or a sequence
(``tests/test_layering.py``).
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

from nats.aio.client import Client
from nats.js import JetStreamManager
from nats.js.errors import APIError, NotFoundError

from astraflow.streams.codec import decode
from astraflow.streams.consuming import ConsumerSettings, Lag, read_subject
from astraflow.streams.direct import StreamMsg, read_seqs
from astraflow.streams.messages import Message
from astraflow.streams.retry import QUICK_S, ask_again

M = TypeVar("M", bound=Message)
SEQUENCE_NOT_FOUND = 10043  # JetStream's error code for a delete of a sequence the stream does not hold


class StoredMessages:
    """One plane's reads of its streams (in its domain): by sequence, by subject, and its consumers' state."""

    def __init__(self, nc: Client, jsm: JetStreamManager, api_prefix: str) -> None:
        self._nc, self._jsm, self._api_prefix = nc, jsm, api_prefix

    # ---------------------------------------------------------------- consumers
    async def lag(self, stream: str, durable: str) -> Lag:
        info = await ask_again(lambda: self._jsm.consumer_info(stream, durable), f"the lag of {durable} on {stream}", self._jsm,
                               attempt_s=QUICK_S)
        delivered = int(info.delivered.stream_seq or 0) if info.delivered is not None else 0
        return Lag(info.num_pending or 0, info.num_ack_pending or 0, info.num_redelivered or 0, delivered)

    async def consumer_settings(self, stream: str, durable: str, patience: float | None = None) -> ConsumerSettings:
        """The server's settings of ``durable`` on ``stream``, asked again while the plane does not answer (a role's start
        during a member's restart: ``ask_again``; ``patience`` 0: one attempt)."""
        info = await ask_again(lambda: self._jsm.consumer_info(stream, durable), f"the settings of {durable} on {stream}", self._jsm,
                               patience=patience, attempt_s=QUICK_S)
        cfg = info.config
        return ConsumerSettings(float(cfg.ack_wait or 30.0), int(cfg.max_deliver or -1))

    # ---------------------------------------------------------------- streams
    async def stream_msgs(self, stream: str) -> int | None:
        """Messages ``stream`` holds; None when it does not exist."""
        try:
            return int((await self._jsm.stream_info(stream)).state.messages)
        except NotFoundError:
            return None

    async def stream_last(self, stream: str) -> int:
        """The sequence of the newest message ``stream`` has stored (0: none yet)."""
        return int((await self._jsm.stream_info(stream)).state.last_seq or 0)

    async def last(self, stream: str, subject: str, model: type[M]) -> M | None:
        """The newest message on ``subject`` in ``stream``, decoded; None when there is none."""
        try:
            raw = await self._jsm.get_last_msg(stream, subject)
        except NotFoundError:
            return None
        return decode(raw.data or b"", model)

    async def last_seq(self, stream: str, subject: str) -> int:
        """The stream sequence of the newest message on ``subject`` in ``stream``; 0 when there is none."""
        try:
            return int((await self._jsm.get_last_msg(stream, subject)).seq or 0)
        except NotFoundError:
            return 0

    async def held(self, stream: str, subject: str, model: type[M]) -> list[tuple[int, M]]:
        """(sequence, message) of every message ``stream`` still holds on ``subject`` (a work queue's unacked ones too)."""
        return await read_subject(self._jsm, stream, subject, model)

    # ---------------------------------------------------------------- by sequence
    async def holds(self, stream: str, seq: int) -> bool:
        """Whether ``stream`` still holds the message at ``seq`` (a work queue drops a message once it is acked)."""
        try:
            await self._jsm.get_msg(stream, seq)
        except NotFoundError:
            return False
        return True

    async def get(self, stream: str, seq: int, model: type[M]) -> M:
        """The message at sequence ``seq`` of ``stream``, decoded (NotFoundError when it is gone)."""
        raw = await self._jsm.get_msg(stream, seq)
        return decode(raw.data or b"", model)

    async def delete(self, stream: str, seq: int) -> bool:
        """Remove the message at ``seq`` from ``stream``; False when it was gone already."""
        try:
            return bool(await self._jsm.delete_msg(stream, seq))
        except APIError as e:
            if e.err_code == SEQUENCE_NOT_FOUND:  # deleted before, or acked from a work queue
                return False
            raise

    async def get_many(self, stream: str, seqs: list[int], model: type[M], timeout: float = 10.0) -> list[M]:
        """The messages at ``seqs`` of ``stream``, decoded, in the order asked: batched direct gets, a few requests
        for the lot (``streams/direct.py``). Raises ``MissingMessages`` naming every sequence that is gone, and
        ``DecodeError`` for one that does not decode. Decoding runs on a thread: the event loop keeps beating."""
        got = await self.read_many(stream, seqs, timeout)
        return await asyncio.to_thread(lambda: [decode(got[s], model) for s in seqs])

    async def read_many(self, stream: str, seqs: list[int], timeout: float = 10.0) -> dict[int, bytes]:
        """The bytes of the messages at ``seqs`` of ``stream``, by sequence (each distinct one read once), as
        :meth:`get_many` reads them; ``MissingMessages`` names every sequence that is gone."""
        return {s: m.data for s, m in (await self.read_stored(stream, seqs, timeout)).items()}

    async def read_stored(self, stream: str, seqs: list[int], timeout: float = 10.0) -> dict[int, StreamMsg]:
        """:meth:`read_many` with the subject each message was published on (the server's, not the publisher's word)."""
        return await read_seqs(self._nc, self._api_prefix, stream, seqs, timeout=timeout)
