"""Many messages of a stream by sequence, in a few requests: batched direct gets (ADR-31).

A trainer reads the trajectories its batch manifest names this way. The wanted sequences are
sorted and cut into runs of consecutive ones (:func:`runs`); each run is one request
``{"seq": first, "batch": n, "max_bytes": B}`` to ``$JS.API.DIRECT.GET.{stream}``, which the
server answers with the messages, in order, then an end-of-batch marker (status 204). No consumer
is made or deleted, and nothing between runs is sent. The answers come to one wildcard subscription per connection,
made at the first read and kept (:class:`Replies`): a read sends no SUB or UNSUB of its own, each of which would be a
write to the server of its own and a change to its subject index. Runs are requested concurrently, at most
``in_flight`` at a time and ``max_bytes`` each, so no run waits for another's round trip and the
bytes in flight stay bounded; a run the server cut at ``max_bytes`` goes on from the next sequence.

A sequence that is gone (deleted, or expired by the stream's max age) is skipped by the server,
which sends the next one there is instead (or answers 404): it is reported, with every other gone
sequence, by :class:`MissingMessages`. The stream must allow direct gets (``allow_direct``; the
plane's topology sets it on the TRAJ stream). A server older than 2.11 answers each request with
one message: the reads still complete, one request per message.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from astraflow.runtime import cancel_and_wait

DEFAULT_MAX_BYTES = 8 << 20  # per request: what one answer may carry before the server cuts it
DEFAULT_IN_FLIGHT = 8  # requests answered at once
REPLY_PENDING_BYTES = 4 * DEFAULT_IN_FLIGHT * DEFAULT_MAX_BYTES  # what the answers' subscription may hold unrouted


@dataclass(frozen=True, slots=True)
class StreamMsg:
    seq: int
    subject: str
    data: bytes


class MissingMessages(LookupError):
    """Sequences the stream no longer holds (deleted, or past its max age)."""

    def __init__(self, stream: str, seqs: list[int]) -> None:
        self.stream, self.seqs = stream, seqs
        shown = ", ".join(map(str, seqs[:8])) + (f" and {len(seqs) - 8} more" if len(seqs) > 8 else "")
        super().__init__(f"{len(seqs)} sequence(s) of {stream} are gone: {shown}")


class DirectGetError(RuntimeError):
    """The server refused a direct get (a bad request, or a stream without ``allow_direct``)."""


def _answer(msg: Msg, stream: str) -> tuple[StreamMsg | None, bool]:
    """One answer to a batched direct get: (the message it carries, None at the end of the batch; whether more
    answers follow). Raises :class:`DirectGetError` for a refusal (503: the stream does not allow direct gets)."""
    headers = msg.headers or {}
    status = headers.get("Status")
    if status in ("204", "404"):  # end of the batch; nothing (more) at or after the first asked for
        return None, False
    if status:
        raise DirectGetError(f"direct get on {stream} refused: {status} {msg.data.decode(errors='replace')[:200]} "
                             "(503: the stream does not allow direct gets)")
    found = StreamMsg(int(headers["Nats-Sequence"]), headers.get("Nats-Subject", ""), msg.data)
    return found, "Nats-Num-Pending" in headers  # a server before 2.11 answers one message, without an end marker


def runs(seqs: Iterable[int]) -> list[tuple[int, int]]:
    """Distinct sequences as runs of consecutive ones, ``(first, count)``, ascending."""
    out: list[tuple[int, int]] = []
    for s in sorted(set(seqs)):
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((s, 1))
    return out


class Replies:
    """The answers to one connection's direct gets: one subscription to ``{inbox}.*``, made at the first read and kept
    (the client makes it again after a reconnect), each answer routed by its reply subject to the read that asked."""

    def __init__(self, nc: Client) -> None:
        self.prefix = nc.new_inbox()  # the client is not kept: it is this object's key in ``_REPLIES``
        self.ids = itertools.count()
        self.waiting: dict[str, asyncio.Queue[Msg]] = {}  # reply subject -> its answers, while a read waits for them
        self.subscribed: asyncio.Task[Subscription] | None = None

    async def open(self, nc: Client) -> tuple[str, asyncio.Queue[Msg]]:
        """A fresh reply subject on ``nc`` and the queue its answers arrive in (:meth:`close` it once read)."""
        if self.subscribed is None:
            self.subscribed = asyncio.create_task(nc.subscribe(f"{self.prefix}.*", cb=self._route,
                                                               pending_bytes_limit=REPLY_PENDING_BYTES))
        subscribed = self.subscribed
        try:
            await asyncio.shield(subscribed)
        except Exception:
            self.subscribed = None  # the next read tries again
            raise
        reply = f"{self.prefix}.{next(self.ids)}"
        queue = self.waiting[reply] = asyncio.Queue()
        return reply, queue

    def close(self, reply: str) -> None:
        self.waiting.pop(reply, None)  # an answer still to come is dropped

    async def _route(self, msg: Msg) -> None:
        queue = self.waiting.get(msg.subject)
        if queue is not None:
            queue.put_nowait(msg)


_REPLIES: weakref.WeakKeyDictionary[Client, Replies] = weakref.WeakKeyDictionary()


def replies(nc: Client) -> Replies:
    """The connection's :class:`Replies`."""
    found = _REPLIES.get(nc)
    if found is None:
        found = _REPLIES[nc] = Replies(nc)
    return found


