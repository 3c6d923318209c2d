"""What every role process shares: stop signals, a heartbeat loop, periodic tasks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Awaitable, Callable

log = logging.getLogger(__name__)


def stop_event() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT: roles finish what they hold and leave."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def every(seconds: float, fn: Callable[[], Awaitable[None]], stop: asyncio.Event) -> None:
    """Run ``fn`` every ``seconds`` until ``stop``; an error is logged, never fatal."""
    while not stop.is_set():
        try:
            await fn()
        except Exception as e:  # a failed heartbeat must not kill a worker
            log.warning("periodic %s failed: %s", getattr(fn, "__name__", fn), e)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("nats", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
