"""Pull requests to a durable consumer, answered on one inbox: a whole pull for one wake-up, not one per message.

A fetch of up to ``batch`` messages asks ``$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}`` first
``no_wait`` (what is there now, ended by a ``404 No Messages`` status when there is less than
``batch``). Only when that brings nothing does it wait: a request for one message, its ``expires``
the time left (ended by ``408 Request Timeout``), then ``no_wait`` again for what came with it. So
a fetch returns with the first arrivals, where nats-py's ``fetch`` holds its waiting request open
until the whole batch or the timeout; and where nats-py starts two asyncio tasks per message
(``next_msg`` under ``wait_for``), the answers here land in a list from the subscription's
callback and a fetch wakes once per burst.

Each request has its own reply subject (``{inbox}.{n}``), so a status tells which request it ends:
a late ``408`` of a request given up on never cuts a newer one short. A message that arrives after
its fetch returned (the server delivered it as the client's time ran out) is delivered all the
same: it waits in the list and is the first thing the next fetch hands out, so nothing delivered
is dropped.

A consumer with one reader that takes all it is given (the dataflow's pull of the trajectory log)
may keep a **standing** request instead: one request for ``window`` messages that expires after
``STANDING_S``, asked again only when it ends (filled, expired, or given up on ``STANDING_GRACE_S``
after its expiry, as a request a restarted server forgot). Messages then arrive between fetches and a
fetch only takes them: about one request a second rather than one or two a fetch, at the price of
up to ``window`` messages delivered ahead of their fetch (their ack wait running).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import deque

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import APIError

HEARTBEAT = "100"
REQUEST_OVER = ("404", "408", "409")  # no messages, expired, conflict (e.g. too many waiting requests): the request is done
PENDING_BYTES = 256 << 20  # what the subscription may buffer before the callback takes it (nats-py's JetStream default)
STANDING_S = 1.0  # a standing request's expiry
STANDING_GRACE_S = 1.0  # after its expiry, a standing request with no word from the server is given up on


class PullRequests:
    """Fetches from one durable consumer of one stream, over one connection."""

    def __init__(self, nc: Client, api_prefix: str, stream: str, durable: str, standing: int = 0) -> None:
        """``standing``: the window of a standing request (0: a request per fetch)."""
        self._nc = nc
        self._window = standing
        self._standing: tuple[str, float] | None = None  # the standing request's reply subject and when it is given up on
        self._standing_left = 0  # messages it may still deliver
        self._subject = f"{api_prefix}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._inbox = ""
        self._sub: Subscription | None = None
        self._got: deque[Msg] = deque()  # answers not yet looked at, in arrival order
        self._arrived = asyncio.Event()
        self._ids = itertools.count()

    async def _on_msg(self, msg: Msg) -> None:
        self._got.append(msg)
        self._arrived.set()

    async def fetch(self, batch: int, timeout: float) -> list[Msg]:
        """Up to ``batch`` messages; an empty list when none came within ``timeout`` seconds. Raises nats-py's
        ``APIError`` (``ServiceUnavailableError`` for 503) for a status that is not the end of a request."""
        if self._sub is None:
            self._inbox = self._nc.new_inbox()
            self._sub = await self._nc.subscribe(f"{self._inbox}.*", cb=self._on_msg, pending_bytes_limit=PENDING_BYTES)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self._window:
            return await self._fetch_standing(batch, deadline)
        out, _, _ = self._take(batch, None)  # delivered after an earlier fetch returned: hand it out first
        if out:
            return out
        out = await self._request(batch, {"no_wait": True}, deadline)
        left = deadline - loop.time()
        if out or left <= 0.001:
            return out
        out = await self._request(1, {"expires": int(left * 1e9) - 100_000}, deadline)  # wait for the first one only
        if out and batch > 1:  # and take what came with it
            out += await self._request(batch - 1, {"no_wait": True}, deadline)
        return out

    async def _fetch_standing(self, batch: int, deadline: float) -> list[Msg]:
        """Up to ``batch`` of what the standing request delivered, waiting until ``deadline`` for the first; the request
        asked again whenever none stands."""
        loop = asyncio.get_running_loop()
        while True:
            out = self._take_standing(batch)
            if out:
                return out
            now = loop.time()
            if self._standing is None or now > self._standing[1]:
                reply = f"{self._inbox}.{next(self._ids)}"
                self._standing, self._standing_left = (reply, now + STANDING_S + STANDING_GRACE_S), self._window
                await self._ask(reply, self._window, {"expires": int(STANDING_S * 1e9)})
            if deadline - now <= 0:
                return []
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), deadline - now)
            except asyncio.TimeoutError:
                return self._take_standing(batch)

    def _take_standing(self, n: int) -> list[Msg]:
        """Up to ``n`` delivered messages; a status that ends the standing request ends it (another is asked for by the
        next fetch), and so does its last message (the server ends a filled request without a word)."""
        out, ended, error = self._take(n, self._standing[0] if self._standing is not None else None)
        self._standing_left -= len(out)
        if ended or self._standing_left <= 0:
            self._standing = None
        if error is not None:  # what came before it is handed out by the next fetch, not dropped
            self._got.extendleft(reversed(out))
            APIError.from_msg(error)  # raises (NoReturn): ServiceUnavailableError for 503, else APIError
        return out

    async def _ask(self, reply: str, batch: int, options: dict[str, object]) -> None:
        await self._nc.publish(self._subject, json.dumps({"batch": batch, **options}).encode(), reply=reply)

    async def _request(self, batch: int, options: dict[str, object], deadline: float) -> list[Msg]:
        reply = f"{self._inbox}.{next(self._ids)}"
        await self._ask(reply, batch, options)
        loop = asyncio.get_running_loop()
        out: list[Msg] = []
        while len(out) < batch:
            if not self._got:
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    break
                continue
            got, ended, error = self._take(batch - len(out), reply)
            out += got
            if error is not None:  # what came before it is handed out by the next fetch, not dropped
                self._got.extendleft(reversed(out))
                APIError.from_msg(error)  # raises (NoReturn): ServiceUnavailableError for 503, else APIError
            if ended:
                break
        return out

    def _take(self, n: int, reply: str | None) -> tuple[list[Msg], bool, Msg | None]:
        """Up to ``n`` messages from what arrived; whether request ``reply`` ended among them; the error status that
        ended it, if one did. Statuses of other requests (over already) and heartbeats are dropped."""
        out: list[Msg] = []
        while self._got and len(out) < n:
            msg = self._got.popleft()
            status = msg.headers.get("Status") if msg.headers else None
            if status is None:
                out.append(msg)
            elif status == HEARTBEAT or msg.subject != reply:
                continue
            else:
                return out, True, None if status in REQUEST_OVER else msg
        return out, False, None
