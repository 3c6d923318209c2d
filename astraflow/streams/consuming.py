"""Typed consuming: deliveries to settle, durable pull consumers, followers of one subject.

Everything a role reads from a stream comes through here already decoded. A message that does
not decode is never handed over: from a work stream it goes to the dead-letter stream with the
reason and is terminated (:class:`Consumer`); from a history (announcements), it is counted,
logged and skipped, and the messages after it are still read (:class:`Follower`,
:func:`read_history`). A follower can also be given a ``check`` of the decoded values: a message
it finds a reason against is dead-lettered with its original bytes and not handed over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Literal, TypeVar

from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext, JetStreamManager, api
from nats.js.errors import NotFoundError, ServiceUnavailableError

from astraflow.runtime import cancel_and_wait
from astraflow.streams.codec import DecodeError, decode
from astraflow.streams.messages import Message, Refusal
from astraflow.streams.pull import PullRequests

if TYPE_CHECKING:
    from astraflow.streams.plane import Plane

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)
OnBad = Callable[[str, str], None]  # (subject, reason) of a message that did not decode
Check = Callable[[M], str | None]  # a reason to turn a decoded message away, or None
DeadLetter = Callable[[str, bytes, str], Awaitable[None]]  # (subject, original bytes, reason): to the DLQ
UNAVAILABLE_PATIENCE_S = 30.0  # how long pulls answered "unavailable" count as nothing to pull (a leader being elected)


def log_bad(subject: str, reason: str) -> None:
    log.warning("undecodable message on %s skipped: %s", subject, reason[:300])


@dataclass(frozen=True)
class Lag:
    """Consumer lag as the server reports it."""

    pending: int  # not yet delivered
    ack_pending: int  # delivered, not yet acked
    redelivered: int
    delivered: int = 0  # the highest stream sequence delivered so far


@dataclass(frozen=True)
class ConsumerSettings:
    """A durable consumer's settings as the server has them (not our defaults)."""

    ack_wait: float  # seconds before an unacked delivery is redelivered
    max_deliver: int  # deliveries before the server gives up (-1: never)


class Delivery(Generic[M]):
    """A decoded message plus the handle to settle it. Every delivery is acked, nak'ed or termed on purpose."""

    def __init__(self, msg: M, raw: Msg, plane: Plane) -> None:
        self.msg = msg
        self._raw = raw
        self._plane = plane

    @property
    def num_delivered(self) -> int:
        return int(self._raw.metadata.num_delivered or 1)

    @property
    def position(self) -> int:
        """Sequence of the message in its stream (trajectories are read back by it), read from the ack subject alone:
        ``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>...`` (9 tokens), or with a domain and an account hash
        after ``ACK`` (12 or more); nats-py's full metadata (timestamps, counters) costs several times more per message."""
        tokens = (self._raw.reply or "").split(".")
        if tokens[:2] == ["$JS", "ACK"] and (len(tokens) == 9 or len(tokens) >= 11):
            return int(tokens[5 if len(tokens) == 9 else 7])
        return int(self._raw.metadata.sequence.stream)  # not an ack subject: nats-py says why

    @property
    def subject(self) -> str:
        return self._raw.subject

    @property
    def data(self) -> bytes:
        """The original bytes, as published."""
        return self._raw.data

    async def ack(self, confirm: bool = False) -> None:
        """Acknowledge it; with ``confirm``, wait until the server says it took the ack (one round trip). A confirmation
        that does not come is no error: the ack was sent, and a message whose ack was lost is redelivered."""
        if not confirm:
            await self._raw.ack()
            return
        try:
            await self._raw.ack_sync()
        except NatsTimeout:
            log.warning("the server did not confirm the ack of %s in time", self._raw.subject)

    async def nak(self, delay: float | None = None) -> None:
        await self._raw.nak(delay=delay)

    async def in_progress(self) -> None:
        await self._raw.in_progress()

    async def term(self) -> None:
        await self._raw.term()

    async def dead_letter(self, payload: bytes, reason: str, code: str = "") -> None:
        """Dead-letter ``payload``, a part of this message (one trajectory of a group), with ``reason``, as if it had
        come alone on this subject; this delivery is not settled."""
        await self._plane.reject(self._raw.subject, payload, reason, self._raw.headers, code)

    async def reject(self, reason: str, code: str = "") -> None:
        """Dead-letter it with ``reason`` and the typed ``code`` of what failed (the original bytes kept), then terminate
        it: never redelivered."""
        await self._plane.reject(self._raw.subject, self._raw.data, reason, self._raw.headers, code)
        await self._raw.term()

    async def refuse(self, refusal: Refusal) -> None:
        """Turn a batch away: dead-lettered with its typed refusal, never redelivered."""
        await self.reject(refusal.reason, refusal.code.value)


