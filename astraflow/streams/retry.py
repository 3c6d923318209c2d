"""Requests the plane did not answer, asked again (:func:`ask_again`).

A request in flight when its server goes away (``up`` restarting a killed server, a cluster electing a leader) is lost
with the connection and times out, while the same read a moment later, on the reconnected client, is answered. A role
that gave up on the first timeout crashed and was restarted with its supervisor's backoff: 15 s of a stalled run for a
server that was back in a tenth of a second. Only requests that can be repeated are asked again: reads, writes of a
whole value under its key (a run-state record), which leave the same state however often they land, and publications
that all carry a message id (the server keeps one copy). Any other append to a stream is not: its repeat would be a
second message.

Given the connection, a request is not waited for past a reconnect: one sent into the connection that dropped is
never answered, and its timeout (10 s) would stall the role; it is asked again at once on the new connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.errors import NoRespondersError
from nats.js import JetStreamContext, JetStreamManager
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

from astraflow.streams.acks import AcksLost, acked, reconnects_of

log = logging.getLogger(__name__)
T = TypeVar("T")
# no answer came (the request may have landed): a timeout, nobody listening, a stream without a leader yet
UNANSWERED = (TimeoutError, NoRespondersError, NoStreamResponseError, ServiceUnavailableError, AcksLost)
PATIENCE_S = 20.0  # how long a request is asked again in all: a cluster elects a stream's new leader within it
PAUSE_S = 0.25  # before the second attempt, doubling up to MAX_PAUSE_S
MAX_PAUSE_S = 2.0
QUICK_S = 2.0  # an attempt at a small request (a run-state record, a consumer's info) not answered by then is lost
LONGER_THAN_ANY_REQUEST_S = 3600.0  # without ``attempt_s``, the request's own timeout ends an attempt first


async def ask_again(request: Callable[[], Awaitable[T]], what: str, js: JetStreamContext | JetStreamManager | None = None,
                    patience: float | None = None, attempt_s: float | None = None) -> T:
    """``request()``, asked again while the plane does not answer, for up to ``patience`` seconds (``PATIENCE_S``);
    its last error then. With ``js`` (the connection it goes out on), an attempt the connection was re-established
    under is given up, and asked again, at once, and ``attempt_s`` bounds one attempt (one sent to a server still
    recovering its streams may never be answered; its own timeout is 10 s)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (PATIENCE_S if patience is None else patience)
    pause = PAUSE_S
    while True:
        try:
            if js is None:
                return await request()
            answer: T = await acked(js, request(), attempt_s or LONGER_THAN_ANY_REQUEST_S, reconnects_of(js))
            return answer
        except UNANSWERED as e:
            lost = isinstance(e, AcksLost)
            if loop.time() + (0.0 if lost else pause) > deadline:
                raise
            log.info("%s: no answer (%s); asking again", what, type(e).__name__)
            if not lost:
                await asyncio.sleep(pause)
                pause = min(2 * pause, MAX_PAUSE_S)