async def read_seqs(nc: Client, api_prefix: str, stream: str, seqs: Iterable[int], max_bytes: int = DEFAULT_MAX_BYTES,
                    in_flight: int = DEFAULT_IN_FLIGHT, timeout: float = 10.0) -> dict[int, StreamMsg]:
    """The messages at ``seqs`` of ``stream`` (``api_prefix``: ``$JS.API``, or ``$JS.{domain}.API``), by sequence.

    Raises :class:`MissingMessages` when some are gone, :class:`DirectGetError` when the server refuses,
    ``asyncio.TimeoutError`` when an answer stalls for ``timeout`` seconds."""
    wanted = runs(seqs)
    mux = replies(nc)
    got: dict[int, StreamMsg] = {}
    slots = asyncio.Semaphore(in_flight)

    async def request(first: int, last: int) -> int:
        """One batched get of ``[first, last]``; returns the highest sequence of the range that arrived (first - 1: none)."""
        reply, queue = await mux.open(nc)
        body = {"seq": first, "batch": last - first + 1, "max_bytes": max_bytes}
        highest = first - 1
        try:
            await nc.publish(f"{api_prefix}.DIRECT.GET.{stream}", json.dumps(body).encode(), reply=reply)
            while True:  # what has arrived is taken without a timer; only an empty queue is waited on
                msg = queue.get_nowait() if not queue.empty() else await asyncio.wait_for(queue.get(), timeout)
                answer, more = _answer(msg, stream)
                if answer is not None and answer.seq <= last:  # past ``last``: the server filled the batch beyond a gone one
                    got[answer.seq] = answer
                    highest = max(highest, answer.seq)
                if not more:
                    return highest
        finally:
            mux.close(reply)

    async def read_run(first: int, count: int) -> None:
        async with slots:
            last, start = first + count - 1, first
            while start <= last:
                highest = await request(start, last)
                if highest < start:  # nothing of the rest is there
                    return
                start = highest + 1  # cut at max_bytes (or past gone ones): go on after what arrived

    reads = [asyncio.ensure_future(read_run(first, count)) for first, count in wanted]
    try:
        await asyncio.gather(*reads)
    finally:  # one run failed: the others stop too
        await cancel_and_wait(*reads)
    gone = [s for first, count in wanted for s in range(first, first + count) if s not in got]
    if gone:
        raise MissingMessages(stream, gone)
    return got


async def read_subject(nc: Client, api_prefix: str, stream: str, subject: str, count: int, max_bytes: int = DEFAULT_MAX_BYTES,
                       timeout: float = 10.0) -> list[StreamMsg]:
    """The first ``count`` messages of ``stream`` on ``subject``, in order, by batched direct gets with
    ``next_by_subj`` (one request while the answer stays under ``max_bytes``): no stream info and no
    consumer. Fewer come back when the stream holds fewer. Raises :class:`DirectGetError` when the
    server refuses (503: no stream here allows direct gets, e.g. a mirror), ``asyncio.TimeoutError``
    when an answer stalls for ``timeout`` seconds."""
    got: list[StreamMsg] = []
    mux = replies(nc)
    reply, queue = await mux.open(nc)
    try:
        start = 1
        while len(got) < count:
            body = {"seq": start, "next_by_subj": subject, "batch": count - len(got), "max_bytes": max_bytes}
            await nc.publish(f"{api_prefix}.DIRECT.GET.{stream}", json.dumps(body).encode(), reply=reply)
            before = len(got)
            while True:
                msg = queue.get_nowait() if not queue.empty() else await asyncio.wait_for(queue.get(), timeout)
                answer, more = _answer(msg, stream)
                if answer is not None:
                    got.append(answer)
                if not more:
                    break
            if len(got) == before:
                break
            start = got[-1].seq + 1  # cut at max_bytes: go on after what arrived
    finally:
        mux.close(reply)
    return got
