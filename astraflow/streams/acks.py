"""Waiting for the server's acks of pipelined publications, and noticing when some can never come.

A publication written into a connection that then drops is lost: its ack never arrives, and nats-py's future waits
until the caller's timeout. The connection's reconnect count tells: a wait that sees it change since the
publications went out stops at once (:class:`AcksLost`), so the caller publishes again (a ``Nats-Msg-Id``
deduplicates; an object is written under a fresh nuid) seconds after a server restart instead of at its timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from nats.js import JetStreamContext, JetStreamManager

POLL_S = 0.5  # how often a wait looks whether the connection was lost meanwhile


class AcksLost(TimeoutError):
    """The connection was lost and re-established while acks were awaited: some may never come."""


def reconnects_of(js: JetStreamContext | JetStreamManager) -> int:
    """How often the connection under ``js`` has been re-established so far."""
    return int(js._nc.stats["reconnects"])


async def acked(js: JetStreamContext | JetStreamManager, acks: Awaitable[Any], timeout: float, reconnects: int) -> Any:
    """``acks``' result within ``timeout`` seconds (``asyncio.TimeoutError`` after); :class:`AcksLost` as soon as the
    connection has been re-established since the publications went out (``reconnects``: the count then)."""
    pending = asyncio.ensure_future(acks)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        left = deadline - loop.time()
        await asyncio.wait((pending,), timeout=min(POLL_S, max(left, 0.0)))  # never raises: its outcome is pending's
        if pending.done():
            return pending.result()
        lost = reconnects_of(js) - reconnects
        if lost or left <= POLL_S:
            pending.cancel()  # what is still awaited is given up
            if lost:
                raise AcksLost(f"{lost} reconnect(s) while acks were awaited")
            raise asyncio.TimeoutError