class Consumer(Generic[M]):
    """A durable pull consumer, bound by name, that hands out typed deliveries."""

    def __init__(self, plane: Plane, stream: str, durable: str, decoder: Callable[[bytes], M], standing: int = 0) -> None:
        self._plane = plane
        self.stream, self.durable, self.decoder = stream, durable, decoder  # decoder: bytes -> message, or DecodeError
        self._standing = standing  # the window of a standing pull request (``pull.py``); 0: a request per pull
        self._pulls: PullRequests | None = None
        self._unavailable_since: float | None = None  # when pulls began to be answered "unavailable" (None: they are not)

    async def pull(self, batch: int = 1, timeout: float = 1.0) -> list[Delivery[M]]:
        """Fetch up to ``batch`` messages; an empty list on timeout. Bad ones go to the DLQ."""
        if self._pulls is None:
            self._pulls = PullRequests(self._plane._nc, self._plane.api_prefix, self.stream, self.durable, self._standing)
        try:
            raws = await self._pulls.fetch(batch, timeout)
        except (NatsTimeout, asyncio.TimeoutError):
            return []
        except ServiceUnavailableError as unavailable:  # JetStream is not up, a cluster is electing the consumer's leader, or forgot it
            try:
                if await self._plane.remake_consumer(self.stream, self.durable):  # forgotten (a restart without its store)
                    return []
                await self._plane.stored.consumer_settings(self.stream, self.durable, patience=0.0)  # one probe: is it there?
            except NotFoundError:  # forgotten, and not this role's to make again: it says so
                raise unavailable from None
            except (NatsError, TimeoutError):  # no answer either: the plane is still coming back
                pass
            now = time.monotonic()
            self._unavailable_since = self._unavailable_since or now
            if now - self._unavailable_since > UNAVAILABLE_PATIENCE_S:
                raise unavailable from None
            await asyncio.sleep(min(timeout, 0.5))
            return []
        self._unavailable_since = None
        out: list[Delivery[M]] = []
        for raw in raws:
            try:
                out.append(Delivery(self.decoder(raw.data), raw, self._plane))
            except DecodeError as e:
                await self._plane.reject(raw.subject, raw.data, str(e), raw.headers)
                await raw.term()
        return out

    async def lag(self) -> Lag:
        return await self._plane.stored.lag(self.stream, self.durable)

    async def settings(self) -> ConsumerSettings:
        return await self._plane.stored.consumer_settings(self.stream, self.durable)


