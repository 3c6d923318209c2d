"""Requests the plane did not answer, asked again (:func:`ask_again`).

A request in flight when its server goes away (``up`` restarting a killed server, a cluster electing a leader) is lost
with the connection and times out, while the same read a moment later, on the reconnected client, is answered. A role
that gave up on the first timeout crashed and was restarted with its supervisor's backoff: 15 s of a stalled run for a
server that was back in a tenth of a second. Only requests that can be repeated are asked again: reads, and writes
of a whole value under its key (a run-state record), which leave the same state however often they land. An append to
a stream is not: its repeat is a second message (those writers deduplicate by message id, or check, instead).

Given the connection, a request is not waited for past a reconnect: one sent into the connection that dropped is
never answered, and its timeout (10 s) would stall the role; it is asked again at once on the new connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext, JetStreamManager
from nats.js.errors import ServiceUnavailableError

from astraflow.streams.acks import AcksLost, acked, reconnects_of

log = logging.getLogger(__name__)
T = TypeVar("T")
UNANSWERED = (NatsTimeoutError, NoRespondersError, ServiceUnavailableError, AcksLost)  # no answer came (it may have landed)
ATTEMPTS = 3
PAUSE_S = 0.5  # before the second attempt; twice that before the third
LONGER_THAN_ANY_REQUEST_S = 3600.0  # the request's own timeout ends an attempt first


async def ask_again(request: Callable[[], Awaitable[T]], what: str, js: JetStreamContext | JetStreamManager | None = None,
                    attempts: int = ATTEMPTS) -> T:
    """``request()``, asked again up to ``attempts`` times in all while the plane does not answer; its last error then.
    With ``js`` (the connection it goes out on), an attempt the connection was re-established under is given up at once."""
    for attempt in range(1, attempts + 1):
        try:
            if js is None:
                return await request()
            answer: T = await acked(js, request(), LONGER_THAN_ANY_REQUEST_S, reconnects_of(js))
            return answer
        except UNANSWERED as e:
            if attempt == attempts:
                raise
            log.info("%s: no answer (%s); asking again", what, type(e).__name__)
            await asyncio.sleep(0.0 if isinstance(e, AcksLost) else PAUSE_S * attempt)
    raise AssertionError("unreachable")