class Follower(Generic[M]):
    """Follows one subject of a stream bound by name (mirrors too) through an ordered push
    consumer; ``fetch`` returns what arrived since the last call, decoded, oldest first.
    ``start``: ``last`` (the newest message and what follows) or ``all`` (the whole history).

    An ordered consumer is ephemeral and flow-controlled: the server pushes into this
    process's own inbox (no pull request per window, no permission to pull anyone's durable),
    and the client remakes it from the next sequence when a heartbeat or a sequence is missed
    (a lost message). A server that restarted has lost the consumer: :meth:`resume`, called when
    the connection is back, makes it again at once from the sequence after the last one handed
    in, rather than two missed heartbeats later (seconds in which a fast subject can run past
    what its stream keeps).
    """

    def __init__(self, js: JetStreamContext, stream: str, subject: str, model: type[M], start: Literal["last", "all"] = "last",
                 on_bad: OnBad = log_bad, check: Check[M] | None = None, dead_letter: DeadLetter | None = None) -> None:
        self._js, self.stream, self.subject, self.model = js, stream, subject, model
        self._start, self._on_bad = start, on_bad
        self._check, self._dead_letter = check, dead_letter
        self._sub: JetStreamContext.PushSubscription | None = None
        self._subscribing = asyncio.Lock()
        self._last_seq = 0  # the stream sequence of the newest message handed in (0: none yet)
        self._generation = 0  # which consumer may hand messages in: the one made last, none once closed
        self._got: list[Msg] = []
        self._arrived = asyncio.Event()
        self._missing = 0
        self.rejected = 0

    def _handing_in(self, generation: int) -> Callable[[Msg], Awaitable[None]]:
        """The callback of the consumer made as ``generation``. A consumer this follower has replaced or closed may
        still deliver (its messages were on their way); what it delivers is dropped, not handed in, so that it cannot
        move ``_last_seq`` past what the current one is to deliver (it delivers those again, from ``_last_seq``)."""

        async def on_msg(msg: Msg) -> None:
            seq = msg.metadata.sequence.stream
            if generation != self._generation or seq <= self._last_seq:  # replaced, or remade from an earlier sequence
                return
            self._last_seq = seq
            self._got.append(msg)
            self._arrived.set()

        return on_msg

    async def _subscribe(self) -> None:
        """The ordered consumer, from the sequence after the last one handed in (or from ``start`` when none was)."""
        async with self._subscribing:
            if self._sub is not None:
                return
            config = api.ConsumerConfig(opt_start_seq=self._last_seq + 1) if self._last_seq else None
            deliver = api.DeliverPolicy.BY_START_SEQUENCE if self._last_seq else \
                api.DeliverPolicy.LAST if self._start == "last" else api.DeliverPolicy.ALL
            self._generation += 1
            self._sub = await self._js.subscribe(self.subject, stream=self.stream, ordered_consumer=True,
                                                 cb=self._handing_in(self._generation), idle_heartbeat=2.0, deliver_policy=deliver,
                                                 config=config)

    async def resume(self) -> None:
        """Make the consumer again from the sequence after the last one handed in (the connection is back, maybe to a
        server that restarted and lost it). One that cannot be made now is made by the next :meth:`fetch`."""
        if self._sub is None:
            return
        await self.close()
        try:
            await self._subscribe()
        except Exception as e:  # the server may be gone again: the next fetch tries
            log.debug("following %s again: %s", self.subject, e)

    @property
    def following(self) -> bool:
        """A ``fetch(0)`` costs no request: the consumer is made (what the server pushes lands here), or what it pushed
        before it was lost is still to be handed over."""
        return self._sub is not None or bool(self._got)

    async def arrival(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for something to fetch; True if there is (the next ``fetch`` hands it over)."""
        if not self._got:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), timeout)
        return bool(self._got)

    async def fetch(self, wait: float) -> list[M]:
        """What arrived since the last call; waits up to ``wait`` seconds when nothing has (0: returns at once). A
        consumer that is not made (yet, or any more) is made first, unless what arrived before is still to be handed
        over."""
        if self._sub is None and not self._got:
            try:
                await self._subscribe()
            except (NatsError, TimeoutError) as e:  # the stream is not there yet (a region whose mirror is being made), or no
                self._missing += 1  # server can make the consumer now (a restart, an election): nothing to read, ask again later
                if self._missing == 1 or self._missing % 30 == 0:
                    why = "not there yet" if isinstance(e, NotFoundError) else f"its consumer cannot be made now ({type(e).__name__})"
                    log.warning("waiting for stream %s (%s): %s", self.stream, self.subject, why)
                await asyncio.sleep(wait)
                return []
            self._missing = 0
        if wait > 0:
            await self.arrival(wait)
        raws, self._got = self._got, []
        self._arrived.clear()
        return await self._decode(raws)

    async def hand_over(self, cb: Callable[[M], Awaitable[None]]) -> Subscription:
        """Call ``cb`` with every message, in order, from a task of its own, until the returned subscription is stopped
        (then the follower is closed). Subscribed before this returns: what is published from now on is handed over. An
        error of ``cb`` is logged and the messages after it are still handed over."""
        first = await self.fetch(0.0)

        async def hand_over() -> None:
            arrived = first
            while True:
                for msg in arrived:
                    try:
                        await cb(msg)
                    except Exception:
                        log.exception("following %s: the handler failed on a message; going on", self.subject)
                try:
                    arrived = await self.fetch(1.0)
                except Exception as e:  # whatever the plane did, following goes on: a dead task would stop it unseen
                    log.warning("following %s: %s: %s; going on", self.subject, type(e).__name__, e)
                    arrived = []
                    await asyncio.sleep(1.0)

        task = asyncio.create_task(hand_over())

        async def stop() -> None:
            await cancel_and_wait(task)
            await self.close()

        return Subscription(stop)

    async def _decode(self, raws: list[Msg]) -> list[M]:
        """Decoded, oldest first; what does not decode, or fails ``check`` (checked in order, so a check
        may remember what it passed), is counted, reported to ``on_bad`` and, after a check, dead-lettered."""
        out = []
        for m in raws:
            try:
                msg = decode(m.data, self.model)
            except DecodeError as e:
                self.rejected += 1
                self._on_bad(m.subject, str(e))
                continue
            reason = self._check(msg) if self._check is not None else None
            if reason is None:
                out.append(msg)
                continue
            self.rejected += 1
            self._on_bad(m.subject, reason)
            if self._dead_letter is not None:
                try:
                    await self._dead_letter(m.subject, m.data, reason)
                except Exception as e:  # the DLQ is a report: failing to write it must not stop the follower
                    log.warning("could not dead-letter a message on %s: %s", m.subject, e)
        return out

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        self._generation += 1  # what it still delivers is not handed in
        if sub is not None:
            try:
                await sub.unsubscribe()
            except Exception:  # the connection may be gone already
                pass


class IncompleteHistory(TimeoutError):
    """A history read that did not reach the end of what the stream holds in time: never handed over as if it were whole
    (a caller that took it for the whole history would, e.g., take announced payloads for orphans)."""


async def read_history(js: JetStreamContext, stream: str, subject: str, model: type[M], last_only: bool = False,
                       timeout: float = 5.0, on_bad: OnBad = log_bad) -> list[M]:
    """Every message (or only the last) ``stream`` holds on ``subject``, decoded, oldest first.
    Binds the stream by name, so it reads mirrors too; returns at once when there is nothing.
    Reads through an ordered push consumer until the server says nothing is pending; one that has not got there within
    ``timeout`` raises :class:`IncompleteHistory`, unless nothing came because the subject was trimmed to nothing meanwhile."""
    subjects = (await js.stream_info(stream, subjects_filter=subject)).state.subjects or {}
    if not sum(subjects.values()):
        return []
    raws: list[Msg] = []
    done = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        raws.append(msg)
        if msg.metadata.num_pending == 0 or last_only:
            done.set()

    deliver = api.DeliverPolicy.LAST if last_only else api.DeliverPolicy.ALL
    sub = await js.subscribe(subject, stream=stream, ordered_consumer=True, deliver_policy=deliver, cb=on_msg)
    try:
        await asyncio.wait_for(done.wait(), timeout)
    except asyncio.TimeoutError:
        held = sum(((await js.stream_info(stream, subjects_filter=subject)).state.subjects or {}).values())
        if raws or held:  # not trimmed away: the read fell behind
            raise IncompleteHistory(f"{stream} {subject}: {len(raws)} messages read in {timeout:.0f}s, the stream holds "
                                    f"{held}; not the whole history") from None
    finally:
        await sub.unsubscribe()
    out = []
    for m in raws:
        try:
            out.append(decode(m.data, model))
        except DecodeError as e:
            on_bad(m.subject, str(e))
    return out


async def read_subject(jsm: JetStreamManager, stream: str, subject: str, model: type[M],
                       on_bad: OnBad = log_bad) -> list[tuple[int, M]]:
    """Every message ``stream`` holds on ``subject`` with its sequence, decoded, oldest first. One ``STREAM.MSG.GET``
    (``next_by_subj``) per message and no consumer: it reads a work-queue stream, where a consumer may not overlap
    the durable one. For a few messages (a trainer's batches still in the BATCH stream)."""
    out: list[tuple[int, M]] = []
    seq = 1
    while True:
        try:
            raw = await jsm.get_msg(stream, seq, subject=subject, next=True)
        except NotFoundError:  # nothing at or after ``seq``
            return out
        try:
            out.append((int(raw.seq or 0), decode(raw.data or b"", model)))
        except DecodeError as e:
            on_bad(subject, str(e))
        seq = int(raw.seq or 0) + 1


class Subscription:
    """A running subscription (push consumer or core NATS); ``stop`` ends it."""

    def __init__(self, stop: Callable[[], Awaitable[None]]) -> None:
        self._stop = stop

    async def stop(self) -> None:
        try:
            await self._stop()
        except Exception:  # the connection may be gone already
            pass
